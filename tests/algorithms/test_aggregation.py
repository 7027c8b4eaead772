"""Aggregation: hand values, and the gradient of a step does not depend on micro-batch / rank split."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms.aggregation import AGGREGATIONS, step_denominators
from relayrl.algorithms.entropy import entropy_bonus, entropy_from_logits
from relayrl.algorithms.kl import kl_loss
from relayrl.algorithms.off_policy import OFF_POLICY
from relayrl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInputs
from relayrl.algorithms.value_loss import value_loss

F64 = torch.float64


def test_hand_values():
    # loss [[1,2,3],[4,0,0]], mask [[1,1,1],[1,0,0]] (+ a row without action tokens)
    # token_mean = (1+2+3+4)/4 = 2.5 ; seq_mean_token_mean = (6/3 + 4/1)/2 = 3.0 ;
    # seq_mean_token_sum_norm (norm_const 5) = (6/5 + 4/5)/2 = 1.0
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]]).bool()
    n_tok, n_seq = step_denominators([mask])
    assert (n_tok, n_seq) == (4.0, 2.0)
    kw = dict(num_tokens=n_tok, num_seqs=n_seq, norm_const=5.0)
    assert float(AGGREGATIONS["token_mean"](loss, mask, **kw)[0]) == pytest.approx(2.5, rel=1e-12)
    assert float(AGGREGATIONS["seq_mean_token_mean"](loss, mask, **kw)[0]) == pytest.approx(3.0, rel=1e-12)
    assert float(AGGREGATIONS["seq_mean_token_sum_norm"](loss, mask, **kw)[0]) == pytest.approx(
        1.0, rel=1e-12
    )
    with pytest.raises(ValueError, match="norm_const"):
        AGGREGATIONS["seq_mean_token_sum_norm"](loss, mask, num_tokens=4, num_seqs=2)


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


def _grad(theta, x, tgt, mask, old, adv, roll, rows, loss_name, agg_name, denoms):
    logits = x[rows] @ theta
    logp = torch.log_softmax(logits, -1).gather(-1, tgt[rows][..., None]).squeeze(-1)
    m = mask[rows]
    if loss_name == "value":  # the "value" is the target's logit; returns = advantages
        loss, _ = value_loss(logits.gather(-1, tgt[rows][..., None]).squeeze(-1), old[rows], adv[rows], m)
    elif loss_name == "kl_k3":  # old log-probs stand in for the reference model
        loss, _ = kl_loss(logp, old[rows], m, coef=0.1, estimator="k3")
    elif loss_name == "entropy":
        loss, _ = entropy_bonus(entropy_from_logits(logits), m, coef=0.01)
    else:  # "loss" or "loss+correction": the correction's keep-mask narrows the loss mask, not the denominators
        name, _, corr = loss_name.partition("+")
        w, keep = None, torch.ones_like(m)
        if corr:
            w, keep, _ = OFF_POLICY[corr](old[rows], roll[rows], m)
        inp = PolicyLossInputs(
            logprobs=logp, old_logprobs=old[rows], advantages=adv[rows], action_mask=m & keep, is_weight=w
        )
        loss, _ = POLICY_LOSSES[name](inp, eps_low=0.2, eps_high=0.28)
    agg, _ = AGGREGATIONS[agg_name](loss, m, **denoms)
    return torch.autograd.grad(agg, theta)[0]


LOSSES = ["ppo", "dual_clip", "gspo", "cispo", "value", "kl_k3", "entropy", "ppo+icepop", "gspo+seq_mask_tis"]


@pytest.mark.parametrize("loss_name", LOSSES)
@pytest.mark.parametrize("agg_name", sorted(AGGREGATIONS))
def test_microbatch_and_rank_invariance(loss_name, agg_name):
    gen = torch.Generator().manual_seed(7)
    theta, x, tgt, mask, old, adv, roll = _step(gen)
    n_tok, n_seq = step_denominators([mask])
    denoms = dict(num_tokens=n_tok, num_seqs=n_seq, norm_const=8.0)
    full = _grad(theta, x, tgt, mask, old, adv, roll, slice(0, 10), loss_name, agg_name, denoms)
    # 2 simulated ranks x uneven micro-batches; each rank counts its own masks, then "all-reduce" (sum)
    ranks = [[slice(0, 1), slice(1, 4)], [slice(4, 5), slice(5, 7), slice(7, 10)]]
    per_rank = [step_denominators([mask[s] for s in mbs]) for mbs in ranks]
    g_tok, g_seq = (sum(c) for c in zip(*per_rank, strict=True))
    assert (g_tok, g_seq) == (n_tok, n_seq)
    denoms = dict(num_tokens=g_tok, num_seqs=g_seq, norm_const=8.0)
    split = sum(
        _grad(theta, x, tgt, mask, old, adv, roll, s, loss_name, agg_name, denoms)
        for mbs in ranks
        for s in mbs
    )
    torch.testing.assert_close(split, full, rtol=1e-10, atol=1e-13)
    # the common mistake (per-micro-batch denominators, then averaging) gives a different gradient
    wrong = 0
    for mbs in ranks:
        for s in mbs:
            t, q = step_denominators([mask[s]])
            wrong = (
                wrong
                + _grad(
                    theta,
                    x,
                    tgt,
                    mask,
                    old,
                    adv,
                    roll,
                    s,
                    loss_name,
                    agg_name,
                    dict(num_tokens=t, num_seqs=q, norm_const=8.0),
                )
                / 5
            )
    assert not torch.allclose(wrong, full, rtol=1e-6)
