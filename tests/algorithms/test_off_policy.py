"""Off-policy correction (none, TIS, ICEPOP, seq-mask-TIS): hand values, metrics, default bounds, loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.registry import OFF_POLICY

F64 = torch.float64


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=F64), rtol=1e-6, atol=1e-12)


# row 0: log w = old - rollout = [ln 3, ln 0.25, 0]; row 1: [ln 4, ln 4, (masked)]
OLD = torch.tensor([[math.log(3), math.log(0.25), 0.0], [math.log(4), math.log(4), 5.0]], dtype=F64)
ROLL = torch.zeros(2, 3, dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]]).bool()


def test_none_hand():
    # weight 1 on action tokens, 0 off them; nothing masked; no metrics; bounds ignored
    for bounds in ({}, {"low": 0.9, "high": 1.1}):
        w, keep, m = OFF_POLICY["none"](OLD, ROLL, MASK, **bounds)
        close(w, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
        assert keep.dtype == torch.bool and bool(keep.all()) and m == {}
    w, _, _ = OFF_POLICY["none"](OLD.bfloat16(), ROLL.bfloat16(), MASK)
    assert w.dtype == torch.float32


# the documented bounds each method applies when low / high are None (algo.off_policy_low/high default)
DEFAULT_BOUNDS = {"tis": (0.0, 2.0), "icepop": (0.5, 5.0), "seq_mask_tis": (0.5, 2.0)}


@pytest.mark.parametrize("name", sorted(DEFAULT_BOUNDS))
def test_none_bounds_mean_the_method_default_and_explicit_bounds_win(name):
    gen = torch.Generator().manual_seed(2)
    old = -torch.rand(8, 6, generator=gen, dtype=F64) * 2
    roll = old + 0.8 * torch.randn(8, 6, generator=gen, dtype=F64)
    mask = torch.rand(8, 6, generator=gen) < 0.8
    lo, hi = DEFAULT_BOUNDS[name]
    ref = OFF_POLICY[name](old, roll, mask, low=lo, high=hi)
    for kw in ({}, {"low": None, "high": None}, {"low": lo}, {"high": hi}):
        w, keep, m = OFF_POLICY[name](old, roll, mask, **kw)
        assert torch.equal(w, ref[0]) and torch.equal(keep, ref[1]) and m == ref[2]
    w, _, _ = OFF_POLICY[name](old, roll, mask, low=0.9, high=1.1)
    assert not torch.equal(w, ref[0])


def test_tis_hand():
    # w = min(w, 2) = [[2, 0.25, 1], [2, 2, 0]], nothing masked; mean weight = 7.25 / 5 = 1.45
    w, keep, m = OFF_POLICY["tis"](OLD, ROLL, MASK)
    close(w, [[2.0, 0.25, 1.0], [2.0, 2.0, 0.0]])
    assert bool(keep.all()) and m["masked_frac"] == 0.0
    assert m["is_weight_mean"] == pytest.approx(1.45)
    # KL(rollout || train) k3 = mean(w - 1 - ln w) over the 5 action tokens
    k3 = (3 - 1 - math.log(3)) + (0.25 - 1 - math.log(0.25)) + 0 + 2 * (4 - 1 - math.log(4))
    assert m["kl_rollout_train"] == pytest.approx(k3 / 5)
    assert m["kl_rollout_train_k1"] == pytest.approx(-(math.log(3) + math.log(0.25) + 2 * math.log(4)) / 5)
    # interval form [0.5, 5]: 0.25 -> 0.5
    w, _, _ = OFF_POLICY["tis"](OLD, ROLL, MASK, low=0.5, high=5.0)
    close(w, [[3.0, 0.5, 1.0], [4.0, 4.0, 0.0]])


def test_icepop_hand():
    # [0.5, 5]: 3 kept, 0.25 masked, 1 kept, 4 kept, 4 kept -> w = [[3, 0, 1], [4, 4, 0]]; masked 1/5
    w, keep, m = OFF_POLICY["icepop"](OLD, ROLL, MASK)
    close(w, [[3.0, 0.0, 1.0], [4.0, 4.0, 0.0]])
    assert keep[0].tolist() == [True, False, True]
    assert m["masked_frac"] == pytest.approx(0.2)


def test_seq_mask_tis_hand():
    # row 0 geometric mean = (3 * 0.25 * 1)^(1/3) = 0.9086 in [0.5, 2] -> kept, weights min(w, 2)
    # row 1 geometric mean = 4 > 2 -> whole row masked
    w, keep, m = OFF_POLICY["seq_mask_tis"](OLD, ROLL, MASK)
    close(w, [[2.0, 0.25, 1.0], [0.0, 0.0, 0.0]])
    assert keep.tolist() == [[True] * 3, [False] * 3]
    assert m["masked_frac"] == pytest.approx(2 / 5) and m["masked_seq_frac"] == 0.5


@pytest.mark.parametrize("name", sorted(OFF_POLICY))
def test_matches_loop(name):
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(6, 7, generator=gen, dtype=F64) * 2
    roll = old + 0.5 * torch.randn(6, 7, generator=gen, dtype=F64)
    mask = torch.rand(6, 7, generator=gen) < 0.8
    w, _, _ = OFF_POLICY[name](old, roll, mask, low=0.7, high=1.6)
    ref = []
    for o, r, mk in zip(old.tolist(), roll.tolist(), mask.tolist(), strict=True):
        lw = [a - b for a, b, k in zip(o, r, mk, strict=True) if k]
        geo = math.exp(sum(lw) / max(len(lw), 1))
        row = []
        for a, b, k in zip(o, r, mk, strict=True):
            x = math.exp(a - b)
            if not k:
                row.append(0.0)
            elif name == "none":
                row.append(1.0)
            elif name == "tis":
                row.append(min(max(x, 0.7), 1.6))
            elif name == "icepop":
                row.append(x if 0.7 <= x <= 1.6 else 0.0)
            else:
                row.append(min(x, 1.6) if 0.7 <= geo <= 1.6 else 0.0)
        ref.append(row)
    close(w, ref)


def test_logprob_mismatch_hand_worked():
    from relayrl.algorithms.off_policy import logprob_mismatch

    trainer = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-0.5, -0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.1, -2.0, -2.0, 9.0], [-0.4, -0.1, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)
    m = logprob_mismatch(trainer, rollout, mask)
    diffs = torch.tensor([0.1, 0.0, 1.0, 0.1, 0.4], dtype=torch.float64)  # the 5 action tokens
    assert m["logprob_absdiff_mean"] == pytest.approx(1.6 / 5, rel=1e-6)
    assert m["logprob_absdiff_p99"] == pytest.approx(float(torch.quantile(diffs, 0.99)), rel=1e-6)
    assert m["logprob_absdiff_max"] == pytest.approx(1.0, rel=1e-6)
    # row 0: log ratio -0.1 + 0 - 1 = -1.1 (ratio 0.33, out); row 1: -0.1 - 0.4 = -0.5 (0.61, in); row 2 no tokens
    assert m["seq_ratio_out_frac"] == pytest.approx(0.5)
    assert logprob_mismatch(trainer, rollout, torch.zeros_like(mask)) == {}
