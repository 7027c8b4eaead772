"""The one grammar of reward-source specs (`reward.source`), parsed once; `build_reward_source` maps a parsed
spec to a source.

    spec = resolve_reward_spec(source="", task="add2", agent="single")    -> "task:add2"  (the spec in force)
    parsed = parse_reward_spec(spec)                                     -> SourceSpec(kind="task", target="add2")

    spec string                         kind      target / urls
    agent                               agent     the multi-turn agent already set its rewards
    http(s)://h1/..,http(s)://h2/..     remote    urls: remote reward models (comma-separated, or a list)
    task:<name>                         task      target: the task name (its reward comes from relayrl.tasks,
                                                  a higher layer: the caller passes the task lookup)
    path/to/reward.py                   file      target: a reward_func file
    rm:<path>, or any folder            rm        target: a local reward model folder
    prm:<path>                          prm       target: a process reward model folder (`relayrl prm`'s
                                                  export; per-step scores, relayrl.agents.rewards.prm)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

SourceKind = Literal["agent", "remote", "task", "file", "rm", "prm"]

AGENT = "agent"
"""The spec of the multi-turn agent's own rewards."""

SPEC_FORMS = (
    "a reward_func file 'path/to/reward.py', http(s) URLs (comma-separated or a list) of remote reward "
    "models, 'rm:<path>' (a local reward model folder), 'prm:<path>' (a process reward model folder), or "
    "'task:<name>' (a built-in task)"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class SourceSpec:
    """A parsed reward-source spec (see module doc)."""

    kind: SourceKind
    """Which source: agent, remote, task, file, rm or prm."""
    target: str = ""
    """task: the task name; file: the reward_func path; rm / prm: the model folder; "" for agent / remote."""
    urls: tuple[str, ...] = field(default_factory=tuple)
    """remote: the reward servers' URLs."""
    text: str = ""
    """The spec as given (for messages)."""


def resolve_reward_spec(source: str, *, task: str = "", agent: str = "single") -> str:
    """The spec in force: `source` when set, else task:<task> for single-turn rollouts with a task, else
    "agent" for multi-turn agents (their own rewards), else "" (no reward source)."""
    if source:
        return source
    if task and agent == "single":
        return f"task:{task}"
    if agent != "single":
        return AGENT
    return ""


def parse_reward_spec(spec: str | Sequence[str]) -> SourceSpec:
    """The kind and target of a spec string (or a list of URLs); ValueError naming the accepted forms."""
    if not isinstance(spec, str):
        return SourceSpec(kind="remote", urls=tuple(spec), text=",".join(spec))
    if spec == AGENT:
        return SourceSpec(kind="agent", text=spec)
    if spec.startswith(("http://", "https://")):
        return SourceSpec(kind="remote", urls=tuple(s.strip() for s in spec.split(",")), text=spec)
    if spec.startswith("task:"):
        return SourceSpec(kind="task", target=spec[len("task:") :], text=spec)
    if spec.endswith(".py"):
        return SourceSpec(kind="file", target=spec, text=spec)
    if spec.startswith("prm:"):
        return SourceSpec(kind="prm", target=spec[len("prm:") :], text=spec)
    if spec.startswith("rm:") or Path(spec).is_dir():
        return SourceSpec(kind="rm", target=spec[len("rm:") :] if spec.startswith("rm:") else spec, text=spec)
    raise ValueError(f"reward source {spec!r} not understood; give {SPEC_FORMS}")
