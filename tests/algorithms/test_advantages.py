"""Advantage estimators: hand-worked values (float64), loop references, n=1 rejection, rank invariance."""

from __future__ import annotations

import concurrent.futures
import math
import threading

import pytest
import torch

from relayrl.algorithms.advantages import (
    ADVANTAGES,
    AdvantageInputs,
    masked_mean_std,
    masked_moments,
    moments_to_mean_std,
    whiten,
)
from relayrl.algorithms.registry import needs_groups

GROUP_ESTIMATORS = sorted(n for n in ADVANTAGES if needs_groups(n))

F64 = torch.float64


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=F64), rtol=1e-6, atol=1e-12)


def test_gae_hand_multi_turn():
    # One row, action tokens at 0, 1, 3 (position 2 = env feedback, skipped). r = 1, gamma 0.9, lam 0.5.
    # V at actions: 0.5, 0.6, 0.8 (9.9 at the env token is ignored).
    # delta_3 = 1 - 0.8 = 0.2 ; delta_1 = 0.9*0.8 - 0.6 = 0.12 ; delta_0 = 0.9*0.6 - 0.5 = 0.04
    # A_3 = 0.2 ; A_1 = 0.12 + 0.45*0.2 = 0.21 ; A_0 = 0.04 + 0.45*0.21 = 0.1345
    # returns = A + V = 0.6345, 0.81, 0, 1.0
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=F64),
        action_mask=torch.tensor([[1, 1, 0, 1]], dtype=torch.bool),
        values=torch.tensor([[0.5, 0.6, 9.9, 0.8]], dtype=F64),
    )
    adv, ret, m = ADVANTAGES["gae"](inp, gamma=0.9, lam=0.5)
    close(adv, [[0.1345, 0.21, 0.0, 0.2]])
    close(ret, [[0.6345, 0.81, 0.0, 1.0]])
    assert m["value_mean"] == pytest.approx((0.5 + 0.6 + 0.8) / 3)


def test_gae_kl_in_reward():
    # mask [1,1], r = 1, kl = [0.2, 0.4], beta = 0.5 -> R = [-0.1, -0.2 + 1] = [-0.1, 0.8]; V = 0; gamma = lam = 1
    # A_1 = 0.8 ; A_0 = -0.1 + 0.8 = 0.7
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=F64),
        action_mask=torch.ones(1, 2, dtype=torch.bool),
        values=torch.zeros(1, 2, dtype=F64),
        kl=torch.tensor([[0.2, 0.4]], dtype=F64),
        kl_coef=0.5,
    )
    adv, _, _ = ADVANTAGES["gae"](inp, gamma=1.0, lam=1.0)
    close(adv, [[0.7, 0.8]])


def test_reinforce_hand_whitened():
    # row0 mask [1,1,1], r=1, kl [0.2,0,0.4]; row1 mask [1,1,0], r=0, kl [0.2,0.2,(9 ignored)]; beta=0.5
    # R0 = [-0.1, 0, 0.8] -> G0 = [0.7, 0.8, 0.8] ; R1 = [-0.1, -0.1, 0] -> G1 = [-0.2, -0.1, 0]
    # action tokens {0.7, 0.8, 0.8, -0.2, -0.1}: mean 0.4, sum sq dev 1.02, unbiased var 0.255
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0], dtype=F64),
        action_mask=torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool),
        kl=torch.tensor([[0.2, 0.0, 0.4], [0.2, 0.2, 9.0]], dtype=F64),
        kl_coef=0.5,
    )
    adv, ret, m = ADVANTAGES["reinforce"](inp, eps=0.0)
    close(ret, [[0.7, 0.8, 0.8], [-0.2, -0.1, 0.0]])
    s = math.sqrt(0.255)
    close(adv, [[0.3 / s, 0.4 / s, 0.4 / s], [-0.6 / s, -0.5 / s, 0.0]])
    assert m["whiten_mean"] == pytest.approx(0.4) and m["whiten_std"] == pytest.approx(s)


def test_reinforce_discount_skips_env_tokens():
    # mask [1, 0, 1]: gamma applies once per ACTION token: G = [0.5 * 1, 0, 1]
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0], dtype=F64), action_mask=torch.tensor([[1, 0, 1]]).bool()
    )
    adv, ret, _ = ADVANTAGES["reinforce"](inp, gamma=0.5, whiten=False)
    close(ret, [[0.5, 0.0, 1.0]])
    close(adv, [[0.5, 0.0, 1.0]])


def test_reinforce_baseline_hand():
    # n=2: rewards [1, 0 | 2, 2] -> s = [0.5, -0.5, 0, 0]; T=2 all actions -> G broadcast;
    # tokens: 0.5,0.5,-0.5,-0.5,0,0,0,0: mean 0, sum sq 1, unbiased var 1/7 -> A = +-0.5*sqrt(7)
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=F64),
        action_mask=torch.ones(4, 2).bool(),
        group_size=2,
    )
    adv, ret, m = ADVANTAGES["reinforce_baseline"](inp, eps=0.0)
    a = 0.5 * math.sqrt(7)
    close(adv, [[a, a], [-a, -a], [0, 0], [0, 0]])
    close(ret, [[0.5, 0.5], [-0.5, -0.5], [0, 0], [0, 0]])
    assert m["zero_std_group_frac"] == 0.5


def test_rloo_hand():
    # n=3: rewards [1, 0, 2]: leave-one-out means (0+2)/2=1, (1+2)/2=1.5, (1+0)/2=0.5 -> A = [0, -1.5, 1.5]
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0, 2.0], dtype=F64), action_mask=torch.ones(3, 1).bool(), group_size=3
    )
    adv, _, _ = ADVANTAGES["rloo"](inp)
    close(adv, [[0.0], [-1.5], [1.5]])


def test_group_norm_and_dr_grpo_hand():
    # groups [1, 0, 2] (mean 1, unbiased std sqrt((0+1+1)/2) = 1) and [3, 3, 3] (constant -> 0)
    # group_norm: (r - 1) / (1 + 1e-6); dr_grpo: r - 1
    r = torch.tensor([1.0, 0.0, 2.0, 3.0, 3.0, 3.0], dtype=F64)
    mask = torch.tensor([[0, 1, 1]] * 6).bool()  # position 0 = prompt
    inp = AdvantageInputs(rewards=r, action_mask=mask, group_size=3)
    adv, _, m = ADVANTAGES["group_norm"](inp, eps=1e-6)
    d = 1 / (1 + 1e-6)
    close(adv, [[0, 0, 0], [0, -d, -d], [0, d, d], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert m["zero_std_group_frac"] == 0.5
    adv, _, _ = ADVANTAGES["dr_grpo"](inp)
    close(adv, [[0, 0, 0], [0, -1, -1], [0, 1, 1], [0, 0, 0], [0, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_group_estimators_reject_n1(name):
    inp = AdvantageInputs(rewards=torch.zeros(4), action_mask=torch.ones(4, 2).bool(), group_size=1)
    with pytest.raises(ValueError, match="group_size >= 2"):
        ADVANTAGES[name](inp)
    inp = AdvantageInputs(rewards=torch.zeros(5), action_mask=torch.ones(5, 2).bool(), group_size=2)
    with pytest.raises(ValueError, match="whole number of groups"):
        ADVANTAGES[name](inp)


def test_non_finite_reward_names_row():
    inp = AdvantageInputs(rewards=torch.tensor([0.0, float("nan")]), action_mask=torch.ones(2, 2).bool())
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        ADVANTAGES["reinforce"](inp)


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        ADVANTAGES["gae"](AdvantageInputs(rewards=torch.zeros(2), action_mask=torch.ones(2, 2).bool()))


# ---------------------------------------------------------------- loop reference


def _ref(name, r, mask, values, kl, beta, n, gamma, lam, eps):
    """Straightforward per-row loops over action tokens (no compaction tricks)."""
    B, T = mask.shape
    r = r.tolist()
    if name in ("reinforce", "gae"):
        s = r
    else:
        s = []
        for g in range(B // n):
            grp = r[g * n : (g + 1) * n]
            mu = sum(grp) / n
            sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / (n - 1))
            for x in grp:
                if name == "rloo":
                    s.append(x - (sum(grp) - x) / (n - 1))
                elif name == "group_norm":
                    s.append((x - mu) / (sd + eps))
                else:  # reinforce_baseline, dr_grpo
                    s.append(x - mu)
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b, t]]
        R = {t: -beta * float(kl[b, t]) for t in idx}
        if idx:
            R[idx[-1]] += s[b]
        acc, nxt_v = 0.0, 0.0
        for t in reversed(idx):
            if name == "gae":
                v = float(values[b, t])
                acc = R[t] + gamma * nxt_v - v + gamma * lam * acc
                adv[b][t], ret[b][t], nxt_v = acc, acc + v, v
            else:
                acc = R[t] + gamma * acc
                adv[b][t] = ret[b][t] = acc
    adv, ret = torch.tensor(adv, dtype=F64), torch.tensor(ret, dtype=F64)
    if name in ("reinforce", "reinforce_baseline"):
        vals = adv[mask]
        adv = (adv - vals.mean()) / (vals.std() + eps) * mask
    return adv, ret


def _random_batch(gen, B=12, T=9):
    mask = torch.rand(B, T, generator=gen) < 0.7
    mask[:, :2] = False  # prompt
    mask[0] = False  # a row without actions
    mask[1, 2:] = torch.tensor([1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)  # multi-turn gaps + padding
    return dict(
        r=torch.randn(B, generator=gen, dtype=F64),
        mask=mask,
        values=torch.randn(B, T, generator=gen, dtype=F64),
        kl=torch.rand(B, T, generator=gen, dtype=F64),
    )


@pytest.mark.parametrize("gamma", [0.9, 1.0])  # 1.0: the default
@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_vectorised_matches_loop(name, gamma):
    gen = torch.Generator().manual_seed(0)
    d = _random_batch(gen)
    r, mask, values, kl = d["r"], d["mask"], d["values"], d["kl"]
    if name in GROUP_ESTIMATORS:
        r[4:7] = 1.5  # one constant group (n=3)
    inp = AdvantageInputs(rewards=r, action_mask=mask, group_size=3, values=values, kl=kl, kl_coef=0.3)
    adv, ret, _ = ADVANTAGES[name](inp, gamma=gamma, lam=0.8, eps=1e-6)
    ref_adv, ref_ret = _ref(name, r, mask, values, kl, 0.3, 3, gamma, 0.8, 1e-6)
    close(adv, ref_adv)
    close(ret, ref_ret)


@pytest.mark.parametrize("name", ["reinforce", "reinforce_baseline"])
def test_whitening_rank_invariance(name):
    # Two simulated ranks with a reducer that returns the global moments == one big batch.
    gen = torch.Generator().manual_seed(1)
    d = _random_batch(gen, B=12)
    full = AdvantageInputs(rewards=d["r"], action_mask=d["mask"], group_size=3, kl=d["kl"], kl_coef=0.1)
    adv_full, _, _ = ADVANTAGES[name](full)
    shards = [slice(0, 6), slice(6, 12)]
    parts = [
        AdvantageInputs(rewards=d["r"][s], action_mask=d["mask"][s], group_size=3, kl=d["kl"][s], kl_coef=0.1)
        for s in shards
    ]
    reducer = _SumOverThreads(len(parts))  # each simulated rank on its own thread, summing like all_reduce
    for p in parts:
        p.stats_reducer = reducer
    with concurrent.futures.ThreadPoolExecutor(len(parts)) as pool:
        adv_ranks = torch.cat(list(pool.map(lambda p: ADVANTAGES[name](p)[0], parts)))
    assert reducer.calls == 2 * len(parts)  # two-pass statistics: two reductions per rank
    close(adv_ranks, adv_full)
    local = torch.cat(
        [
            ADVANTAGES[name](
                AdvantageInputs(
                    rewards=p.rewards, action_mask=p.action_mask, group_size=3, kl=p.kl, kl_coef=0.1
                )
            )[0]
            for p in parts
        ]
    )
    assert not torch.allclose(local, adv_full)  # per-rank statistics would differ: the test can fail


class _SumOverThreads:
    """A stats reducer for N simulated ranks on N threads: every call returns the sum of the N ranks' tensors
    of that call (as torch.distributed.all_reduce does)."""

    def __init__(self, n: int) -> None:
        self.barrier, self.lock, self.calls = threading.Barrier(n), threading.Lock(), 0
        self.parts: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.parts.append(t.clone())
            self.calls += 1
        self.barrier.wait()
        total = torch.stack(self.parts).sum(0)
        if self.barrier.wait() == 0:
            self.parts.clear()
        self.barrier.wait()
        return total


def test_whiten_explicit_stats():
    # x = [1, 2, 3, (masked 100)]: mean 2, unbiased std 1 -> [-1, 0, 1, 0]
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    mean, std = moments_to_mean_std(masked_moments(x, mask))
    assert (mean, std) == (2.0, 1.0)
    out, _ = whiten(x, mask, mean=mean, std=std, eps=0.0)
    close(out, [[-1.0, 0.0, 1.0, 0.0]])


@pytest.mark.parametrize("name", ["gae", "rloo", "group_norm", "dr_grpo"])
def test_split_at_group_boundaries_is_invariant(name):
    # non-whitening estimators are per-group: shards (ranks / micro-batches) give the same advantages
    gen = torch.Generator().manual_seed(4)
    d = _random_batch(gen, B=12)
    kw = dict(group_size=3, kl_coef=0.2)
    full = AdvantageInputs(rewards=d["r"], action_mask=d["mask"], values=d["values"], kl=d["kl"], **kw)
    adv, ret, _ = ADVANTAGES[name](full, gamma=0.95)
    parts = [
        ADVANTAGES[name](
            AdvantageInputs(
                rewards=d["r"][s], action_mask=d["mask"][s], values=d["values"][s], kl=d["kl"][s], **kw
            ),
            gamma=0.95,
        )
        for s in (slice(0, 3), slice(3, 9), slice(9, 12))
    ]
    close(torch.cat([p[0] for p in parts]), adv)
    close(torch.cat([p[1] for p in parts]), ret)


def test_gae_whiten_option():
    # whiten=True on gae: advantages over action tokens get mean 0, unbiased std 1
    gen = torch.Generator().manual_seed(6)
    d = _random_batch(gen)
    inp = AdvantageInputs(rewards=d["r"], action_mask=d["mask"], values=d["values"])
    adv, _, m = ADVANTAGES["gae"](inp, whiten=True, eps=0.0)
    vals = adv[d["mask"]]
    assert abs(float(vals.mean())) < 1e-12 and float(vals.std()) == pytest.approx(1.0, rel=1e-12)
    assert "whiten_std" in m


@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_equal_reward_groups_get_exactly_zero_in_float32(name):
    # groups of 8 equal fractional rewards: r - mean(r) in float32 leaves a rounding residual (7.3 -> 4.8e-7)
    # that group_norm's zero std turned into advantages of 0.48 / 0.95 / -7.6; every group estimator now
    # zeroes a group whose max == min exactly. The last group varies: its advantages must stay non-zero.
    r = torch.tensor([7.3] * 8 + [13.7] * 8 + [99.9] * 8 + [0.0, 1.0] * 4, dtype=torch.float32)
    inp = AdvantageInputs(rewards=r, action_mask=torch.ones(32, 3, dtype=torch.bool), group_size=8)
    adv, _, m = ADVANTAGES[name](inp, whiten=False)
    assert adv.dtype == torch.float32
    assert torch.equal(adv[:24], torch.zeros(24, 3))
    assert (adv[24:] != 0).all()
    assert m["zero_std_group_frac"] == 0.75


def test_whitening_an_equal_batch_gives_exactly_zero():
    r = torch.full((6,), 13.7, dtype=torch.float32)
    adv, _, _ = ADVANTAGES["reinforce"](
        AdvantageInputs(rewards=r, action_mask=torch.ones(6, 4, dtype=torch.bool))
    )
    assert torch.equal(adv, torch.zeros(6, 4))


def test_batch_std_is_exact_at_a_large_offset():
    # x = 1e6 + [0.01, 0.02, 0.03]: mean 1e6 + 0.02, unbiased std 0.01. A one-pass E[x^2] - mean^2 in float64
    # loses ~ 3e12 * 2.2e-16 = 7e-4 of a variance of 1e-4 (it returned std 0.027 / 0); two passes are exact
    # to ~1e-10 (the spacing of float64 at 1e6). Tolerance rtol 1e-6.
    x = torch.tensor([[1e6 + 0.01, 1e6 + 0.02, 1e6 + 0.03, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    mean, std = masked_mean_std(x, mask)
    assert math.isclose(mean, 1e6 + 0.02, rel_tol=1e-12)
    assert math.isclose(std, 0.01, rel_tol=1e-6)
    # the same through REINFORCE++ whitening of float64 rewards: (r - mean) / (std + eps), eps 0
    r = x[0, :3].clone()
    adv, _, _ = ADVANTAGES["reinforce"](
        AdvantageInputs(rewards=r, action_mask=torch.ones(3, 1, dtype=torch.bool)), eps=0.0
    )
    close(adv[:, 0], [-1.0, 0.0, 1.0])
