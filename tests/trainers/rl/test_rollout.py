"""The rollout phase of an RL step (relayrl/trainers/rl/rollout.py) over fake roles: prompt draws, seeds,
failure and filter counts, refills, and the skip when nothing is left."""

from __future__ import annotations

import pytest

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.config.rl import FilterConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.distributed.launch.local import LocalLauncher
from relayrl.trainers.rl.rollout import (
    NothingToTrain,
    RolloutPhase,
    draw_prompts,
    failure_counts,
    filter_fractions,
    rank_timings,
    rollout_seed,
)
from relayrl.training.sampler import ResumableSampler
from relayrl.workers.reward import Scored, scored


def _prompts(n: int) -> list[PromptSample]:
    return [PromptSample(index=i, prompt=f"p{i}", prompt_ids=[1, 2]) for i in range(n)]


class Generator:
    """n trajectories per prompt; records the seeds it was asked for."""

    def __init__(self, n: int, fail: bool = False) -> None:
        self.n, self.fail, self.seeds = n, fail, []

    def rollout(self, samples: list[PromptSample], seed: int, eval: bool = False) -> list[Trajectory]:
        self.seeds.append(seed)
        status = TrajectoryStatus.FAILED if self.fail else TrajectoryStatus.OK
        return [
            Trajectory(
                sample=s,
                token_ids=[1, 2, 3],
                action_mask=[False, False, True],
                rollout_logprobs=[0.0] * 3,
                status=status,
                failure_kind="env_error" if self.fail else None,
            )
            for s in samples
            for _ in range(self.n)
        ]

    def close(self) -> None:
        return None


class Reward:
    def score(self, trajs: list[Trajectory]) -> list[Trajectory]:
        for i, t in enumerate(trajs):
            t.reward = float(i % 2) if t.status == TrajectoryStatus.OK else None
        return trajs

    def scores(self, trajs: list[Trajectory]) -> list[Scored]:
        return [scored(t) for t in self.score(trajs)]


def _phase(gen: Generator, prompts: int = 3, **filter_kw) -> RolloutPhase:
    launcher = LocalLauncher()
    return RolloutPhase(
        generator=launcher.spawn("policy", lambda: gen),
        reward=launcher.spawn("reward", Reward),  # type: ignore[arg-type]
        prompts=_prompts(prompts),
        sampler=ResumableSampler(prompts, 1, seed=0),
        rollout=RolloutConfig(prompts_per_step=2, n_samples=2),
        filter=FilterConfig(**filter_kw),
        seed=7,
    )


def test_a_step_draws_samples_and_scores_its_prompts():
    gen = Generator(2)
    trajs, m = _phase(gen)(step=4)
    assert len(trajs) == 4 and m["rollout/generated"] == 4.0 and m["filter/rounds"] == 1.0
    assert gen.seeds == [rollout_seed(7, 4, 0)] == [(7 * 1_000_003 + 4 * 1009) % 2**31]
    assert all(t.reward is not None for t in trajs)


def test_rank_timings_split_the_call_into_the_slowest_rank_and_the_return():
    m = rank_timings(1.0, {"rollout": [0.25, 0.75], "update": [9.0]})
    assert m == {
        "timing/rollout_rank_min": 0.25,
        "timing/rollout_rank_max": 0.75,
        "timing/rollout_return": 0.25,
    }
    assert rank_timings(0.5, {})["timing/rollout_rank_max"] == 0.5  # a role without ready times: one rank
    _, m = _phase(Generator(2))(step=1)  # in-process: one rank, nothing to fetch
    assert m["timing/rollout_rank_min"] == m["timing/rollout_rank_max"] > 0.0
    assert 0.0 <= m["timing/rollout_return"] < 0.01


def test_nothing_to_train_names_the_counts():
    with pytest.raises(NothingToTrain, match=r"step 1: nothing to train: 4 of 4 samples failed"):
        _phase(Generator(2, fail=True))(step=1)


def test_a_prompt_drawn_twice_in_a_step_gets_its_own_index():
    prompts, drawn = _prompts(2), {}
    out = draw_prompts(prompts, ResumableSampler(2, 1, seed=0), 3, drawn)
    assert sorted(p.index for p in out[:2]) == [0, 1] and out[2].index in (2, 3)  # index + times drawn x size
    assert sum(drawn.values()) == 3


def test_counts_and_fractions():
    t = Generator(1, fail=True).rollout(_prompts(2), 0)
    assert failure_counts(t) == {
        "rollout/failed": 2.0,
        "rollout/dropped": 2.0,
        "rollout/failed/env_error": 2.0,
    }
    f = filter_fractions({"filter/groups_kept": 3.0, "filter/groups_dropped": 1.0, "filter/groups_zero_var": 1.0,
                          "filter/zero_var_frac": 0.9, "filter/rounds": 2.0})  # fmt: skip
    assert f["filter/zero_var_frac"] == 0.25 and f["filter/refills"] == 1.0
