"""RewardWorker: scores trajectories with the configured reward source (relayrl.agents.rewards).

    score(trajs: list[Trajectory]) -> list[Trajectory]     rewards / scores / extra_logs filled in place,
                                                           failures marked (never a silent zero)
    scores(trajs) -> list[Scored]                          the same scoring; returns only what it set (the
                                                           controller's `apply_scores` copies it back)

Source spec (`reward.source`, see RewardConfig): task:<name>, a reward_func .py file, http(s) URL(s), rm:<path>,
prm:<path> (a process reward model, with reward.prm_outcome / prm_step_separator),
or "agent" (the multi-turn agent already set its rewards: nothing to do); the grammar is
relayrl.agents.rewards.spec's. The spec in force is resolved by `reward_spec` before any work starts; a
`task:` source gets its task from relayrl.tasks here (the reward layer below does not import tasks). As a Ray
actor `score` returns the scored list (pickled back: every token list again); the RL step calls `scores`,
whose answer is the few fields a source sets (`Scored`), so only the trajectories' way there carries tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.rewards import (
    RemoteRewardSource,
    RewardSource,
    build_reward_source,
    parse_reward_spec,
    resolve_reward_spec,
)
from relayrl.config.rl import RLConfig
from relayrl.models.loading import load_tokenizer
from relayrl.tasks import get_task
from relayrl.workers.builders import setup_process


@dataclass(kw_only=True, slots=True)
class RewardSpec:
    """What the reward role reads."""

    source: str
    """The resolved source spec (relayrl.agents.rewards.resolve_reward_spec)."""
    tokenizer: str = ""
    """Tokenizer folder / id for sources that decode text (reward_func files, remote and local RMs)."""
    timeout_s: float = 60.0
    """Timeout of one reward call."""
    prm_outcome: str = "dense"
    """prm: sources: dense, min or last (relayrl.agents.rewards.prm)."""
    prm_step_separator: str = "\n"
    """prm: sources: the text that ends a step."""
    seed: int = 0
    """Seed of the worker process."""


def reward_spec(cfg: RLConfig) -> RewardSpec:
    """The reward role's spec from a run config: `reward.source`, else task:<task.name>, else agent."""
    source = resolve_reward_spec(cfg.reward.source, task=cfg.task.name, agent=cfg.rollout.agent)
    if not source:
        raise ValueError(
            "reward.source is empty and there is no task: set --reward.source (task:<name>, a reward_func .py "
            "file, http(s) URLs, rm:<path>) or --task.name"
        )
    return RewardSpec(
        source=source,
        tokenizer=cfg.model.tokenizer_name_or_path or cfg.model.name_or_path,
        timeout_s=cfg.reward.timeout_s,
        prm_outcome=cfg.reward.prm_outcome,
        prm_step_separator=cfg.reward.prm_step_separator,
        seed=cfg.train.seed + 2,
    )


def build_source(rs: RewardSpec) -> RewardSource:
    """The reward source of a role spec: text-decoding sources get the tokenizer, remote and file sources
    the timeout."""
    parsed = parse_reward_spec(rs.source)
    tokenizer = None if parsed.kind in ("task", "agent") else load_tokenizer(rs.tokenizer)
    options: dict[str, Any] = {} if parsed.kind in ("task", "rm", "agent") else {"timeout": rs.timeout_s}
    if parsed.kind == "prm":
        options.update(outcome=rs.prm_outcome, step_separator=rs.prm_step_separator)
    return build_reward_source(parsed, tokenizer=tokenizer, get_task=get_task, **options)


@dataclass(kw_only=True, slots=True)
class Scored:
    """What a reward source sets on one trajectory (relayrl.agents.rewards: `fill`, `mark_failed`, the PRM's
    dense rewards), sent back instead of the whole trajectory."""

    reward: float | None
    """Trajectory.reward."""
    score: float | None
    """Trajectory.score."""
    dense_rewards: list[float] = field(default_factory=list)
    """Trajectory.dense_rewards ([T] floats, or empty)."""
    extra_logs: dict[str, float] = field(default_factory=dict)
    """Trajectory.extra_logs (the agent's and the reward function's)."""
    status: TrajectoryStatus = TrajectoryStatus.OK
    """Trajectory.status."""
    error: str | None = None
    """Trajectory.error."""
    failure_kind: str | None = None
    """Trajectory.failure_kind."""


def scored(t: Trajectory) -> Scored:
    """The fields of `t` a reward source sets."""
    return Scored(
        reward=t.reward,
        score=t.score,
        dense_rewards=t.dense_rewards,
        extra_logs=t.extra_logs,
        status=t.status,
        error=t.error,
        failure_kind=t.failure_kind,
    )


def apply_scores(trajs: list[Trajectory], scores: list[Scored]) -> list[Trajectory]:
    """Copy `RewardWorker.scores`' answer onto the trajectories it scored (in place; returns `trajs`)."""
    if len(scores) != len(trajs):
        raise RuntimeError(f"the reward role answered {len(scores)} scores for {len(trajs)} trajectories")
    for t, s in zip(trajs, scores, strict=True):
        t.reward, t.score, t.dense_rewards, t.extra_logs = s.reward, s.score, s.dense_rewards, s.extra_logs
        t.status, t.error, t.failure_kind = s.status, s.error, s.failure_kind
    return trajs


class RewardWorker:
    """The reward role."""

    def __init__(self, rs: RewardSpec) -> None:
        setup_process(rs.seed)
        self.source = build_source(rs)
        self.spec = rs.source
        if isinstance(self.source, RemoteRewardSource):  # a wrong URL fails now, in seconds
            for down in self.source.check_reachable():
                print(f"relayrl: warning: remote reward server unreachable at start: {down}", flush=True)

    def score(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Fill rewards in place and return the same list."""
        asyncio.run(self.source.score(trajs))
        return trajs

    def scores(self, trajs: list[Trajectory]) -> list[Scored]:
        """`score`, answering only the fields it sets, one `Scored` per trajectory in order."""
        return [scored(t) for t in self.score(trajs)]
