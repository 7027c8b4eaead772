"""Failure policy on a hand-built batch: 3 prompts x 2 samples, one failure in prompt 1."""

from __future__ import annotations

import pytest

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.failures import (
    FailureLog,
    RolloutFailure,
    apply_failure_policy,
    check_scalar,
    mark_failed,
)
from relayrl.data.records import PromptSample


def _batch() -> list[Trajectory]:
    trajs = []
    for i in range(3):
        s = PromptSample(index=i, prompt=f"p{i}", prompt_ids=[5, 6])
        for _ in range(2):
            trajs.append(
                Trajectory(
                    sample=s,
                    token_ids=[5, 6, 7],
                    action_mask=[False, False, True],
                    rollout_logprobs=[0.0, 0.0, -1.0],
                    reward=1.0,
                )
            )
    mark_failed(trajs[3], "nan", "reward is nan", source="reward_func", log=FailureLog())
    return trajs


def test_drop_group_drops_the_whole_prompt():
    trajs = _batch()
    kept, m = apply_failure_policy(trajs)
    assert [t.sample.index for t in kept] == [0, 0, 2, 2]
    assert m == {
        "rollout/failed": 1.0,
        "rollout/failed_frac": 1 / 6,
        "rollout/failed/nan": 1.0,
        "rollout/dropped": 2.0,
    }


def test_drop_sample_and_zero_reward():
    kept, m = apply_failure_policy(_batch(), "drop_sample")
    assert [t.sample.index for t in kept] == [0, 0, 1, 2, 2] and m["rollout/dropped"] == 1.0
    trajs = _batch()
    kept, m = apply_failure_policy(trajs, "zero_reward")
    assert len(kept) == 6 and m["rollout/dropped"] == 0.0 and m["rollout/failed"] == 1.0
    assert kept[3].reward == 0.0 and kept[3].status == TrajectoryStatus.FAILED  # visible, not silent


def test_raise_and_all_failed():
    with pytest.raises(
        RolloutFailure, match=r"1/6 trajectories failed .*sample 1 prompt 'p1'.*reward is nan"
    ):
        apply_failure_policy(_batch(), "raise")
    trajs = _batch()
    for t in trajs:
        mark_failed(t, "timeout", "slow", log=FailureLog())
    with pytest.raises(RolloutFailure, match="every trajectory dropped"):
        apply_failure_policy(trajs, "drop_sample")
    with pytest.raises(
        ValueError, match=r"policy 'ignore' is not one of: drop_group, drop_sample, zero_reward, raise"
    ):
        apply_failure_policy(_batch(), "ignore")


def test_check_scalar():
    import numpy as np
    import torch

    assert check_scalar(torch.tensor([0.25]), "r") == 0.25
    assert check_scalar(np.float32(0.5), "r") == 0.5 and check_scalar(2, "r") == 2.0
    bad_cases = [(float("inf"), "nan"), (torch.ones(2), "wrong_length"), ("x", "bad_output"), ("0.5", "bad_output"),
                 (True, "bad_output"), (None, "bad_output")]  # fmt: skip
    for bad, kind in bad_cases:
        with pytest.raises(ValueError) as err:
            check_scalar(bad, "r")
        assert err.value.kind == kind
    with pytest.raises(ValueError, match=r"r is a str \('0\.5'\), expected a number"):
        check_scalar("0.5", "r")  # one rule: numeric strings fail like any string
