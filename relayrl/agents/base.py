"""The agent seam: a prompt in, `Trajectory` records out (token-in-token-out).

`AgentExecutorBase.execute` turns one `PromptSample` into n `Trajectory`s using a `RolloutEngine`.
`SingleTurnExecutor` (default) samples n completions with one shared prefill; `MultiTurnExecutor` drives a
user's `AgentInstanceBase` (async `reset` / `step`, OpenRLHF's contract) turn by turn, appending environment
feedback as token ids masked out of the loss. The RL loop never parses text: rewards come from the
agent (multi-turn) or from a reward source (reward function file, remote RM, local RM) after execution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class TrajectoryStatus(str, Enum):
    """Outcome of executing one sample."""

    OK = "ok"
    """Finished normally (reward may still be pending from a reward source)."""
    FAILED = "failed"
    """A user step / reward raised, returned NaN or the wrong length, or timed out (see `error`)."""


@dataclass(kw_only=True, slots=True)
class PromptSample:
    """One prompt from the dataset, tokenized once at the edge."""

    index: int
    """Position of the prompt in its dataset (stable across resume); groups are keyed by it."""
    prompt: str
    """Prompt text after templating (for reward functions and logs)."""
    prompt_ids: list[int]
    """Prompt token ids, [P] ints."""
    label: Any = None
    """Ground truth for verifiable rewards (task-defined), or None."""
    datasource: str = "default"
    """Name of the dataset it came from (metrics are split by it)."""
    messages: list[dict[str, str]] | None = None
    """The chat messages the prompt was built from, when it was a chat."""


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One sampled episode, token-exact. All per-token lists have length len(token_ids)."""

    sample: PromptSample
    """The prompt it answers."""
    token_ids: list[int]
    """Prompt + every turn's generated and environment tokens, [T] ints."""
    action_mask: list[bool]
    """[T]: True where the policy generated the token (trained on); False for prompt / env feedback."""
    rollout_logprobs: list[float]
    """[T]: engine log-prob of each action token (temperature-scaled); 0.0 where action_mask is False."""
    reward: float | None = None
    """Scalar reward; None until a reward source fills it."""
    score: float | None = None
    """Score used by dynamic filtering and pass@k (defaults to reward)."""
    status: TrajectoryStatus = TrajectoryStatus.OK
    """OK or FAILED."""
    error: str | None = None
    """What went wrong, when FAILED."""
    truncated: bool = False
    """True when the last turn ended at a length limit rather than a stop token / done."""
    response_text: str = ""
    """Decoded response (all turns) for reward functions and sample tables."""
    extra_logs: dict[str, float] = field(default_factory=dict)
    """Scalar metrics from the agent / reward function, averaged into rollout/* metrics."""
    num_turns: int = 1
    """Turns taken."""

    @property
    def prompt_len(self) -> int:
        """Tokens before the first action token."""
        return len(self.sample.prompt_ids)

    @property
    def response_len(self) -> int:
        """Number of action tokens."""
        return sum(self.action_mask)
