"""Agents: executors that turn a prompt into token-exact trajectories on a rollout engine, reward sources,
the failure policy, the OpenAI-compatible server and `relayrl serve-rm`.

    base.py            Trajectory, TrajectoryStatus, AgentInstanceBase, AgentExecutorBase (PromptSample: data/)
    executors.py       SingleTurnExecutor, MultiTurnExecutor, execute_all
    loader.py          load_agent_from_file: a user's agent file -> an executor (imports both executor kinds)
    user_code.py       load_module_from_file, run_in_thread: running user code (no relayrl imports)
    failures.py        mark_failed, apply_failure_policy, FailurePolicy, FailureLog
    rewards/           RewardSource protocol + reward_func file / remote HTTP RM / local RM / task sources,
                       the spec grammar (spec.py) and build_reward_source
    http.py            start_app: the aiohttp bootstrap of both servers
    remote_rm.py       the `relayrl serve-rm` app (OpenRLHF's /get_reward JSON)
    openai_server.py   OpenAIServer, the `relayrl serve` app (OpenAI API over an engine, session traces)
    traces.py          session traces -> trajectories (history-rewrite detection)
    openai_agent.py    OpenAIAgentExecutor: train agents written against the OpenAI client

Imports run one way: user_code <- executors <- traces <- openai_server <- openai_agent <- loader.
"""

from relayrl.agents.base import AgentExecutorBase, AgentInstanceBase, Trajectory, TrajectoryStatus
from relayrl.agents.executors import MultiTurnExecutor, SingleTurnExecutor, execute_all
from relayrl.agents.failures import (
    FailureLog,
    FailurePolicy,
    RolloutFailure,
    apply_failure_policy,
    mark_failed,
)
from relayrl.agents.loader import load_agent_from_file

MultiTurnAgentExecutor = MultiTurnExecutor
"""OpenRLHF's name for `MultiTurnExecutor` (its agent files subclass it)."""

__all__ = [
    "AgentExecutorBase",
    "AgentInstanceBase",
    "FailureLog",
    "FailurePolicy",
    "MultiTurnAgentExecutor",
    "MultiTurnExecutor",
    "RolloutFailure",
    "SingleTurnExecutor",
    "Trajectory",
    "TrajectoryStatus",
    "apply_failure_policy",
    "execute_all",
    "load_agent_from_file",
    "mark_failed",
]
