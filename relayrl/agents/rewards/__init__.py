"""Reward sources (see base.py): reward_func files, remote HTTP reward models, a local reward model, tasks,
the multi-turn agent's own rewards. The spec grammar is spec.py's.

source = build_reward_source("examples/reward_func.py")                 # Python reward_func file
source = build_reward_source("http://127.0.0.1:5000/get_reward,http://127.0.0.1:5001/get_reward")
source = build_reward_source("rm:/path/to/reward_model")                # local value-head model
source = build_reward_source("prm:/path/to/prm", outcome="dense")       # process reward model: step scores
source = build_reward_source("task:add2", get_task=relayrl.tasks.get_task)   # a built-in task's reward
await source.score(trajs)

This layer does not import relayrl.tasks (tasks sit above agents): a `task:` spec needs the caller's task
lookup (`get_task`), as the reward worker and `relayrl generate` pass it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.agents.rewards.base import RewardBatch, RewardSource, parse_reward_output
from relayrl.agents.rewards.func import RewardFuncSource, load_reward_func
from relayrl.agents.rewards.local_rm import LocalRewardModel, LocalRMSource
from relayrl.agents.rewards.prm import PRMSource, ProcessRewardModel
from relayrl.agents.rewards.remote import RemoteRewardSource, RemoteRMError
from relayrl.agents.rewards.spec import SourceSpec, parse_reward_spec, resolve_reward_spec
from relayrl.agents.rewards.task import TaskRewardSource

__all__ = [
    "AgentRewards",
    "LocalRMSource",
    "LocalRewardModel",
    "PRMSource",
    "ProcessRewardModel",
    "RemoteRMError",
    "RemoteRewardSource",
    "RewardBatch",
    "RewardFuncSource",
    "RewardSource",
    "SourceSpec",
    "TaskRewardSource",
    "build_reward_source",
    "load_reward_func",
    "parse_reward_output",
    "parse_reward_spec",
    "resolve_reward_spec",
]

RM_KEYS = {"batch_size", "max_len", "dtype", "device"}
"""Options of a local reward model (`LocalRewardModel.from_pretrained`); the rest go to its source."""
PRM_KEYS = {"device", "dtype", "step_separator", "max_len"}
"""Options of a process reward model (`ProcessRewardModel.from_pretrained`); the rest go to `PRMSource`."""


class AgentRewards:
    """The agent's own rewards (multi-turn): already on the trajectories, nothing to score."""

    async def score(self, trajs: list[Trajectory]) -> None:
        return None


def build_reward_source(
    spec: str | Sequence[str] | SourceSpec | RewardSource,
    *,
    tokenizer: Any = None,
    get_task: Callable[[str], Any] | None = None,
    **options: Any,
) -> RewardSource:
    """A reward source from a spec (see module doc). `options` go to the source's constructor (e.g. timeout,
    batch_size, retries, max_concurrency); `tokenizer` is used where it applies; `get_task` (name -> task)
    resolves a `task:` spec."""
    if isinstance(spec, RewardSource):
        return spec
    parsed = spec if isinstance(spec, SourceSpec) else parse_reward_spec(spec)
    if parsed.kind == "agent":
        return AgentRewards()
    if parsed.kind == "remote":
        return RemoteRewardSource(list(parsed.urls), tokenizer=tokenizer, **options)
    if parsed.kind == "task":
        if get_task is None:
            raise ValueError(
                f"reward source {parsed.text!r} needs the task lookup: pass get_task=relayrl.tasks.get_task "
                "(the reward layer does not import the tasks)"
            )
        return TaskRewardSource(get_task(parsed.target), **options)
    if parsed.kind == "file":
        return RewardFuncSource(parsed.target, tokenizer=tokenizer, **options)
    if parsed.kind == "prm":
        prm = ProcessRewardModel.from_pretrained(
            parsed.target, **{k: v for k, v in options.items() if k in PRM_KEYS}
        )
        return PRMSource(prm, **{k: v for k, v in options.items() if k not in PRM_KEYS})
    rm = LocalRewardModel.from_pretrained(parsed.target, **{k: v for k, v in options.items() if k in RM_KEYS})
    return LocalRMSource(rm, **{k: v for k, v in options.items() if k not in RM_KEYS})
