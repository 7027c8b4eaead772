"""RewardWorker: scores trajectories with the configured reward source (relayrl.agents.rewards).

    score(trajs: list[Trajectory]) -> list[Trajectory]     rewards / scores / extra_logs filled in place,
                                                           failures marked (never a silent zero)

Source spec (`reward.source`, see RewardConfig): task:<name>, a reward_func .py file, http(s) URL(s), rm:<path>,
or "agent" (the multi-turn agent already set its rewards: nothing to do). The spec is resolved by
`resolve_reward_spec` before any work starts. As a Ray actor it returns the scored list (pickled back).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.config.rl import RLConfig
from relayrl.workers.builders import setup_process

AGENT = "agent"


def resolve_reward_spec(cfg: RLConfig) -> str:
    """The reward source spec: `reward.source`, else task:<task.name>, else agent (multi-turn)."""
    if cfg.reward.source:
        return cfg.reward.source
    if cfg.task.name and cfg.rollout.agent == "single":
        return f"task:{cfg.task.name}"
    if cfg.rollout.agent != "single":
        return AGENT
    raise ValueError(
        "reward.source is empty and there is no task: set --reward.source (task:<name>, a reward_func .py "
        "file, http(s) URLs, rm:<path>) or --task.name"
    )


class _AgentRewards:
    """The agent's own rewards (multi-turn): already on the trajectories."""

    async def score(self, trajs: list[Trajectory]) -> None:
        return None


@dataclass(kw_only=True, slots=True)
class RewardSpec:
    """What the reward role reads."""

    source: str
    """The resolved source spec (`resolve_reward_spec`)."""
    tokenizer: str = ""
    """Tokenizer folder / id for sources that decode text (reward_func files, remote and local RMs)."""
    timeout_s: float = 60.0
    """Timeout of one reward call."""
    seed: int = 0


def reward_spec(cfg: RLConfig) -> RewardSpec:
    """The reward role's spec from a run config."""
    return RewardSpec(
        source=resolve_reward_spec(cfg),
        tokenizer=cfg.model.tokenizer_name_or_path or cfg.model.name_or_path,
        timeout_s=cfg.reward.timeout_s,
        seed=cfg.train.seed + 2,
    )


class RewardWorker:
    """The reward role."""

    def __init__(self, rs: RewardSpec) -> None:
        from relayrl.agents.rewards import build_reward_source

        setup_process(rs.seed)
        spec = rs.source
        tokenizer = None
        if not spec.startswith("task:") and spec != AGENT:
            from relayrl.models.loading import load_tokenizer

            tokenizer = load_tokenizer(rs.tokenizer)
        options: dict[str, Any] = {} if spec.startswith(("task:", "rm:")) else {"timeout": rs.timeout_s}
        self.source = (
            _AgentRewards() if spec == AGENT else build_reward_source(spec, tokenizer=tokenizer, **options)
        )
        self.spec = spec
        check = getattr(self.source, "check_reachable", None)
        if callable(check):  # a remote reward: a wrong URL fails now, in seconds
            for down in check():
                print(f"relayrl: warning: remote reward server unreachable at start: {down}", flush=True)

    def score(self, trajs: list[Trajectory]) -> list[Trajectory]:
        """Fill rewards in place and return the same list."""
        asyncio.run(self.source.score(trajs))
        return trajs
