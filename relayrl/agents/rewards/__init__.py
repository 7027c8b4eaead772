"""Reward sources (see base.py): reward_func files, remote HTTP reward models, a local reward model, tasks.

source = build_reward_source("examples/reward_func.py")                 # Python reward_func file
source = build_reward_source("http://127.0.0.1:5000/get_reward,http://127.0.0.1:5001/get_reward")
source = build_reward_source("rm:/path/to/reward_model")                # local value-head model
source = build_reward_source("task:add2")                               # a built-in task's reward
await source.score(trajs)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.agents.rewards.base import RewardBatch, RewardSource, parse_reward_output
from relayrl.agents.rewards.func import RewardFuncSource, load_reward_func
from relayrl.agents.rewards.local_rm import LocalRewardModel, LocalRMSource
from relayrl.agents.rewards.remote import RemoteRewardSource, RemoteRMError
from relayrl.agents.rewards.task import TaskRewardSource

__all__ = [
    "LocalRMSource",
    "LocalRewardModel",
    "RemoteRMError",
    "RemoteRewardSource",
    "RewardBatch",
    "RewardFuncSource",
    "RewardSource",
    "TaskRewardSource",
    "build_reward_source",
    "load_reward_func",
    "parse_reward_output",
]

SPEC_FORMS = (
    "a reward_func file 'path/to/reward.py', http(s) URLs (comma-separated or a list) of remote reward "
    "models, 'rm:<path>' (a local reward model folder), or 'task:<name>' (a built-in task)"
)


def build_reward_source(spec: str | Sequence[str] | RewardSource, *, tokenizer: Any = None, **options: Any):
    """A reward source from a spec string (see module doc). `options` go to the source's constructor
    (e.g. timeout, batch_size, retries, max_concurrency); `tokenizer` is used where it applies."""
    if isinstance(spec, RewardSource):
        return spec
    if not isinstance(spec, str):
        urls = list(spec)
    else:
        urls = [s.strip() for s in spec.split(",")] if spec.startswith(("http://", "https://")) else []
    if urls:
        return RemoteRewardSource(urls, tokenizer=tokenizer, **options)
    if spec.startswith("task:"):
        from relayrl.tasks import get_task

        return TaskRewardSource(get_task(spec[len("task:") :]), **options)
    if spec.endswith(".py"):
        return RewardFuncSource(spec, tokenizer=tokenizer, **options)
    if spec.startswith("rm:") or Path(spec).is_dir():
        path = spec[len("rm:") :] if spec.startswith("rm:") else spec
        rm_keys = {"batch_size", "max_len", "dtype", "device"}
        rm = LocalRewardModel.from_pretrained(path, **{k: v for k, v in options.items() if k in rm_keys})
        return LocalRMSource(rm, **{k: v for k, v in options.items() if k not in rm_keys})
    raise ValueError(f"reward source {spec!r} not understood; give {SPEC_FORMS}")
