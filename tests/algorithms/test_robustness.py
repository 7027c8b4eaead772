"""Numerical robustness of the algorithm core: non-finite inputs give errors that name the field and rows,
garbage at masked (padding) positions changes nothing (values and gradients), empty masks give zeros without
dividing by zero, integer / float16 / bfloat16 inputs are computed in float32."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.advantages import ADVANTAGES, AdvantageInputs
from relayrl.algorithms.entropy import entropy_bonus, entropy_from_logits
from relayrl.algorithms.filtering import dynamic_filter
from relayrl.algorithms.kl import KL_CONTROLLERS, kl_estimate, kl_loss
from relayrl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInputs
from relayrl.algorithms.registry import AGGREGATIONS, OFF_POLICY
from relayrl.algorithms.shaping import RunningRewardNorm, clip_rewards, truncation_penalty
from relayrl.algorithms.value import value_loss

F64 = torch.float64
NAN, INF = float("nan"), float("inf")


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=1e-6, atol=1e-12)


def _batch(seed=0, B=6, T=5):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, 0] = True
    mask[:, -1] = False  # padding column
    return dict(
        r=torch.randn(B, generator=gen, dtype=F64),
        mask=mask,
        values=torch.randn(B, T, generator=gen, dtype=F64),
        kl=torch.rand(B, T, generator=gen, dtype=F64),
    )


def _poison(x, mask, fill=NAN):
    """x with `fill` at every masked position."""
    return torch.where(mask, x, torch.full_like(x, fill))


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantages_never_read_padding(name):
    d = _batch()
    kw = dict(rewards=d["r"], action_mask=d["mask"], group_size=2, kl_coef=0.3)
    clean = ADVANTAGES[name](AdvantageInputs(values=d["values"], kl=d["kl"], **kw), gamma=0.9, lam=0.8)
    dirty = ADVANTAGES[name](
        AdvantageInputs(values=_poison(d["values"], d["mask"]), kl=_poison(d["kl"], d["mask"], INF), **kw),
        gamma=0.9,
        lam=0.8,
    )
    for a, b in zip(clean[:2], dirty[:2], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("field", ["values", "kl"])
def test_advantages_reject_non_finite_on_action_tokens(field):
    d = _batch()
    x = d[field].clone()
    x[3, 0] = NAN  # column 0 is an action token of every row
    inp = AdvantageInputs(rewards=d["r"], action_mask=d["mask"], values=d["values"], kl=d["kl"], kl_coef=0.1)
    setattr(inp, field, x)
    with pytest.raises(ValueError, match=rf"{field} has non-finite values on action tokens of rows \[3\]"):
        ADVANTAGES["gae"](inp)


def test_advantages_reject_inf_reward():
    inp = AdvantageInputs(rewards=torch.tensor([0.0, 1.0, -INF, 0.0]), action_mask=torch.ones(4, 2).bool())
    with pytest.raises(ValueError, match=r"rewards has non-finite values at rows \[2\]"):
        ADVANTAGES["group_norm"](
            AdvantageInputs(rewards=inp.rewards, action_mask=inp.action_mask, group_size=2)
        )


def test_integer_and_half_rewards_are_computed_in_float32():
    # integer rewards [1, 0 | 1, 1]: group 0 mean 0.5, deviations +-0.5, unbiased std sqrt(0.5 / 1);
    # group_norm scores [0.5 / (sqrt(0.5) + 1e-6), -0.5 / (sqrt(0.5) + 1e-6), 0, 0]
    mask = torch.ones(4, 1).bool()
    adv, _, _ = ADVANTAGES["group_norm"](
        AdvantageInputs(rewards=torch.tensor([1, 0, 1, 1]), action_mask=mask, group_size=2)
    )
    s = math.sqrt(0.5)
    assert adv.dtype == torch.float32
    close(adv, [[0.5 / (s + 1e-6)], [-0.5 / (s + 1e-6)], [0.0], [0.0]])
    # bf16 values: the recursion runs in float32 on the bf16-rounded numbers
    d = _batch(1)
    vb = d["values"].bfloat16()
    kw = dict(rewards=d["r"].float(), action_mask=d["mask"])
    got, _, _ = ADVANTAGES["gae"](AdvantageInputs(values=vb, **kw), gamma=0.9, lam=0.8)
    ref, _, _ = ADVANTAGES["gae"](AdvantageInputs(values=vb.float(), **kw), gamma=0.9, lam=0.8)
    assert got.dtype == torch.float32 and torch.equal(got, ref)


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantages_empty_mask(name):
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=F64),
        action_mask=torch.zeros(2, 3).bool(),
        group_size=2,
        values=torch.ones(2, 3, dtype=F64),
    )
    adv, ret, m = ADVANTAGES[name](inp, whiten=True)
    assert torch.equal(adv, torch.zeros(2, 3, dtype=F64)) and torch.equal(ret, torch.zeros(2, 3, dtype=F64))
    assert all(math.isfinite(v) for v in m.values())


# ---------------------------------------------------------------- policy losses


def _policy(seed=3, B=4, T=6, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 2
    logp = old + 0.3 * torch.randn(B, T, generator=gen, dtype=F64)
    adv = torch.randn(B, generator=gen, dtype=F64)[:, None].expand(B, T).clone()
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, 0], mask[:, -1] = True, False
    w = 0.5 + torch.rand(B, T, generator=gen, dtype=F64)
    return logp.to(dtype), old.to(dtype), adv.to(dtype), mask, w.to(dtype)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_never_reads_padding(name):
    logp, old, adv, mask, w = _policy()
    kw = dict(eps_low=0.2, eps_high=0.28)
    lp1 = logp.clone().requires_grad_(True)
    clean, _ = POLICY_LOSSES[name](
        PolicyLossInputs(
            logprobs=lp1, old_logprobs=old, advantages=adv * mask, action_mask=mask, is_weight=w
        ),
        **kw,
    )
    lp2 = _poison(logp, mask, -INF).requires_grad_(True)
    dirty, _ = POLICY_LOSSES[name](
        PolicyLossInputs(
            logprobs=lp2,
            old_logprobs=_poison(old, mask),
            advantages=_poison(adv, mask, INF),
            action_mask=mask,
            is_weight=_poison(w, mask),
        ),
        **kw,
    )
    assert torch.equal(clean, dirty)
    g1, g2 = (torch.autograd.grad(x.sum(), lp)[0] for x, lp in ((clean, lp1), (dirty, lp2)))
    assert torch.equal(g1, g2) and bool((g2[~mask] == 0).all())


@pytest.mark.parametrize("field", ["logprobs", "old_logprobs", "advantages", "is_weight"])
def test_policy_loss_rejects_non_finite_on_action_tokens(field):
    logp, old, adv, mask, w = _policy()
    inp = PolicyLossInputs(logprobs=logp, old_logprobs=old, advantages=adv, action_mask=mask, is_weight=w)
    x = getattr(inp, field).clone()
    x[2, 0] = NAN
    setattr(inp, field, x)
    with pytest.raises(ValueError, match=rf"PolicyLossInputs.{field} has non-finite .* rows \[2\]"):
        POLICY_LOSSES["ppo"](inp)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_empty_mask(name):
    logp, old, adv, mask, _ = _policy()
    lp = logp.requires_grad_(True)
    none = torch.zeros_like(mask)
    loss, m = POLICY_LOSSES[name](
        PolicyLossInputs(logprobs=lp, old_logprobs=old, advantages=adv, action_mask=none)
    )
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(torch.autograd.grad(loss.sum(), lp)[0], torch.zeros_like(lp))
    assert m["clip_frac"] == 0.0 and m["ratio_mean"] == 0.0 and m["ratio_min"] == m["ratio_max"] == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_policy_loss_half_inputs_computed_in_float32(name, dtype):
    logp, old, adv, mask, w = _policy(dtype=dtype)
    kw = dict(eps_low=0.2, eps_high=0.28)
    lp_h = logp.requires_grad_(True)
    got, _ = POLICY_LOSSES[name](
        PolicyLossInputs(logprobs=lp_h, old_logprobs=old, advantages=adv, action_mask=mask, is_weight=w), **kw
    )
    lp_f = logp.detach().float().requires_grad_(True)
    ref, _ = POLICY_LOSSES[name](
        PolicyLossInputs(
            logprobs=lp_f,
            old_logprobs=old.float(),
            advantages=adv.float(),
            action_mask=mask,
            is_weight=w.float(),
        ),
        **kw,
    )
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    g = torch.autograd.grad(got.sum(), lp_h)[0]
    assert g.dtype == dtype
    torch.testing.assert_close(g, torch.autograd.grad(ref.sum(), lp_f)[0].to(dtype), rtol=0, atol=0)


def test_policy_loss_rejects_negative_eps():
    logp, old, adv, mask, _ = _policy()
    inp = PolicyLossInputs(logprobs=logp, old_logprobs=old, advantages=adv, action_mask=mask)
    for name in POLICY_LOSSES:
        with pytest.raises(ValueError, match="eps_low >= 0"):
            POLICY_LOSSES[name](inp, eps_low=-0.1, eps_high=0.2)


def test_aggregation_empty_micro_batch_counts_zero():
    # a micro-batch without action tokens (NaN everywhere) adds nothing: loss_sum 0, count 0, gradient 0
    mask = torch.zeros(2, 3).bool()
    for name in AGGREGATIONS:
        loss = torch.full((2, 3), NAN, dtype=F64, requires_grad=True)
        s, n, _ = AGGREGATIONS[name](loss, mask, norm_const=4.0)
        assert float(s.detach()) == 0.0 and float(n) == 0.0
        assert torch.equal(torch.autograd.grad(s, loss)[0], torch.zeros(2, 3, dtype=F64))


# ---------------------------------------------------------------- KL, value, entropy


def test_kl_padding_nan_and_half_inputs():
    logp, ref, _, mask, _ = _policy()
    for est in ("k1", "k2", "k3"):
        clean, m1 = kl_estimate(logp, ref, mask, estimator=est)
        dirty, m2 = kl_estimate(_poison(logp, mask), _poison(ref, mask, -INF), mask, estimator=est)
        assert torch.equal(clean, dirty) and m1 == m2
    bad = logp.clone()
    bad[1, 0] = NAN
    with pytest.raises(ValueError, match=r"NaN on action tokens of rows \[1\]"):
        kl_loss(bad, ref, mask, coef=0.1)
    got, _ = kl_estimate(logp.bfloat16(), ref.bfloat16(), mask)
    want, _ = kl_estimate(logp.bfloat16().float(), ref.bfloat16().float(), mask)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_adaptive_kl_rejects_nan():
    c = KL_CONTROLLERS["adaptive"](0.1, target=1.0, horizon=100)
    with pytest.raises(ValueError, match="non-finite KL"):
        c.update(NAN, 8)
    assert c.value == 0.1


def test_value_loss_padding_and_clip_eps():
    d = _batch(2)
    mask, v = d["mask"], d["values"]
    old, ret = v + 0.3, v - 0.5
    v1 = v.clone().requires_grad_(True)
    clean, m1 = value_loss(v1, old, ret, mask)
    v2 = _poison(v, mask).requires_grad_(True)
    dirty, m2 = value_loss(v2, _poison(old, mask), _poison(ret, mask, INF), mask)
    assert torch.equal(clean, dirty) and m1 == m2
    assert torch.equal(torch.autograd.grad(clean.sum(), v1)[0], torch.autograd.grad(dirty.sum(), v2)[0])
    with pytest.raises(ValueError, match="clip_eps"):
        value_loss(v, old, ret, mask, clip_eps=0.0)


def test_entropy_with_banned_tokens():
    # logits [0, ln 3, -inf]: the banned token has p = 0; H = that of [1/4, 3/4] = 0.5623351446
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    z = torch.tensor([0.0, math.log(3), -INF], dtype=F64, requires_grad=True)
    ent = entropy_from_logits(z)
    close(ent, h)
    # dH/dz_j = -p_j (log p_j + H): [-(1/4)(ln 1/4 + H), -(3/4)(ln 3/4 + H), 0]
    g = torch.autograd.grad(ent, z)[0]
    close(g, [-0.25 * (math.log(0.25) + h), -0.75 * (math.log(0.75) + h), 0.0])
    with pytest.raises(ValueError, match="temperature"):
        entropy_from_logits(z, temperature=0.0)
    loss, m = entropy_bonus(torch.tensor([[1.0, NAN]], dtype=F64), torch.tensor([[1, 0]]).bool(), coef=0.5)
    close(loss, [[-0.5, 0.0]])
    assert m["entropy"] == 1.0


# ---------------------------------------------------------------- off-policy, shaping, filtering


def test_off_policy_padding_nan_and_errors():
    logp, old, _, mask, _ = _policy()
    for name in OFF_POLICY:
        w1, k1, m1 = OFF_POLICY[name](logp, old, mask)
        w2, k2, m2 = OFF_POLICY[name](_poison(logp, mask), _poison(old, mask, -INF), mask)
        assert torch.equal(w1, w2) and torch.equal(k1 & mask, k2 & mask) and m1 == m2
    bad = old.clone()
    bad[3, 0] = NAN
    with pytest.raises(ValueError, match=r"NaN on action tokens of rows \[3\]"):
        OFF_POLICY["tis"](logp, bad, mask)
    with pytest.raises(ValueError, match="low <= high"):
        OFF_POLICY["icepop"](logp, old, mask, low=2.0, high=1.0)
    # the engine gave a sampled token log-prob -inf: log w = +inf -> clamped to 20 -> TIS weight = high = 2
    roll = old.clone()
    roll[0, 0] = -INF
    w, _, m = OFF_POLICY["tis"](old, roll, mask)
    assert float(w[0, 0]) == 2.0 and math.isfinite(m["kl_rollout_train"])


def test_shaping_and_filtering_reject_non_finite():
    r = torch.tensor([0.0, NAN, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        clip_rewards(r, low=-1.0, high=1.0)
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        truncation_penalty(r, torch.zeros(4).bool(), penalty=1.0)
    norm = RunningRewardNorm()
    norm(torch.tensor([1.0, 2.0]))
    state = norm.state_dict()
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        norm(r)
    assert norm.state_dict() == state  # a bad batch does not poison the running statistics
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        dynamic_filter(r, group_size=2)
    with pytest.raises(ValueError, match="mean_range"):
        dynamic_filter(torch.zeros(4), group_size=2, mean_range=(0.9, 0.1))
