"""A user's agent file -> a bound executor: `load_agent_from_file(path, engine, tokenizer, ...)`.

A file defines one of the names of `ENTRY_POINTS` (the first present wins), each turned into an executor by
its builder:

    AgentExecutor   an `AgentExecutorBase` subclass constructed with no arguments (OpenRLHF's
                    `class AgentExecutor(MultiTurnAgentExecutor): super().__init__(AgentInstance)`)
    AgentInstance   wrapped in `MultiTurnExecutor(AgentInstance, **executor_kwargs)`
    openai_agent    `async def openai_agent(base_url, session_id, sample)`, an agent using the OpenAI API,
                    wrapped in `OpenAIAgentExecutor`

Files written for OpenRLHF (`from openrlhf.utils.agent import ...`) load unchanged through a small shim
module when OpenRLHF itself is not installed. This module sits above executors.py and openai_agent.py (it
imports both), so neither imports the other.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.agents.base import AgentExecutorBase, AgentInstanceBase
from relayrl.agents.executors import MultiTurnExecutor, SingleTurnExecutor
from relayrl.agents.openai_agent import OpenAIAgentExecutor
from relayrl.agents.user_code import exit_error, load_module_from_file


def _openrlhf_shim() -> None:
    """Let files written for OpenRLHF (`from openrlhf.utils.agent import ...`) load unchanged."""
    if "openrlhf.utils.agent" in sys.modules:
        return
    try:
        if importlib.util.find_spec("openrlhf") is not None:
            return  # the real OpenRLHF is installed: its classes are not ours, the loader will say so
    except (ImportError, ValueError):
        pass
    shim: Any = types.ModuleType("openrlhf.utils.agent")
    shim.AgentInstanceBase = AgentInstanceBase
    shim.AgentExecutorBase = AgentExecutorBase
    shim.MultiTurnAgentExecutor = MultiTurnExecutor
    shim.SingleTurnAgentExecutor = SingleTurnExecutor
    for name in ("openrlhf", "openrlhf.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["openrlhf.utils.agent"] = shim


def _from_executor_class(module: Any, path: str | Path, executor_kwargs: dict[str, Any]) -> AgentExecutorBase:
    try:
        executor = module.AgentExecutor()
    except SystemExit as e:
        raise exit_error(e, f"{path}: AgentExecutor()") from None
    except Exception as e:
        raise TypeError(
            f"{path}: AgentExecutor() (called with no arguments) raised {type(e).__name__}: {e}"
        ) from e
    if not isinstance(executor, AgentExecutorBase):
        raise TypeError(f"{path}: AgentExecutor must subclass relayrl.agents.base.AgentExecutorBase")
    for key, value in executor_kwargs.items():
        setattr(executor, key, value)
    return executor


def _from_instance_class(module: Any, path: str | Path, executor_kwargs: dict[str, Any]) -> AgentExecutorBase:
    try:
        return MultiTurnExecutor(module.AgentInstance, **executor_kwargs)
    except TypeError as e:
        raise TypeError(f"{path}: {e}") from e


def _from_openai_agent(module: Any, path: str | Path, executor_kwargs: dict[str, Any]) -> AgentExecutorBase:
    known = set(inspect.signature(OpenAIAgentExecutor.__init__).parameters)  # max_turns etc. do not apply
    return OpenAIAgentExecutor(
        module.openai_agent, **{k: v for k, v in executor_kwargs.items() if k in known}
    )


ENTRY_POINTS: dict[str, Callable[[Any, str | Path, dict[str, Any]], AgentExecutorBase]] = {
    "AgentExecutor": _from_executor_class,
    "AgentInstance": _from_instance_class,
    "openai_agent": _from_openai_agent,
}
"""Name an agent file defines -> the builder of its executor (module, path, executor kwargs); in order."""


def load_agent_from_file(
    path: str | Path,
    engine: Any = None,
    tokenizer: Any = None,
    *,
    max_total_len: int | None = None,
    **executor_kwargs: Any,
) -> AgentExecutorBase:
    """The executor a user file defines (see module doc), bound to `engine` / `tokenizer`."""
    _openrlhf_shim()
    module = load_module_from_file(path, "agent")
    build = next((b for name, b in ENTRY_POINTS.items() if hasattr(module, name)), None)
    if build is None:
        raise AttributeError(
            f"{path} defines none of `AgentExecutor`, `AgentInstance` or `openai_agent`; define one of them"
        )
    executor = build(module, path, executor_kwargs)
    return executor.bind(engine, tokenizer, max_total_len=max_total_len)
