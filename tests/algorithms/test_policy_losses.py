"""Policy losses: hand-worked values and gradients (float64), loop references, input checks."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInputs
from relayrl.algorithms.registry import AGGREGATIONS

F64 = torch.float64


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=F64), rtol=1e-6, atol=1e-12)


def make(log_ratio, adv, logp=None, mask=None, is_weight=None):
    lr = torch.tensor([log_ratio], dtype=F64)
    logp = torch.tensor([logp], dtype=F64) if logp is not None else torch.zeros_like(lr)
    logp.requires_grad_(True)
    return PolicyLossInputs(
        logprobs=logp,
        old_logprobs=logp.detach() - lr,
        advantages=torch.tensor([adv], dtype=F64),
        action_mask=torch.ones_like(lr, dtype=torch.bool) if mask is None else torch.tensor([mask]).bool(),
        is_weight=None if is_weight is None else torch.tensor([is_weight], dtype=F64),
    )


def grad(loss, inp):
    return torch.autograd.grad(loss.sum(), inp.logprobs)[0]


def test_ppo_hand():
    # r = [1.5, 0.5, 1.1, 0.7], A = [1, 1, -1, -1], eps = 0.2
    # t0: min(1.5, 1.2) = 1.2 (clipped) ; t1: min(0.5, 0.8) = 0.5 ; t2: min(-1.1, -1.1) = -1.1 ;
    # t3: min(-0.7, -0.8) = -0.8 (clipped). loss = -min = [-1.2, -0.5, 1.1, 0.8]
    # d loss / d logp = -A r where unclipped, 0 where clipped = [0, -0.5, 1.1, 0]
    inp = make([math.log(1.5), math.log(0.5), math.log(1.1), math.log(0.7)], [1.0, 1.0, -1.0, -1.0])
    loss, m = POLICY_LOSSES["ppo"](inp)
    close(loss, [[-1.2, -0.5, 1.1, 0.8]])
    close(grad(loss, inp), [[0.0, -0.5, 1.1, 0.0]])
    assert m["clip_frac"] == 0.5
    assert m["ratio_max"] == pytest.approx(1.5) and m["ratio_min"] == pytest.approx(0.5)
    # approx_kl = mean(r - 1 - log r)
    exp_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.7)) / 4
    assert m["approx_kl"] == pytest.approx(exp_kl, rel=1e-9)


def test_ppo_clip_higher_and_is_weight_and_mask():
    # eps_low 0.2, eps_high 0.28: t0 r=1.5, A=1 -> -min(1.5, 1.28) = -1.28; t1 r=0.7, A=1 -> -0.7
    # is_weight [2, 0.5] -> [-2.56, -0.35]; t2 masked out -> 0
    inp = make(
        [math.log(1.5), math.log(0.7), 0.3], [1.0, 1.0, 5.0], mask=[1, 1, 0], is_weight=[2.0, 0.5, 7.0]
    )
    loss, m = POLICY_LOSSES["ppo"](inp, eps_low=0.2, eps_high=0.28)
    close(loss, [[-2.56, -0.35, 0.0]])
    assert m["clip_frac"] == 0.5


def test_dual_clip_hand():
    # A = -1: r = 5 -> ppo loss -min(-5, -1.2) = 5, dual cap -c A = 3 -> 3 (grad 0);
    #          r = 2 -> ppo loss 2 < 3 (grad -A r = 2); A = +1, r = 5 -> -1.2 (dual-clip not applied)
    inp = make([math.log(5.0), math.log(2.0), math.log(5.0)], [-1.0, -1.0, 1.0])
    loss, m = POLICY_LOSSES["dual_clip"](inp)  # c = 3
    close(loss, [[3.0, 2.0, -1.2]])
    close(grad(loss, inp), [[0.0, 2.0, 0.0]])
    assert m["dual_clip_frac"] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        POLICY_LOSSES["ppo"](inp, dual_clip=0.5)


def test_gspo_hand():
    # token log-ratios [0.1, -0.3] (+ a masked token) -> s = exp(mean) = exp(-0.1) = 0.904837418; A = 2
    # eps 0.2: unclipped: loss_t = -2 s = -1.809674836 on both tokens; grad_t = -A s = -1.809674836
    inp = make([0.1, -0.3, 4.0], [2.0, 2.0, 2.0], mask=[1, 1, 0])
    loss, m = POLICY_LOSSES["gspo"](inp, eps_low=0.2, eps_high=0.2)
    s = math.exp(-0.1)
    close(loss, [[-2 * s, -2 * s, 0.0]])
    close(grad(loss, inp), [[-2 * s, -2 * s, 0.0]])
    assert m["clip_frac"] == 0.0
    # default eps (3e-4, 4e-4), log-ratios [0.3, -0.1]: s = exp(0.1) = 1.105 > 1 + 4e-4 with A > 0 -> clipped:
    # -min(2 s, 2 * 1.0004) = -2.0008 on both tokens, grad 0
    inp = make([0.3, -0.1, 4.0], [2.0, 2.0, 2.0], mask=[1, 1, 0])
    loss, m = POLICY_LOSSES["gspo"](inp)
    close(loss, [[-2 * (1 + 4e-4), -2 * (1 + 4e-4), 0.0]])
    close(grad(loss, inp), [[0.0, 0.0, 0.0]])
    assert m["clip_frac"] == 1.0
    assert m["ratio_mean"] == pytest.approx(math.exp(0.1))


def test_cispo_hand():
    # r = [1.5, 0.5], A = [1, -2], logp = [-1, -2]; weight = clip(r, 0, 1.28) = [1.28, 0.5]
    # loss = -w A logp = [-1.28*1*(-1), -0.5*(-2)*(-2)] = [1.28, -2.0]; grad = -w A = [-1.28, 1.0]
    inp = make([math.log(1.5), math.log(0.5)], [1.0, -2.0], logp=[-1.0, -2.0])
    loss, m = POLICY_LOSSES["cispo"](inp)
    close(loss, [[1.28, -2.0]])
    close(grad(loss, inp), [[-1.28, 1.0]])
    assert m["clip_frac"] == 0.5


def test_log_ratio_clamp():
    # log-ratio 50 is clamped to 20 before exp: ppo with A = -1 -> loss = r = e^20, finite; the clamp
    # cuts the gradient (d clamp / dx = 0 outside the range)
    inp = make([50.0], [-1.0])
    loss, _ = POLICY_LOSSES["ppo"](inp)
    close(loss, [[math.exp(20.0)]])
    close(grad(loss, inp), [[0.0]])
    # gspo: token log-ratios [30, 30] -> sequence mean 30, clamped to 20: s = e^20; A = -1 -> loss = e^20 per
    # token (-min(-e^20, -(1 + 4e-4))), gradient 0 like a clamped ppo token (not e^20 * grad log pi)
    inp = make([30.0, 30.0], [-1.0, -1.0])
    loss, m = POLICY_LOSSES["gspo"](inp)
    close(loss, [[math.exp(20.0), math.exp(20.0)]])
    close(grad(loss, inp), [[0.0, 0.0]])
    assert m["ratio_max"] == pytest.approx(math.exp(20.0))
    # cispo: the weight is clip(e^20, 0, 1.28) = 1.28; loss = -1.28 * A * logp with logp = 0 -> 0, grad -1.28 A
    inp = make([50.0], [-1.0])
    loss, _ = POLICY_LOSSES["cispo"](inp)
    close(grad(loss, inp), [[1.28]])


def test_gspo_gradient_is_the_sequence_objective_gradient():
    # GSPO (arXiv 2507.18071, eq. 5-7) differentiated straight through the sequence ratio:
    #   J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),  s_i = exp(mean_t log r_i,t)
    # The GSPO-token loss aggregated with seq_mean_token_mean must equal -J in value and gradient.
    gen = torch.Generator().manual_seed(11)
    B, T = 10, 6
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 2
    logp = (old + 0.15 * torch.randn(B, T, generator=gen, dtype=F64)).requires_grad_(True)
    mask = torch.rand(B, T, generator=gen) < 0.8
    mask[:, 0] = True
    a_seq = torch.randn(B, generator=gen, dtype=F64)
    lo, hi = 0.01, 0.02
    inp = PolicyLossInputs(
        logprobs=logp, old_logprobs=old, advantages=a_seq[:, None] * mask, action_mask=mask
    )
    loss, m = POLICY_LOSSES["gspo"](inp, eps_low=lo, eps_high=hi)
    loss_sum, count, _ = AGGREGATIONS["seq_mean_token_mean"](loss, mask)
    assert float(count) == B
    agg = loss_sum / count
    s = torch.exp(((logp - old) * mask).sum(dim=1) / mask.sum(dim=1))
    J = torch.minimum(s * a_seq, s.clamp(1 - lo, 1 + hi) * a_seq).mean()
    close(agg, -J)
    close(torch.autograd.grad(agg, logp)[0], -torch.autograd.grad(J, logp)[0])
    assert 0.2 < m["clip_frac"] < 0.8  # both clipped and unclipped sequences are exercised


def test_shape_error_names_field():
    inp = make([0.0, 0.0], [1.0, 1.0])
    inp.advantages = torch.zeros(1, 3, dtype=F64)
    with pytest.raises(ValueError, match="advantages"):
        POLICY_LOSSES["ppo"](inp)


def _ref_loss(name, logp, old, adv, mask, lo, hi, c):
    """Per-token (per-sequence for gspo) python loops with math.*; returns values and d/dlogp."""
    B, T = len(logp), len(logp[0])
    loss = [[0.0] * T for _ in range(B)]
    g = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        if name == "gspo":
            s = math.exp(sum(logp[b][t] - old[b][t] for t in idx) / max(len(idx), 1))
        for t in idx:
            a = adv[b][t]
            r = s if name == "gspo" else math.exp(logp[b][t] - old[b][t])
            if name == "cispo":
                w = min(max(r, 1 - lo), 1 + hi)
                loss[b][t], g[b][t] = -w * a * logp[b][t], -w * a
                continue
            s1, s2 = r * a, min(max(r, 1 - lo), 1 + hi) * a
            val, gr = (-s1, -r * a) if s1 <= s2 else (-s2, 0.0)
            if c is not None and a < 0 and val > -c * a:
                val, gr = -c * a, 0.0
            loss[b][t], g[b][t] = val, gr
    return torch.tensor(loss, dtype=F64), torch.tensor(g, dtype=F64)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_vectorised_matches_loop(name):
    gen = torch.Generator().manual_seed(3)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3
    logp = (old + 0.4 * torch.randn(B, T, generator=gen, dtype=F64)).requires_grad_(True)
    adv = torch.randn(B, T, generator=gen, dtype=F64)
    mask = torch.rand(B, T, generator=gen) < 0.8
    lo, hi = (0.1, 0.15) if name == "gspo" else (0.2, 0.28)
    c = 3.0 if name == "dual_clip" else None
    inp = PolicyLossInputs(logprobs=logp, old_logprobs=old, advantages=adv * mask, action_mask=mask)
    loss, _ = POLICY_LOSSES[name](inp, eps_low=lo, eps_high=hi, dual_clip=c)
    # gspo's per-token gradient s * A * grad log pi is the GSPO-token form; the loop checks that value
    ref, ref_g = _ref_loss(name, logp.tolist(), old.tolist(), (adv * mask).tolist(), mask.tolist(), lo, hi, c)
    close(loss, ref)
    close(torch.autograd.grad(loss.sum(), logp)[0], ref_g)
