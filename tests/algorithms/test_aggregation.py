"""Aggregation: (loss_sum, count) by hand, padding never leaks, loop reference, and a step's value and gradient
sum(loss_sum_i) / sum(count_i) do not depend on the micro-batch / rank split."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.entropy import entropy_bonus, entropy_from_logits
from relayrl.algorithms.kl import kl_loss
from relayrl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInputs
from relayrl.algorithms.registry import AGGREGATIONS, OFF_POLICY
from relayrl.algorithms.value import value_loss

F64 = torch.float64
NAMES = sorted(AGGREGATIONS)


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=F64), rtol=1e-6, atol=1e-12)


# 3 rows: 3 action tokens, 1 action token, none (not counted by any mode)
LOSS = [[0.5, -1.25, 2.0, 4.0], [3.0, 7.0, 9.0, 9.0], [1.5, 1.5, 1.5, 1.5]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool()


@pytest.mark.parametrize(
    ("name", "loss_sum", "count", "grad"),
    [
        # sum of the 4 action tokens 0.5 - 1.25 + 2 + 3 = 4.25 over 4 tokens (= 1.0625); d/dl = m
        ("token_mean", 4.25, 4.0, [[1, 1, 1, 0], [1, 0, 0, 0], [0] * 4]),
        # row means 1.25 / 3 and 3 / 1: 0.41666... + 3 = 3.41666... over 2 sequences; d/dl = m / n_i
        ("seq_mean_token_mean", 1.25 / 3 + 3.0, 2.0, [[1 / 3, 1 / 3, 1 / 3, 0], [1, 0, 0, 0], [0] * 4]),
        # row sums over norm_const 5: (1.25 + 3) / 5 = 0.85 over 2 sequences; d/dl = m / 5
        ("seq_mean_token_sum_norm", 0.85, 2.0, [[0.2, 0.2, 0.2, 0], [0.2, 0, 0, 0], [0] * 4]),
    ],
)
def test_hand_values(name, loss_sum, count, grad):
    loss = torch.tensor(LOSS, dtype=F64, requires_grad=True)
    s, n, metrics = AGGREGATIONS[name](loss, MASK, norm_const=5.0)
    assert s.dim() == 0 and n.dim() == 0 and not n.requires_grad and metrics == {}
    assert n.dtype == F64  # float64 loss -> float64 count
    close(s, loss_sum)
    close(n, count)
    close(torch.autograd.grad(s, loss)[0], grad)


def test_norm_const_required():
    loss = torch.tensor(LOSS, dtype=F64)
    for bad in (None, 0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="norm_const > 0"):
            AGGREGATIONS["seq_mean_token_sum_norm"](loss, MASK, norm_const=bad)
    # the other modes ignore it
    AGGREGATIONS["token_mean"](loss, MASK)
    AGGREGATIONS["seq_mean_token_mean"](loss, MASK)


@pytest.mark.parametrize("name", NAMES)
def test_nan_and_inf_at_padding_never_leak(name):
    clean = torch.tensor(LOSS, dtype=F64, requires_grad=True)
    poisoned = torch.tensor(LOSS, dtype=F64)
    poisoned[0, 3], poisoned[1, 1], poisoned[1, 2], poisoned[2] = math.nan, math.inf, -math.inf, math.nan
    poisoned.requires_grad_(True)
    s1, n1, _ = AGGREGATIONS[name](clean, MASK, norm_const=5.0)
    s2, n2, _ = AGGREGATIONS[name](poisoned, MASK, norm_const=5.0)
    assert torch.isfinite(s2) and torch.equal(s1, s2) and torch.equal(n1, n2)
    g1, g2 = torch.autograd.grad(s1, clean)[0], torch.autograd.grad(s2, poisoned)[0]
    assert torch.isfinite(g2).all() and torch.equal(g1, g2)


@pytest.mark.parametrize("name", NAMES)
def test_half_precision_sums_in_float32_and_shape_error(name):
    loss = torch.tensor(LOSS, dtype=torch.bfloat16)
    s, n, _ = AGGREGATIONS[name](loss, MASK, norm_const=5.0)
    ref, _, _ = AGGREGATIONS[name](loss.float(), MASK, norm_const=5.0)
    assert s.dtype == n.dtype == torch.float32 and torch.equal(s, ref)
    with pytest.raises(ValueError, match=r"loss \(3, 4\) and action_mask \(3, 3\)"):
        AGGREGATIONS[name](loss, MASK[:, :3], norm_const=5.0)


@pytest.mark.parametrize("name", NAMES)
def test_matches_loop(name):
    gen = torch.Generator().manual_seed(3)
    loss = torch.randn(7, 9, generator=gen, dtype=F64)
    mask = torch.rand(7, 9, generator=gen) < 0.5
    mask[2] = False
    s, n, _ = AGGREGATIONS[name](loss, mask, norm_const=6.0)
    want_s = want_n = 0.0
    for row, mk in zip(loss.tolist(), mask.tolist(), strict=True):
        kept = [x for x, k in zip(row, mk, strict=True) if k]
        if name == "token_mean":
            want_s, want_n = want_s + sum(kept), want_n + len(kept)
        elif kept:
            want_s += sum(kept) / (len(kept) if name == "seq_mean_token_mean" else 6.0)
            want_n += 1
    close(s, want_s)
    close(n, want_n)


@pytest.mark.parametrize("name", NAMES)
def test_micro_batch_split_gives_the_whole_batch_value_and_gradient(name):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(9, 6, generator=gen, dtype=F64, requires_grad=True)
    mask = torch.rand(9, 6, generator=gen) < 0.6
    mask[4:6] = False  # one micro-batch below has no action token at all
    s, n, _ = AGGREGATIONS[name](loss, mask, norm_const=6.0)
    whole = s / n
    parts = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 9)]
    outs = [AGGREGATIONS[name](loss[p], mask[p], norm_const=6.0) for p in parts]
    split = sum(o[0] for o in outs) / sum(o[1] for o in outs)
    close(split, float(whole.detach()))
    close(torch.autograd.grad(split, loss)[0], torch.autograd.grad(whole, loss)[0])


def _step(gen, B=10, T=8, H=5, V=7):
    """A tiny log-linear policy: logp = log_softmax(x @ theta)[target]; experience for one step."""
    theta = torch.randn(H, V, generator=gen, dtype=F64, requires_grad=True)
    x = torch.randn(B, T, H, generator=gen, dtype=F64)
    tgt = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.rand(B, T, generator=gen) < 0.6
    mask[:, 0] = True
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask &= torch.arange(T) < lengths[:, None]  # very different lengths per row
    old = torch.log_softmax(x @ theta.detach(), -1).gather(-1, tgt[..., None]).squeeze(-1)
    old = old + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, generator=gen, dtype=F64)[:, None].expand(B, T) * mask
    roll = old + 0.5 * torch.randn(B, T, generator=gen, dtype=F64)  # the engine's log-probs (off-policy)
    return theta, x, tgt, mask, old, adv, roll


def _sum_grad(theta, x, tgt, mask, old, adv, roll, rows, loss_name, agg_name):
    """(grad of this micro-batch's loss_sum, its count)."""
    logits = x[rows] @ theta
    logp = torch.log_softmax(logits, -1).gather(-1, tgt[rows][..., None]).squeeze(-1)
    m = mask[rows]
    if loss_name == "value":  # the "value" is the target's logit; returns = advantages
        loss, _ = value_loss(logits.gather(-1, tgt[rows][..., None]).squeeze(-1), old[rows], adv[rows], m)
    elif loss_name == "kl_k3":  # old log-probs stand in for the reference model
        loss, _ = kl_loss(logp, old[rows], m, coef=0.1, estimator="k3")
    elif loss_name == "entropy":
        loss, _ = entropy_bonus(entropy_from_logits(logits), m, coef=0.01)
    else:  # "loss" or "loss+correction": the correction's keep-mask narrows the loss mask, not the count
        name, _, corr = loss_name.partition("+")
        w, keep, _ = OFF_POLICY[corr or "none"](old[rows], roll[rows], m)
        inp = PolicyLossInputs(
            logprobs=logp,
            old_logprobs=old[rows],
            advantages=adv[rows],
            action_mask=m & keep,
            is_weight=w if corr else None,
        )
        loss, _ = POLICY_LOSSES[name](inp, eps_low=0.2, eps_high=0.28)
    s, n, _ = AGGREGATIONS[agg_name](loss, m, norm_const=8.0)
    return torch.autograd.grad(s, theta)[0], float(n)


LOSSES = ["ppo", "dual_clip", "gspo", "cispo", "value", "kl_k3", "entropy", "ppo+icepop", "gspo+seq_mask_tis"]


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("agg_name", NAMES)
def test_microbatch_and_rank_invariance(loss_name, agg_name):
    gen = torch.Generator().manual_seed(7)
    data = _step(gen)
    g_full, n_full = _sum_grad(*data, slice(0, 10), loss_name, agg_name)
    full = g_full / n_full
    # 2 simulated ranks x uneven micro-batches: sum the loss_sum gradients and the counts ("all-reduce"),
    # divide once by the global count
    ranks = [[slice(0, 1), slice(1, 4)], [slice(4, 5), slice(5, 7), slice(7, 10)]]
    parts = [_sum_grad(*data, s, loss_name, agg_name) for mbs in ranks for s in mbs]
    assert sum(n for _, n in parts) == n_full
    split = sum(g for g, _ in parts) / sum(n for _, n in parts)
    torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-13)
    # the common mistake (each micro-batch's own mean, then averaged) gives a different gradient
    wrong = sum(g / n for g, n in parts) / len(parts)
    assert not torch.allclose(wrong, full, rtol=1e-6)
