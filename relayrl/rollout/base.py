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

Declared capabilities (what a caller may rely on beyond `RolloutEngine`; nobody tests an engine's name):

    Pausable        engine.paused(): no round runs inside the block (a caller changes the weights the engine
                    reads in place, then calls load_weights); `paused(engine)` refuses an engine without it
    WorkerLoading   engine.run_in_workers(fn, ...) / load_in_workers(fn, ..., version=v): the model lives in
                    worker processes of the engine (vllm), so weights are taken there, never through this process
    EngineCapabilities  facts of an engine CLASS, readable before it is built (`Class.capabilities`, or
                    relayrl.rollout.build.engine_capabilities(name)): it loads its own weights from a folder,
                    spans several GPUs, preallocates a fixed number of sequence slots, needs a GPU
    EngineSettings  what the one factory (rollout/build.py) builds any engine from; each engine class maps it
                    to its own constructor options (`Class.options(settings)`)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from relayrl.rollout.media import ImageInputs


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
    images: ImageInputs | None = None
    """The prompt's images (vision-language models), their pad tokens already in `prompt_ids`; None for text.
    Engines without image support refuse a request that has them."""


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
    routes: torch.Tensor | None = None
    """Routing replay (mixture-of-experts models, native engine with `record_routes`): int16 tensor
    [P + G, MoE layers, k], the experts each token of prompt + completion was routed to, in every MoE layer
    (rollout/native_moe.py); the last token, never fed back, holds -1 (the trainer routes it itself). None
    otherwise."""


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


@runtime_checkable
class Pausable(Protocol):
    """Capability: hold rounds back while the caller changes what the engine reads (every in-process engine:
    native, hf, vllm, through driver.ThreadedEngine)."""

    def paused(self) -> AbstractContextManager[None]:
        """No round runs inside the block; requests submitted meanwhile wait, requests in flight resume after
        it (under the new weights when the block changed them and called `load_weights`)."""
        ...


@runtime_checkable
class WorkerLoading(Protocol):
    """Capability: the model lives in worker processes of the engine (vllm's executor), so a separate engine
    takes new weights inside those workers (relayrl/distributed/weights/vllm.py), not through this process."""

    def run_in_workers(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(worker, *args) in every worker process (fn a module-level function: it is pickled by reference);
        one result per worker, in worker (tp rank) order."""
        ...

    def load_in_workers(self, fn: Callable[..., Any], *args: Any, version: int) -> None:
        """fn(worker, *args) in every worker between two rounds, to change the weights there; then what
        `load_weights` does after a load (weight-dependent caches dropped, `version` set)."""
        ...


def paused(engine: RolloutEngine) -> AbstractContextManager[None]:
    """`engine.paused()`; a TypeError naming the engine when it does not declare `Pausable` (its weights
    cannot be changed in place under it)."""
    if not isinstance(engine, Pausable):
        raise TypeError(
            f"{type(engine).__name__} does not declare pausing (relayrl.rollout.base.Pausable): its weights "
            "cannot be changed in place; give it new weights through load_weights(named_tensors) only"
        )
    return engine.paused()


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineCapabilities:
    """What an engine class declares about itself (`Class.capabilities`), readable before it is built."""

    own_weights: bool = False
    """It loads the model from a folder itself and keeps its own copy (vllm): it is built from a path, not a
    module; it shares nothing with a trainer, so every `load_weights` needs named tensors (never None) and
    the trainer streams them (relayrl/distributed/weights/local.py, stream)."""
    tensor_parallel: bool = False
    """It can spread one model over several GPUs: over a separate engine's GPUs (`EngineSettings.tp`, vllm's
    workers), or one shard per process of a group (native: `build_engine(..., group=)`, rollout/native_tp.py)."""
    fixed_slots: bool = False
    """It preallocates K/V for a fixed number of sequences (native: `EngineSettings.max_seqs` rows): a caller
    sizes it to its workload. Engines without fixed slots size their batch themselves (vllm pages its cache;
    max_seqs is only a cap there)."""
    needs_gpu: bool = False
    """It runs on a CUDA GPU only."""


Placement = Literal["alone", "colocated", "separate"]
"""Where an engine runs: alone (a command that only generates: generate, serve), colocated (beside a trainer
on its GPU: the policy's ranks), separate (an engine actor of its own, `tp` GPUs, no trainer)."""


@dataclass(kw_only=True, slots=True)
class EngineSettings:
    """What the factory (relayrl/rollout/build.py) builds any engine from; each engine class maps it to its
    own constructor options (`Class.options`). Unset fields leave the engine's own default."""

    max_seq_len: int | None = None
    """Prompt + completion length limit (None: the engine's default)."""
    max_seqs: int | None = None
    """Sequences decoded at once (native: its K/V slots; vllm: max_num_seqs; hf: unused, it batches up to its
    max_batch rows). None: the engine's default."""
    prefix_cache: bool | None = None
    """native: keep finished sequences' K/V for a later request that extends them (multi-turn); None: its
    default for the device. vllm keeps its own prefix caching on."""
    exact: bool = False
    """native: the exact on-policy mode (rollout/exact.py): batch-invariant forward, log-probs equal to the
    trainer's bit for bit (the trainer must run the 'exact' layout); other engines ignore it (the RL config
    refuses it for them)."""
    fused_kernels: bool = True
    """native: decode through the fused Triton kernels (rollout/kernels.py) on a CUDA device when triton imports;
    False: the plain torch ops. Other engines ignore it."""
    record_routes: bool = False
    """native: record a mixture-of-experts model's experts per token (Completion.routes) for routing replay
    (rl: rollout.routing_replay); other engines ignore it."""
    placement: Placement = "alone"
    """Where the engine runs (decides vllm's GPU memory share, sleep mode and executor)."""
    tp: int = 0
    """GPUs of a separate engine (tensor parallelism, worker processes; engines with `tensor_parallel`)."""
    dtype: str = ""
    """Engines that load their own weights: the dtype they load in (e.g. bfloat16); '' = the folder's."""
    trust_remote_code: bool = False
    """Engines that load their own weights: run the folder's custom model code."""
    gpu_util: float = 0.0
    """vllm: share of the GPU's memory it takes; 0 = the default for the placement (vllm_engine.gpu_share)."""
    any_version: bool = False
    """vllm: start with an installed vLLM outside the supported release line (--rollout.vllm_any_version)."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """vllm: more EngineArgs, over the ones derived here (rollout.vllm_args)."""


class EngineClass(Protocol):
    """A registered engine class (rollout/build.py ENGINES): its declared capabilities, its mapping of the
    shared settings to its options, and its constructor."""

    capabilities: ClassVar[EngineCapabilities]

    def options(self, settings: EngineSettings) -> dict[str, Any]:
        """Constructor keywords for `settings` (a classmethod on the engine class)."""
        ...

    def __call__(self, model: Any, tokenizer: Any = None, /, **opts: Any) -> RolloutEngine: ...


def generate_all(engine: RolloutEngine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Synchronous helper: run all requests concurrently on `engine` and return results in order."""

    async def _run() -> list[GenerationResult]:
        return list(await asyncio.gather(*(engine.generate(r) for r in requests)))

    return asyncio.run(_run())
