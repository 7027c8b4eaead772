"""The agent seam: a prompt in, `Trajectory` records out (token-in-token-out).

`AgentExecutorBase.execute` turns one `PromptSample` into n `Trajectory`s using a `RolloutEngine`.
`SingleTurnExecutor` (default) samples n completions with one shared prefill; `MultiTurnExecutor` drives a
user's `AgentInstanceBase` (async `reset` / `step`, OpenRLHF's contract) turn by turn, appending environment
feedback as token ids masked out of the loss. The RL loop never parses text: rewards come from the
agent (multi-turn) or from a reward source (reward function file, remote RM, local RM) after execution.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from relayrl.data.records import PromptSample
from relayrl.rollout.base import SamplingParams
from relayrl.rollout.media import ImageInputs


class TrajectoryStatus(str, Enum):  # noqa: UP042  (kept: the lead's record, str mixin semantics)
    """Outcome of executing one sample."""

    OK = "ok"
    """Finished normally (reward may still be pending from a reward source)."""
    FAILED = "failed"
    """A user step / reward raised, returned NaN or the wrong length, or timed out (see `error`)."""


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
    versions: list[int] = field(default_factory=list)
    """[T]: the policy (engine weight) version that generated each action token, -1 where action_mask is
    False or the engine did not say; empty when never recorded. Async training measures staleness with it."""
    reward: float | None = None
    """Scalar reward; None until a reward source fills it."""
    score: float | None = None
    """Score used by dynamic filtering and pass@k (defaults to reward)."""
    dense_rewards: list[float] = field(default_factory=list)
    """[T] per-token rewards added to the return at their tokens (a process reward model's step scores at
    step-end tokens, relayrl.agents.rewards.prm), 0.0 elsewhere; empty when the source gives none."""
    status: TrajectoryStatus = TrajectoryStatus.OK
    """OK or FAILED."""
    error: str | None = None
    """What went wrong, when FAILED."""
    truncated: bool = False
    """True when the last turn ended at a length limit rather than a stop token / done."""
    response_text: str = ""
    """Decoded response (all turns) for reward functions and sample tables."""
    query_text: str | None = None
    """The decode of all `token_ids`, special tokens kept (a reward function's `queries`): made by the rank
    that generated it when several ranks generate (relayrl.workers.engine.generate_share), so the driver does
    not decode every rank's samples in turn; None when not made (the reward source decodes)."""
    extra_logs: dict[str, float] = field(default_factory=dict)
    """Scalar metrics from the agent / reward function, averaged into rollout/* metrics."""
    num_turns: int = 1
    """Turns taken."""
    routes: Any = None
    """Routing replay (rollout.routing_replay): int16 tensor [T', MoE layers, k], the experts the engine routed
    each token to (Completion.routes of the last turn, whose prompt is the whole history; T' <= T: feedback
    after it is routed by the trainer); None when not recorded."""
    images: ImageInputs | None = None
    """Vision-language models: the images whose pad tokens are in `token_ids` (the prompt's, then those an
    environment returned as `environment_images`), in token order; None for text."""
    failure_kind: str | None = None
    """When FAILED: a short kind ("exception", "nan", "wrong_length", "timeout", ...) for metrics."""

    @property
    def prompt_len(self) -> int:
        """Tokens before the first action token."""
        return len(self.sample.prompt_ids)

    @property
    def response_len(self) -> int:
        """Number of action tokens."""
        return sum(self.action_mask)


class AgentInstanceBase(ABC):
    """One environment episode (OpenRLHF's `AgentInstanceBase`, same method names and dict keys).

    A fresh instance is made per episode (`__init__` may be `async def`, as in OpenRLHF's example).
    `reset(states)` gets `{"observation": prompt text, "label": label}` and returns `{"observation": text}`.
    `step(states)` gets `{"observation_text", "action_text", "label", "sampling_params"}` and returns a dict
    with "rewards" (float or 1-element tensor), "scores" (optional), "environment_feedback" (text appended
    after the action and masked out of the loss), "done" (bool), optional "sampling_params" for the next
    turn and optional "extra_logs" (name -> scalar). A vision-language model's environment may also return
    "environment_images" (a list of PIL images, file paths or data URIs; the feedback text marks each with
    `<image>`, else they go first): they join the next turn (relayrl.agents.env_images).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # noqa: B027
        pass

    async def reset(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return states

    @abstractmethod
    async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """Turns one prompt into `params.n` token-exact trajectories (see relayrl/agents/executors.py).

    Executors are built unbound (OpenRLHF's `AgentExecutor()` takes no engine) and get their engine,
    tokenizer and total length limit from `bind` before the first `execute`.
    """

    engine: Any = None
    tokenizer: Any = None
    max_total_len: int | None = None

    def bind(self, engine: Any, tokenizer: Any, *, max_total_len: int | None = None) -> AgentExecutorBase:
        """Attach the rollout engine, the tokenizer and the total length limit (prompt + all turns)."""
        self.engine, self.tokenizer, self.max_total_len = engine, tokenizer, max_total_len
        return self

    @abstractmethod
    async def execute(self, sample: PromptSample, params: SamplingParams) -> list[Trajectory]:
        """Run `params.n` episodes of `sample`; failures come back as FAILED trajectories, never raised."""
        raise NotImplementedError
