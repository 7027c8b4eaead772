"""RewardWorker: scores trajectories with the configured reward source (relayrl.agents.rewards).

    score(trajs: list[Trajectory]) -> list[Trajectory]     rewards / scores / extra_logs filled in place,
                                                           failures marked (never a silent zero)
    scores(trajs) -> list[Scored]                          the same scoring; returns only what it set (the
                                                           controller's `apply_scores` copies it back)

Source spec (`reward.source`, see RewardConfig): task:<name>, a reward_func .py file, http(s) URL(s), rm:<path>,
prm:<path> (a process reward model, with reward.prm_outcome / prm_step_separator),
or "agent" (the multi-turn agent already set its rewards: nothing to do); the grammar is
relayrl.agents.rewards.spec's. The spec in force is resolved by `reward_spec` before any work starts; a
`task:` source gets its task from relayrl.tasks here (the reward layer below does not import tasks).

Where it runs (`runs_in_process`, `score_trajectories`). Sources that are plain Python in the controller's
reach (task:, a reward_func file, agent) are scored in the controller's process in every dist.mode: as a Ray
actor, the round trip pickled every trajectory there (token ids, log-probs, versions) and unpickled it in the
actor, a cost that grew with the global batch, i.e. with the number of GPUs at a fixed per-GPU batch
(bench/reward_phase.py, 2,048 trajectories on a 2-core CPU: 0.16 s through the actor, 0.04 s in process;
docs/distributed.md). Reward models (rm:, prm:) and remote servers keep their Ray actor (their own process,
tokenizer and threads); what travels there is `payload` (no log-probs, versions or routes, which no source
reads) and what comes back is `Scored`, the few fields a source sets.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.rewards import (
    RemoteRewardSource,
    RewardSource,
    build_reward_source,
    parse_reward_spec,
    resolve_reward_spec,
)
from relayrl.agents.rewards.spec import SourceKind
from relayrl.config.rl import RLConfig
from relayrl.distributed.launch.base import RoleHandle
from relayrl.distributed.launch.local import LocalRole
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


IN_PROCESS: tuple[SourceKind, ...] = ("task", "file", "agent")
"""Source kinds scored in the controller's process in every dist.mode (see module doc): a task's reward and a
reward_func file are Python the controller can run (a file's function on a daemon thread, as in an actor),
the agent's rewards need nothing. rm / prm (a model) and remote (HTTP clients) keep their actor."""


def runs_in_process(rs: RewardSpec) -> bool:
    """Whether the reward role of `rs` is built in the controller's process even when dist.mode is ray."""
    return parse_reward_spec(rs.source).kind in IN_PROCESS


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


def payload(t: Trajectory) -> Trajectory:
    """What of `t` travels to a reward actor: every field a source reads (sample, token ids, action mask,
    response text, images, status, extra_logs), not the per-token log-probs, versions and routes, which none
    reads (3/4 of a trajectory's pickled bytes at ~110 response tokens)."""
    return replace(t, rollout_logprobs=[], versions=[], routes=None)


def score_trajectories(role: RoleHandle[RewardWorker], trajs: list[Trajectory]) -> list[Trajectory]:
    """Score `trajs` in place through the reward role and return them: an in-process worker scores the
    trajectories themselves; an actor gets their `payload` and answers `Scored`, copied back (apply_scores).
    Same rewards, scores, failure marks and extra_logs either way."""
    if isinstance(role, LocalRole):
        return role.call(RewardWorker.score, trajs)
    return apply_scores(trajs, role.call(RewardWorker.scores, [payload(t) for t in trajs]))


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
