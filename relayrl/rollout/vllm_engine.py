"""`vllm` engine: an optional adapter that runs vLLM's engine in this process behind `RolloutEngine`.

    engine = build_engine("vllm", "/path/to/hf-folder", None, max_seq_len=1024, gpu_memory_utilization=0.5)

Pinned: vLLM 0.26; the version check, the import and the EngineArgs the factory derives (GPU memory share,
placement, sleep mode) are in vllm_setup.py.

Shape
-----
It is a `ThreadedEngine` (driver.py), like `native` and `hf`: `generate` queues a `Pending`, one driver thread
owns a `vllm.LLMEngine` built in-process (`multiprocess_mode=False`: the engine core, scheduler, executor and
model runner all live in this process, so `load_weights` hands tensors to the model runner by reference and
no event loop is tied to vLLM). A round (`_step`) adds the newly queued requests to vLLM, runs one
`LLMEngine.step()` (one scheduler iteration: prefill and/or one decode step of every running sequence,
vLLM's own continuous batching, CUDA graphs and prefix caching), appends the tokens each sample produced in
that step and resolves the requests that finished.

    GenerationRequest ──> TokensPrompt(prompt_ids) + vllm.SamplingParams(n, temperature, top_p, top_k,
                          max_tokens, stop_token_ids = EOS ids + stop ids, ignore_eos, seed, logprobs=0,
                          detokenize=False, output_kind=DELTA)
    RequestOutput     ──> per sample (CompletionOutput.index) the step's new token ids and their log-probs,
                          accumulated here; `finished` (all n samples done) resolves the GenerationResult

Outputs are streamed (`RequestOutputKind.DELTA`, `stream_interval=1`): every `step()` returns, for each
sample that produced tokens, only those tokens. With n > 1 vLLM fans the request out into n child requests
(vllm/v1/engine/parallel_sampling.py: child ids "{i}_{id}", sample i seeded seed + i); in DELTA mode each
child's delta comes back as its own RequestOutput under the caller's request id with `outputs = [that
child's CompletionOutput]` (index i), and `RequestOutput.finished` turns True once every child has finished
(vllm/v1/engine/output_processor.py, `RequestState.make_request_output`).

Token ids in and out: the engine is built with `skip_tokenizer_init=True`; vLLM never tokenizes.
Vision-language models (a folder whose config has a vision_config; docs/vlm.md): the tokenizer is loaded
(vLLM's image processing needs the HF processor), a request's images go as `multi_modal_data={"image": [PIL
images]}` and its prompt ids with each image's pad run cut back to one pad (vLLM expands it itself, to the
same count: the same image processor decides it); the image / video placeholder ids get logit bias -100 (never
sampled, as in the hf engine). Checked on a GPU only (`bench/vlm.py --vllm`).
`generation_config="vllm"`: the model folder's generation_config.json changes no sampling default.
Stops: the EOS ids (`eos_token_id=`, else the tokenizer's, else the folder's generation/model config) plus
`SamplingParams.stop_token_ids` go to vLLM as explicit `stop_token_ids` with `ignore_eos=True`, so exactly
that set stops a sample (the stop token is kept, reason STOP), as in the other engines.

Log-probs (the protocol's semantics: log_softmax(logits / T) of the sampled token, before top-p / top-k;
T = 1 when greedy). vLLM 0.26's `logprobs_mode` decides what it reports: "raw_logprobs" (its default) is
log_softmax(logits) at T = 1 whatever the temperature; "processed_logprobs" is log_softmax of the logits
after temperature *and* after top-k / top-p masking. The engine is started with "processed_logprobs":
  - top_p = 1 and top_k = 0 (the RL default): exactly the protocol's log-probs, log_softmax(logits / T);
  - greedy (T = 0): vLLM divides by 1, so log_softmax(logits), as the protocol says;
  - top_p < 1 or top_k > 0: vLLM reports the log-prob under the truncated, renormalised distribution,
    log pi_T(tok) - log(mass kept by the truncation) >= the protocol's value. The engine logs a warning
    once; use top_p = 1 / top_k = 0 with this engine when the trainer needs behaviour log-probs, or
    recompute them (the trainer's TIS / ICEPOP correction assumes the pre-truncation value).

Weights: the engine loads `model` itself and holds its own copy (`load_weights(None)` raises). `load_weights
(named_tensors)` consumes the (name, tensor) iterator in chunks of about LOAD_CHUNK_BYTES and runs
`model.load_weights(chunk)` inside vLLM's worker for each (through `collective_rpc`, by reference: the
executor is in this process), which copies HF-named tensors into the existing parameters in place (q/k/v and
gate/up are packed by vLLM's loaders; a tied lm_head may be absent), so captured CUDA graphs stay valid; a
lazy iterator (LocalWeights(stream=True).engine_tensors(): a cast or an FSDP all-gather per tensor) is
therefore never materialised whole. Then `reset_prefix_cache(reset_running_requests=True)`: vLLM's scheduler
(vllm/v1/core/sched/scheduler.py) PREEMPTS every running request (back to its waiting queue, K/V blocks freed;
not aborted) and empties the prefix cache, so no K/V computed with the old weights is ever reused. Partial
rollout therefore works as in `native` except for the K/V: a request in flight keeps its tokens and goes on
under the new weights after recomputing its prompt + tokens so far (one prefill, under the new weights),
where `native` keeps the old K/V. With async scheduling (vLLM's default), a step still in flight when
the weights change is discarded by the scheduler (`Request.async_tokens_to_discard`) and resampled.

Weight versions (`Completion.versions`): `load_weights` runs between rounds (under the round lock), and
every token a round receives was sampled in that round's `step()` under the weights of `self.version`
(stream_interval 1: no token is held back to a later step; in-flight async frames are discarded at a
weight change, see above), so each delta's tokens are stamped with `self.version` as they arrive; no
`_version_changed` bookkeeping is needed.

Memory: `sleep()` aborts in-flight requests (ABORT) and, when the engine was built with
`enable_sleep_mode=True`, calls vLLM's sleep (level `sleep_level`: 1 offloads weights to CPU and drops the
KV cache; 2 drops both, so `load_weights` must follow `wake_up`); without sleep mode it only aborts.
`load_weights` while asleep wakes the engine first (the weights must be resident to be overwritten).
`close()` aborts, shuts vLLM's engine core down and empties the CUDA cache. vLLM 0.26 allows one
sleep-mode engine per process (its CuMem allocator is a singleton: a second one fails its start-up with
"CuMem allocator can only be used for one instance per process").
In-process side effects: vLLM seeds the process's global RNGs with `EngineArgs.seed` (default 0) when the
engine is built (`keep_rng=True`, which the factory passes beside a trainer, restores them afterwards, so the
trainer's random stream does not depend on the engine), and, without a torch.distributed group, starts a
1-process one for its worker.

Lengths: `max_seq_len` is vLLM's `max_model_len`; a prompt of >= max_seq_len tokens returns empty LENGTH
completions without reaching vLLM; max_tokens = min(max_new_tokens, max_seq_len - P).
Seeds: a seeded request with n samples gives sample i vLLM's seed + i (vLLM's parallel-sampling rule).
Separate engine actors and tensor parallelism (relayrl/workers/engine.py, `dist.num_engines`, `dist.engine_tp`):
the engine is built with `tensor_parallel_size=tp` and `distributed_executor_backend="mp"` (vLLM's worker
processes, one per GPU of the actor, even for tp 1: they get a clean torch.distributed world of their own,
apart from the actor's engine-role group). Weights then never pass through this process: `run_in_workers`
and `load_in_workers` run a function inside every worker (`collective_rpc`), the latter between two rounds
followed by the same prefix-cache reset and version change as `load_weights`; what the workers run to join
the policy's weight group and take its broadcast is relayrl/distributed/weights/vllm.py. The colocated
`load_weights` path stays one-process (tp 1, `uni` executor): a multi-process executor would pickle the
tensors it sends.
`vllm` is imported only when this engine is built; without it an ImportError says how to install it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from relayrl.rollout.base import (
    Completion,
    EngineCapabilities,
    EngineSettings,
    FinishReason,
    GenerationRequest,
)
from relayrl.rollout.driver import Pending, ThreadedEngine
from relayrl.rollout.media import is_vlm_folder
from relayrl.rollout.vllm_setup import (
    ENGINE_DEFAULTS,
    engine_options,
    folder_eos_ids,
    import_vllm,
    keeping_global_rng,
)

log = logging.getLogger(__name__)

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}

LOAD_CHUNK_BYTES = 256 * 2**20
VLM_IMAGES_PER_PROMPT = 8
"""vLLM's limit_mm_per_prompt for images of a VLM (a prompt's images plus every environment turn's); more
through rollout.vllm_args '{"limit_mm_per_prompt": {"image": N}}'."""
"""`load_weights` hands vLLM's loader this many bytes of tensors at a time (bounds what a lazy iterator,
e.g. an FSDP all-gather per tensor, holds at once)."""


@dataclass(eq=False, slots=True)
class _Sample:
    """One sample's tokens so far (vLLM streams them step by step)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """The weight version of the step that produced each token."""
    reason: FinishReason | None = None

    def completion(self) -> Completion:
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.reason or FinishReason.LENGTH,
            versions=self.versions,
        )


@dataclass(eq=False, slots=True)
class _Live:
    """A request vLLM is working on: the caller's `Pending` and its n samples."""

    pending: Pending
    samples: list[_Sample]


class VLLMEngine(ThreadedEngine):
    """`RolloutEngine` over an in-process `vllm.LLMEngine` holding its own copy of the weights."""

    llm: Any
    """vllm.LLMEngine (None once closed)."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities(
        own_weights=True, tensor_parallel=True, needs_gpu=True
    )

    @classmethod
    def options(cls, settings: EngineSettings) -> dict[str, Any]:
        """Constructor keywords for the factory's `settings` (relayrl/rollout/vllm_setup.py)."""
        return engine_options(settings)

    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        *,
        max_seq_len: int | None = None,
        eos_token_id: int | list[int] | None = None,
        sleep_level: int = 1,
        keep_rng: bool = False,
        any_version: bool = False,
        **engine_args: Any,
    ) -> None:
        """`model`: a local HF folder (or hub id); `max_seq_len`: vLLM's max_model_len; `eos_token_id`:
        stop ids for every request (default the tokenizer's EOS, else the folder's config; [] for none);
        `sleep_level`: vLLM sleep level used by `sleep()`; `keep_rng`: restore the process's global RNG states
        after vLLM's start-up seeded them; `any_version`: start with any installed vLLM release; `engine_args` go to `vllm.EngineArgs` (e.g. dtype,
        gpu_memory_utilization, max_num_seqs, enable_sleep_mode=True, enforce_eager, seed) over
        ENGINE_DEFAULTS."""
        super().__init__(name="vllm")
        t0 = time.perf_counter()
        self.image_token = -1  # a VLM's image-pad id (set by _start)
        self.no_vision: dict[int, float] = {}  # a VLM's placeholder ids -> logit bias -100 (set by _start)
        if not isinstance(model, str | Path):
            raise TypeError(
                f"VLLMEngine takes a model folder or hub id (str or Path), not a {type(model).__name__}: vLLM "
                "loads the weights itself. Pass the folder the module was loaded from (ModelConfig.name_or_path; "
                "relayrl.workers.builders.build_engine_for does), or model.save_pretrained(folder) first; "
                "later weights go in through load_weights"
            )
        with keeping_global_rng() if keep_rng else contextlib.nullcontext():
            config = self._start(str(model), max_seq_len, engine_args, any_version)
        self.max_seq_len = int(config.model_config.max_model_len)
        self.vocab_size = int(config.model_config.get_vocab_size())
        self.sleep_mode = bool(config.model_config.enable_sleep_mode)
        self.sleep_level = sleep_level
        if eos_token_id is not None:
            ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        elif getattr(tokenizer, "eos_token_id", None) is not None:
            ids = [tokenizer.eos_token_id]
        else:
            ids = folder_eos_ids(str(model))
        self.eos_ids = [int(i) for i in ids]
        self._live: dict[str, _Live] = {}
        self._asleep = False
        self._closing = False
        self._warned_truncation = False
        self.steps = 0
        """`LLMEngine.step()` calls made (scheduler iterations)."""
        self.startup_s = time.perf_counter() - t0
        """Seconds spent in the constructor (model load, profiling, compile, CUDA graph capture)."""

    def _start(
        self, model: str, max_seq_len: int | None, engine_args: dict[str, Any], any_version: bool
    ) -> Any:
        """Import vllm (any release when `any_version`, else the supported line) and build its in-process engine
        (`self.llm`) over ENGINE_DEFAULTS + `engine_args`; returns vLLM's config."""
        vllm = import_vllm(any_version)
        from vllm.inputs import TokensPrompt  # pyright: ignore[reportMissingImports] (optional package)
        from vllm.sampling_params import RequestOutputKind  # pyright: ignore[reportMissingImports]
        from vllm.usage.usage_lib import UsageContext  # pyright: ignore[reportMissingImports]
        from vllm.v1.executor import Executor  # pyright: ignore[reportMissingImports]

        args = {**ENGINE_DEFAULTS, "model": model, **engine_args}
        if is_vlm_folder(model):  # vLLM's image processing needs the HF processor (and so the tokenizer)
            args["skip_tokenizer_init"] = False
            args.setdefault("limit_mm_per_prompt", {"image": VLM_IMAGES_PER_PROMPT})
            folder_cfg = json.loads((Path(model) / "config.json").read_text())
            self.image_token = int(folder_cfg["image_token_id"])
            keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
            self.no_vision = {int(folder_cfg[k]): -100.0 for k in keys if folder_cfg.get(k) is not None}
        if max_seq_len is not None:
            args["max_model_len"] = int(max_seq_len)
        config = vllm.EngineArgs(**args).create_engine_config(UsageContext.LLM_CLASS)
        self._vllm = vllm
        self._tokens_prompt = TokensPrompt
        self._delta = RequestOutputKind.DELTA
        self.llm = vllm.LLMEngine(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=False,
            multiprocess_mode=False,
        )
        return config

    # ---- requests -------------------------------------------------------------------------------------
    def _validate(self, request: GenerationRequest) -> None:
        super()._validate(request)
        bad = [t for t in request.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: prompt ids {bad[:5]} outside the vocabulary "
                f"[0, {self.vocab_size})"
            )

    def _sampling_params(self, request: GenerationRequest):
        p = request.params
        if (p.top_p < 1 or p.top_k > 0) and p.temperature > 0 and p.logprobs and not self._warned_truncation:
            self._warned_truncation = True
            log.warning(
                "vllm engine: with top_p < 1 or top_k > 0 vLLM reports log-probs of the truncated "
                "distribution, not log_softmax(logits / T) before truncation (see relayrl/rollout/vllm_engine.py)"
            )
        return self._vllm.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(p.top_k, 0),
            max_tokens=min(p.max_new_tokens, self.max_seq_len - len(request.prompt_ids)),
            stop_token_ids=sorted(set(self.eos_ids) | set(p.stop_token_ids)),
            ignore_eos=True,
            seed=p.seed,
            logprobs=0 if p.logprobs else None,
            detokenize=False,
            output_kind=self._delta,
            **({"logit_bias": self.no_vision} if self.no_vision else {}),  # a VLM never samples a placeholder
        )

    def _add(self, pending: Pending) -> None:
        request = pending.request
        n = request.params.n
        if len(request.prompt_ids) >= self.max_seq_len:  # the prompt alone fills the length limit
            pending.finish([Completion(token_ids=[], logprobs=[], finish_reason=FinishReason.LENGTH)] * n)
            return
        rid = uuid.uuid4().hex
        try:
            prompt = self._tokens_prompt(prompt_token_ids=list(request.prompt_ids))
            if request.images is not None:  # a VLM: vLLM processes the images and expands their pads itself
                prompt["prompt_token_ids"] = request.images.collapse(
                    prompt["prompt_token_ids"], self.image_token
                )
                prompt["multi_modal_data"] = {"image": list(request.images.images)}
            self.llm.add_request(rid, prompt, self._sampling_params(request))
        except Exception as exc:  # a request vLLM refuses fails alone, with vLLM's message
            pending.fail(exc)
            return
        self._live[rid] = _Live(pending=pending, samples=[_Sample() for _ in range(n)])

    def _absorb(self, out: Any) -> None:
        """Append one RequestOutput's deltas (new tokens of one or more samples) to its request."""
        live = self._live.get(out.request_id)
        if live is None:  # aborted or cancelled meanwhile
            return
        for o in out.outputs:
            sample = live.samples[o.index]
            ids = [int(t) for t in o.token_ids]
            if ids:
                sample.token_ids.extend(ids)
                sample.versions.extend([self.version] * len(ids))
                if o.logprobs:  # DELTA: vLLM passes the last len(ids) positions
                    steps = o.logprobs[-len(ids) :]  # a list or vLLM's FlatLogprobs: both slice
                    sample.logprobs.extend(float(step[t].logprob) for step, t in zip(steps, ids, strict=True))
            if o.finish_reason is not None:
                sample.reason = _REASONS.get(str(o.finish_reason), FinishReason.LENGTH)
        if out.finished:
            del self._live[out.request_id]
            live.pending.finish([s.completion() for s in live.samples])

    # ---- ThreadedEngine hooks -------------------------------------------------------------------------
    def _step(self, new: list[Pending]) -> None:
        for pending in new:
            if not pending.cancelled:
                self._add(pending)
        cancelled = [rid for rid, live in self._live.items() if live.pending.cancelled]
        if cancelled:
            self.llm.abort_request(cancelled)
            for rid in cancelled:
                del self._live[rid]
        if not self._live:
            return
        outputs = self.llm.step()
        self.steps += 1
        for out in outputs:
            self._absorb(out)

    def _busy(self) -> bool:
        return bool(self._live)

    def _abort_inflight(self) -> None:
        live, self._live = self._live, {}
        if live:
            self.llm.abort_request(list(live))
        for request in live.values():
            request.pending.abort()

    def _fail_inflight(self, exc: BaseException) -> None:
        live, self._live = self._live, {}
        if live:
            try:
                self.llm.abort_request(list(live))
            except Exception:  # the engine is already broken; the callers get the first error
                log.exception("vllm engine: abort after a failed round failed too")
        for request in live.values():
            request.pending.fail(exc)

    def _release(self) -> None:
        if self._closing or not self.sleep_mode or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = True

    def _reacquire(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        if named_tensors is None:
            raise ValueError(
                "the vllm engine holds its own copy of the weights: load_weights needs the named tensors, "
                "e.g. LocalWeights(model, dtype=..., stream=True).engine_tensors() (None means 'the weights "
                "shared with the trainer changed in place', which only the native and hf engines have)"
            )
        if self._asleep:
            self.llm.wake_up()  # weights must be resident to be overwritten
            self._asleep = False
        sent = 0
        for chunk in named_chunks(named_tensors, LOAD_CHUNK_BYTES):
            self.llm.collective_rpc(_load_into_worker, args=(chunk,))
            sent += len(chunk)
        if sent == 0:
            raise ValueError("vllm engine: load_weights got no tensors; pass (name, tensor) pairs")
        # preempts running requests (recomputed under the new weights, not aborted); see the module doc
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            log.warning("vllm engine: prefix cache not reset after load_weights; cached K/V may be stale")

    # ---- code run inside vLLM's workers (separate engines) ----------------------------------------------
    def run_in_workers(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """fn(worker, *args) in every vLLM worker process (`collective_rpc`; `fn` is pickled by reference, so
        a module-level function), one result per worker in tp-rank order."""
        return self.llm.collective_rpc(fn, args=args)

    def load_in_workers(self, fn: Callable[..., Any], *args: Any, version: int) -> None:
        """fn(worker, *args) in every worker between two rounds, to change the weights there (e.g. take a
        broadcast: relayrl/distributed/weights/vllm.py); then, as after `load_weights`, the prefix cache is reset
        (running requests preempted) and the weight version is `version`."""
        with self._round_lock:
            self._reacquire()
            self.llm.collective_rpc(fn, args=args)
            if not self.llm.reset_prefix_cache(reset_running_requests=True):
                log.warning(
                    "vllm engine: prefix cache not reset after load_in_workers; cached K/V may be stale"
                )
            self.version = int(version)
            self._version_changed()

    def close(self) -> None:
        """Abort everything, stop the driver thread and shut vLLM's engine core down."""
        self._closing = True
        super().close()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.engine_core.shutdown()
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def named_chunks(
    named: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive lists of (name without a "module." prefix, tensor) of about `max_bytes` each."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        chunk.append((name.removeprefix("module."), tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= max_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _load_into_worker(worker: Any, named: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside vLLM's worker: copy HF-named tensors into the live model in place; returns how many."""
    with torch.inference_mode():  # vLLM may hold its parameters as inference tensors
        loaded = worker.model_runner.get_model().load_weights(weights=iter(named))
    return len(loaded) if loaded is not None else len(named)
