"""Agents: executors that turn a prompt into token-exact trajectories on a rollout engine, reward sources,
the failure policy, the OpenAI-compatible server and `relayrl serve-rm`.

    base.py            PromptSample, Trajectory, TrajectoryStatus, AgentInstanceBase, AgentExecutorBase
    executors.py       SingleTurnExecutor, MultiTurnExecutor, load_agent_from_file, execute_all
    failures.py        mark_failed, apply_failure_policy, FailurePolicy, FailureLog
    rewards/           RewardSource protocol + reward_func file / remote HTTP RM / local RM / task sources,
                       build_reward_source
    remote_rm.py       `relayrl serve-rm` (OpenRLHF's /get_reward JSON)
    openai_server.py   `relayrl serve` (OpenAI API over an engine, per-session token traces)
    traces.py          session traces -> trajectories (history-rewrite detection)
    openai_agent.py    OpenAIAgentExecutor: train agents written against the OpenAI client

Importing this package is light (no aiohttp); the HTTP modules are imported where used.
"""

from relayrl.agents.base import AgentExecutorBase, AgentInstanceBase, Trajectory, TrajectoryStatus
from relayrl.agents.executors import MultiTurnExecutor, SingleTurnExecutor, execute_all, load_agent_from_file
from relayrl.agents.failures import (
    FailureLog,
    FailurePolicy,
    RolloutFailure,
    apply_failure_policy,
    mark_failed,
)
from relayrl.data.records import PromptSample

MultiTurnAgentExecutor = MultiTurnExecutor
"""OpenRLHF's name for `MultiTurnExecutor` (its agent files subclass it)."""

__all__ = [
    "AgentExecutorBase",
    "AgentInstanceBase",
    "FailureLog",
    "FailurePolicy",
    "MultiTurnAgentExecutor",
    "MultiTurnExecutor",
    "PromptSample",
    "RolloutFailure",
    "SingleTurnExecutor",
    "Trajectory",
    "TrajectoryStatus",
    "apply_failure_policy",
    "execute_all",
    "load_agent_from_file",
    "mark_failed",
]
