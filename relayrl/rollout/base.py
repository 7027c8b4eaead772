"""The rollout-engine seam: token ids in, token ids + log-probs out.

Every engine (native: built in and colocated with the trainer; hf: `transformers.generate`, the reference;
vllm: optional adapter) implements `RolloutEngine`. Callers (agent executors, the OpenAI server, the RL loop)
only ever see these records, so an engine can be swapped without touching them.

Log-prob semantics (one everywhere, DESIGN.md): `logprobs[i]` is log pi(token_i | prefix) under the
temperature-scaled distribution softmax(logits / temperature), *before* top-p / top-k truncation. With
truncation the sampling distribution differs from the one the log-prob describes; the trainer corrects
the mismatch with TIS / ICEPOP (algorithms/off_policy). With temperature 0 (greedy) log-probs are those of
softmax(logits).

Shaped after vLLM's async engine (`generate(prompt, params, request_id)`, `sleep`/`wake_up`,
weight loading), so a vLLM adapter fits behind the same protocol without changing callers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

import torch


class FinishReason(StrEnum):
    """Why a completion ended."""

    STOP = "stop"
    """A stop token (EOS or one of `stop_token_ids`) was generated; it is included in `token_ids`."""
    LENGTH = "length"
    """`max_new_tokens` or the engine's total length limit was reached."""
    ABORT = "abort"
    """The request was aborted (engine shut down, sleep, or cancelled)."""


@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample. Mirrors vLLM's SamplingParams for the fields RL needs."""

    n: int = 1
    """Samples per prompt; they share one prefill of the prompt."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or -1) disables it."""
    max_new_tokens: int = 128
    """Most tokens to generate per sample."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the tokenizer's EOS."""
    seed: int | None = None
    """Per-request seed: the same seed, prompt and params give the same samples."""
    logprobs: bool = True
    """Return the log-prob of every generated token."""

    @property
    def max_tokens(self) -> int:
        """vLLM's / OpenAI's name for `max_new_tokens` (OpenRLHF agents read `sampling_params.max_tokens`)."""
        return self.max_new_tokens

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(kw_only=True, slots=True)
class GenerationRequest:
    """One prompt to complete n times."""

    prompt_ids: list[int]
    """Prompt token ids, [P] ints (already templated; the engine never tokenizes)."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters."""
    request_id: str = ""
    """Caller's id, echoed back in the result."""


@dataclass(kw_only=True, slots=True)
class Completion:
    """One sampled continuation."""

    token_ids: list[int]
    """Generated token ids, [G] ints, including the stop token when finish_reason is STOP."""
    logprobs: list[float]
    """[G] floats: log pi(token | prefix) under the temperature-scaled distribution (see module doc)."""
    finish_reason: FinishReason
    """Why it ended."""
    versions: list[int] = field(default_factory=list)
    """[G] ints: the engine's weight version (`engine.version`) that produced each token; a sample that ran
    across a `load_weights` (partial rollout) has the old version on its earlier tokens and the new one after.
    Empty when the engine does not track versions."""


@dataclass(kw_only=True, slots=True)
class GenerationResult:
    """The n completions of one request."""

    request_id: str
    """The request's id."""
    prompt_ids: list[int]
    """The prompt, [P] ints, as given."""
    completions: list[Completion]
    """n completions, in sample order."""


@runtime_checkable
class RolloutEngine(Protocol):
    """An async generation engine. Many `generate` calls may be in flight at once (continuous batching)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Complete one request (n samples)."""
        ...

    version: int
    """The weight version generating now: starts at 0; `load_weights` sets it (its `version`, else + 1)."""

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, *, version: int | None = None
    ) -> None:
        """Take new policy weights. `None` means "the weights you share with the trainer changed in place"
        (colocated native engine: nothing to copy, only caches that depend on weights are dropped).
        In-flight requests are not aborted: they pause while the weights change and then continue under the
        new ones (partial rollout; their K/V cache of earlier tokens is kept), their tokens tagged with the
        version that produced them (`Completion.versions`)."""
        ...

    def sleep(self) -> None:
        """Release memory held for generation (KV cache, graphs) so training can use it."""
        ...

    def wake_up(self) -> None:
        """Re-acquire what `sleep` released."""
        ...

    def close(self) -> None:
        """Stop background work and free everything; pending requests finish with ABORT."""
        ...


def generate_all(engine: RolloutEngine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Synchronous helper: run all requests concurrently on `engine` and return results in order."""

    async def _run() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

    return asyncio.run(_run())
