"""`vllm` engine: an optional adapter that runs vLLM's engine in this process behind `RolloutEngine`.

    engine = build_engine("vllm", "/path/to/hf-folder", None, max_seq_len=1024, gpu_memory_utilization=0.5)

Shape
-----
It is a `ThreadedEngine` (driver.py), like `native` and `hf`: `generate` queues a `Pending`, one driver thread
owns a `vllm.LLMEngine` built in-process (`multiprocess_mode=False`: the engine core, scheduler, executor and
model runner all live in this process, so `load_weights` hands tensors to the model runner by reference and
no event loop is tied to vLLM). A round (`_step`) adds the newly queued requests to vLLM, runs one
`LLMEngine.step()` (one scheduler iteration: prefill and/or one decode step of every running sequence,
vLLM's own continuous batching, CUDA graphs and prefix caching) and resolves the requests that finished.

    GenerationRequest ──> TokensPrompt(prompt_ids) + vllm.SamplingParams(n, temperature, top_p, top_k,
                          max_tokens, stop_token_ids = EOS ids + stop ids, ignore_eos, seed, logprobs=0,
                          detokenize=False, output_kind=FINAL_ONLY)
    RequestOutput     ──> GenerationResult: per sample token_ids, the sampled token's log-prob, reason

Token ids in and out: the engine is built with `skip_tokenizer_init=True`; vLLM never tokenizes.
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

Weights: `load_weights(named_tensors)` runs `model.load_weights(named)` inside vLLM's worker (through
`collective_rpc`), which copies HF-named tensors (q/k/v and gate/up are packed by vLLM's loaders) into the
existing parameters in place, so captured CUDA graphs stay valid; then the prefix cache is reset (cached
K/V were computed with the old weights). `load_weights(None)` raises: vLLM holds its own copy.

Memory: `sleep()` aborts in-flight requests (ABORT) and, when the engine was built with
`enable_sleep_mode=True`, calls vLLM's sleep (level `sleep_level`: 1 offloads weights to CPU and drops the
KV cache; 2 drops both, so `load_weights` must follow `wake_up`); without sleep mode it only aborts.
`close()` aborts, shuts vLLM's engine core down and empties the CUDA cache. vLLM 0.26 allows one
sleep-mode engine per process (its CuMem allocator is a singleton: a second one fails its start-up with
"CuMem allocator can only be used for one instance per process").
In-process side effect: vLLM seeds the process's global RNGs with `EngineArgs.seed` (default 0) when the
engine is built; re-seed afterwards if the trainer relies on its own RNG state.

Lengths: `max_seq_len` is vLLM's `max_model_len`; a prompt of >= max_seq_len tokens returns empty LENGTH
completions without reaching vLLM; max_tokens = min(max_new_tokens, max_seq_len - P).
Seeds: a seeded request with n samples gives sample i vLLM's seed + i (vLLM's parallel-sampling rule).
`vllm` is imported only when this engine is built; without it an ImportError says how to install it.
"""

from __future__ import annotations

import gc
import json
import logging
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from relayrl.rollout.base import Completion, FinishReason, GenerationRequest
from relayrl.rollout.driver import Pending, ThreadedEngine

log = logging.getLogger(__name__)

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}

ENGINE_DEFAULTS: dict[str, Any] = dict(
    skip_tokenizer_init=True,
    generation_config="vllm",
    logprobs_mode="processed_logprobs",
    disable_log_stats=True,
)
"""vLLM `EngineArgs` this adapter sets unless the caller passes them (see the module doc)."""


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            'rollout engine "vllm" needs the vllm package (pip install vllm, on a CUDA machine); '
            'or use engine "native" (built in) or "hf"'
        ) from exc
    return vllm


def folder_eos_ids(model_dir: str) -> list[int]:
    """EOS ids from a model folder: generation_config.json, else config.json; [] when neither names one."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            ids = json.loads(path.read_text()).get("eos_token_id")
            if ids is not None:
                return [int(i) for i in ([ids] if isinstance(ids, int) else ids)]
    return []


class VLLMEngine(ThreadedEngine):
    """`RolloutEngine` over an in-process `vllm.LLMEngine` holding its own copy of the weights."""

    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        *,
        max_seq_len: int | None = None,
        eos_token_id: int | list[int] | None = None,
        sleep_level: int = 1,
        **engine_args: Any,
    ) -> None:
        """`model`: a local HF folder (or hub id); `max_seq_len`: vLLM's max_model_len; `eos_token_id`:
        stop ids for every request (default the tokenizer's EOS, else the folder's config; [] for none);
        `sleep_level`: vLLM sleep level used by `sleep()`; `engine_args` go to `vllm.EngineArgs` (e.g.
        dtype, gpu_memory_utilization, max_num_seqs, enable_sleep_mode=True, enforce_eager, seed) over
        ENGINE_DEFAULTS."""
        super().__init__(name="vllm")
        t0 = time.perf_counter()
        vllm = _import_vllm()
        if not isinstance(model, str | Path):
            raise TypeError(
                "VLLMEngine takes a model folder or hub id (str), not a loaded module; save_pretrained it first"
            )
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor import Executor

        args = {**ENGINE_DEFAULTS, "model": str(model), **engine_args}
        if max_seq_len is not None:
            args["max_model_len"] = int(max_seq_len)
        config = vllm.EngineArgs(**args).create_engine_config(UsageContext.LLM_CLASS)
        self._vllm = vllm
        self._tokens_prompt = TokensPrompt
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.llm = vllm.LLMEngine(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=False,
            multiprocess_mode=False,
        )
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
        self._live: dict[str, Pending] = {}
        self._asleep = False
        self._closing = False
        self._warned_truncation = False
        self.steps = 0
        """`LLMEngine.step()` calls made (scheduler iterations)."""
        self.startup_s = time.perf_counter() - t0
        """Seconds spent in the constructor (model load, profiling, compile, CUDA graph capture)."""

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
            output_kind=self._final_only,
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
            self.llm.add_request(rid, prompt, self._sampling_params(request))
        except Exception as exc:  # a request vLLM refuses fails alone, with vLLM's message
            pending.fail(exc)
            return
        self._live[rid] = pending

    # ---- ThreadedEngine hooks -------------------------------------------------------------------------
    def _step(self, new: list[Pending]) -> None:
        for pending in new:
            if not pending.cancelled:
                self._add(pending)
        cancelled = [rid for rid, p in self._live.items() if p.cancelled]
        if cancelled:
            self.llm.abort_request(cancelled)
            for rid in cancelled:
                del self._live[rid]
        if not self._live:
            return
        outputs = self.llm.step()
        self.steps += 1
        for out in outputs:
            if out.finished and out.request_id in self._live:
                self._live.pop(out.request_id).finish(
                    [_completion(o) for o in sorted(out.outputs, key=lambda o: o.index)]
                )

    def _busy(self) -> bool:
        return bool(self._live)

    def _abort_inflight(self) -> None:
        live, self._live = self._live, {}
        if live:
            self.llm.abort_request(list(live))
        for pending in live.values():
            pending.abort()

    def _fail_inflight(self, exc: BaseException) -> None:
        live, self._live = self._live, {}
        if live:
            try:
                self.llm.abort_request(list(live))
            except Exception:  # the engine is already broken; the callers get the first error
                log.exception("vllm engine: abort after a failed round failed too")
        for pending in live.values():
            pending.fail(exc)

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
                "the vllm engine holds its own copy of the weights: pass named tensors to load_weights"
            )
        if self._asleep and self.sleep_level >= 1:
            self.llm.wake_up()  # weights must be resident to be overwritten
            self._asleep = False
        named = [(name.removeprefix("module."), tensor) for name, tensor in named_tensors]
        self.llm.collective_rpc(_load_into_worker, args=(named,))
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            log.warning("vllm engine: prefix cache not reset after load_weights; cached K/V may be stale")

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


def _load_into_worker(worker: Any, named: list[tuple[str, torch.Tensor]]) -> int:
    """Runs inside vLLM's worker: copy HF-named tensors into the live model in place; returns how many."""
    with torch.inference_mode():  # vLLM may hold its parameters as inference tensors
        loaded = worker.model_runner.get_model().load_weights(weights=iter(named))
    return len(loaded) if loaded is not None else len(named)


def _completion(out: Any) -> Completion:
    token_ids = list(out.token_ids)
    logprobs = [float(step[t].logprob) for step, t in zip(out.logprobs or [], token_ids, strict=False)]
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=_REASONS.get(out.finish_reason, FinishReason.LENGTH),
    )
