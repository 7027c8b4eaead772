"""The rollout strategy chosen at build time (relayrl/trainers/rl/async_rollout.py): SyncRollout and AsyncRollout
behind one interface. The pipeline's gate and the staleness filter are tested in test_async.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from relayrl.agents.base import Trajectory
from relayrl.config.rl import RLTrainConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.trainers.rl.async_rollout import AsyncRollout, SyncRollout, build_rollout_strategy
from relayrl.trainers.rl.rollout import NothingToTrain
from relayrl.training.sampler import ResumableSampler


def _traj(index: int, version: int) -> Trajectory:
    return Trajectory(
        sample=PromptSample(index=index, prompt="p", prompt_ids=[1]),
        token_ids=[1, 2],
        action_mask=[False, True],
        rollout_logprobs=[0.0, 0.0],
        versions=[-1, version],
    )


def test_the_strategy_is_chosen_once_from_the_config():
    rollout = RolloutConfig(n_samples=4)
    sync = build_rollout_strategy(RLTrainConfig(), rollout)
    assert isinstance(sync, SyncRollout) and not sync.overlaps and sync.concurrency == {}
    train = RLTrainConfig(async_train=True, max_staleness=2)
    a = build_rollout_strategy(train, rollout)
    assert isinstance(a, AsyncRollout) and a.overlaps and a.max_staleness == 2 and a.group_size == 4
    assert a.concurrency == {"policy": 3, "reward": 2, "engine": 3}
    single = build_rollout_strategy(train, replace(rollout, failure_policy="drop_sample"))
    assert isinstance(single, AsyncRollout) and single.group_size is None


def test_sync_takes_the_step_it_is_asked_for():
    sampler = ResumableSampler(5, 1, seed=0)
    asked: list[int] = []

    def produce(step: int):
        asked.append(step)
        sampler.next_indices()
        return [_traj(0, step - 1)], {"rollout/n": 1.0}

    s = SyncRollout()
    s.start(produce, sampler, steps_done=2, last_step=5)
    trajs, m = s.take(3, version=2)
    assert asked == [3] and m == {"rollout/n": 1.0} and len(trajs) == 1
    assert s.sampler_state(sampler) == sampler.state_dict()  # the live sampler: nothing drawn ahead


@pytest.mark.timeout(30)
def test_async_hands_over_skips_and_keeps_the_sampler_state_of_the_consumed_batch():
    sampler = ResumableSampler(100, 1, seed=0)

    def produce(step: int):
        sampler.next_indices()
        if step == 2:
            raise NothingToTrain(f"step {step}: all filtered")
        return [_traj(step, step - 1)], {}

    a = AsyncRollout(max_staleness=1, group_size=None)
    assert a.sampler_state(sampler) == sampler.state_dict()  # before start: the live sampler
    a.start(produce, sampler, steps_done=0, last_step=3)
    try:
        trajs, m = a.take(1, version=0)
        after_first = a.sampler_state(sampler)
        assert (
            [t.sample.index for t in trajs] == [1] and m["async/dropped_stale"] == 0.0 and "async/wait_s" in m
        )
        # as after batch 1's draws, whatever the producer drew since
        assert (after_first["epoch"], after_first["position"]) == (0, 1)
        a.step_done(1)
        with pytest.raises(NothingToTrain, match="step 2: all filtered"):
            a.take(2, version=1)
        a.step_done(2)
        with pytest.raises(NothingToTrain, match=r"more than train\.max_staleness=1 policy versions old"):
            a.take(3, version=5)  # its tokens came from version 2: 3 versions old
    finally:
        a.close(timeout=5)
