"""Reward shaping and DAPO dynamic filtering: hand values, resume of the running normaliser."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.filtering import dynamic_filter, group_rows
from relayrl.algorithms.shaping import RunningRewardNorm, clip_rewards, overlong_penalty, truncation_penalty

F64 = torch.float64


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=F64), rtol=1e-6, atol=1e-12)


def test_clip_rewards():
    r, m = clip_rewards(torch.tensor([-3.0, 0.5, 9.0], dtype=F64), low=-1.0, high=1.0)
    close(r, [-1.0, 0.5, 1.0])
    assert m["reward_clip_frac"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="low"):
        clip_rewards(r, low=1.0, high=0.0)


def test_overlong_penalty_dapo():
    # max 10, buffer 4 -> linear from length 6: L = 5, 6 -> 0 ; 8 -> (6-8)/4 = -0.5 ; 10 -> -1 ; 12 -> -1
    pen, m = overlong_penalty(torch.tensor([5, 6, 8, 10, 12]), max_len=10, buffer_len=4)
    close(pen, [0.0, 0.0, -0.5, -1.0, -1.0])
    assert m["overlong_frac"] == pytest.approx(3 / 5)
    pen, _ = overlong_penalty(torch.tensor([9]), max_len=10, buffer_len=4, factor=2.0)  # 2 * (6-9)/4
    close(pen, [-1.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=4, buffer_len=5)


def test_truncation_penalty():
    r = torch.tensor([1.0, 1.0, 0.0], dtype=F64)
    t = torch.tensor([True, False, True])
    close(truncation_penalty(r, t, penalty=0.5)[0], [0.5, 1.0, -0.5])
    out, m = truncation_penalty(r, t, penalty=1.0, replace=True)
    close(out, [-1.0, 1.0, -1.0])
    assert m["truncated_frac"] == pytest.approx(2 / 3)


def test_running_norm_and_resume():
    # after [1,2,3] and [4,5]: mean 3, population var (4+1+0+1+4)/5 = 2 -> batch 2 -> (r-3)/sqrt(2)
    norm = RunningRewardNorm(eps=0.0)
    norm(torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    state = norm.state_dict()
    out, m = norm(torch.tensor([4.0, 5.0], dtype=F64))
    close(out, [1 / math.sqrt(2), 2 / math.sqrt(2)])
    assert m["reward_running_mean"] == pytest.approx(3.0) and m["reward_running_std"] == pytest.approx(
        math.sqrt(2)
    )
    resumed = RunningRewardNorm()
    resumed.load_state_dict(state)
    out2, _ = resumed(torch.tensor([4.0, 5.0], dtype=F64))
    assert torch.equal(out, out2)  # exact resume
    scale_only = RunningRewardNorm(center=False, eps=0.0)
    close(scale_only(torch.tensor([1.0, 3.0], dtype=F64))[0], [1.0, 3.0])  # std 1
    # nothing seen but equal rewards: std 0 -> no scaling (not 2 / 1e-8)
    fresh = RunningRewardNorm(center=False)
    close(fresh(torch.tensor([2.0, 2.0], dtype=F64))[0], [2.0, 2.0])


def test_dynamic_filter_hand():
    # n = 2; groups: [1,1] const, [0,1] keep, [0.5,0.5] const (not 0/1!), [0,0] const, [1,0.9] mean 0.95
    scores = torch.tensor([1, 1, 0, 1, 0.5, 0.5, 0, 0, 1, 0.9], dtype=F64)
    kept, dropped, m = dynamic_filter(scores, group_size=2)
    assert kept.tolist() == [1, 4] and dropped.tolist() == [0, 2, 3]
    kept, dropped, m = dynamic_filter(scores, group_size=2, mean_range=(0.0, 0.9))
    assert kept.tolist() == [1] and dropped.tolist() == [0, 2, 3, 4]
    assert m["groups_kept"] == 1 and m["zero_var_frac"] == pytest.approx(0.6)
    assert m["out_of_range_frac"] == pytest.approx(0.2)
    assert group_rows(torch.tensor([1, 3]), 2).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="group_size >= 2"):
        dynamic_filter(scores, group_size=1)
    with pytest.raises(ValueError, match="group_size = 3"):
        dynamic_filter(scores, group_size=3)


def test_overlong_and_filter_match_loops():
    gen = torch.Generator().manual_seed(9)
    lengths = torch.randint(0, 40, (50,), generator=gen)
    pen, _ = overlong_penalty(lengths, max_len=32, buffer_len=8, factor=0.5)
    ref = []
    for L in lengths.tolist():  # DAPO eq. 13, scaled by factor
        ref.append(0.0 if L <= 24 else (0.5 * (24 - L) / 8 if L <= 32 else -0.5))
    close(pen, ref)
    scores = torch.randint(0, 3, (60,), generator=gen).to(F64) / 2  # many constant groups of 3
    kept, dropped, _ = dynamic_filter(scores, group_size=3, mean_range=(0.2, 0.8))
    want = []
    for g in range(20):
        grp = scores[3 * g : 3 * g + 3].tolist()
        if max(grp) != min(grp) and 0.2 <= sum(grp) / 3 <= 0.8:
            want.append(g)
    assert kept.tolist() == want
    assert sorted(kept.tolist() + dropped.tolist()) == list(range(20)) and 0 < len(want) < 20
