"""`vllm` engine: an optional adapter over vLLM's async engine (shape only; untested without a GPU).

    engine = build_engine("vllm", "Qwen/Qwen2.5-0.5B-Instruct", None, gpu_memory_utilization=0.5)

Maps `GenerationRequest` to `vllm.inputs.TokensPrompt` + `vllm.SamplingParams` (n, temperature, top_p,
top_k (0 -> -1), max_tokens, stop_token_ids, seed, logprobs=0 so the sampled token's log-prob comes back)
and the final `RequestOutput` back to `GenerationResult`. Log-prob semantics: the engine is started with
`logprobs_mode="processed_logprobs"` where the installed vLLM supports it (log-probs after temperature;
vLLM documents whether top-p/top-k are applied first: check for your version); otherwise vLLM's raw
log-probs (T = 1) are returned and the trainer's off-policy correction must know it.

The total length limit is vLLM's `max_model_len` (engine option `max_seq_len`). `vllm` is imported only
when this engine is built; without it a clear ImportError says how to install it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import torch

from relayrl.rollout.base import Completion, FinishReason, GenerationRequest, GenerationResult

_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def _import_vllm():
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            'rollout engine "vllm" needs the vllm package (pip install vllm, on a CUDA machine); '
            'or use engine "native" (built in) or "hf"'
        ) from exc
    return vllm


class VLLMEngine:
    """`RolloutEngine` over `vllm.AsyncLLMEngine` (one engine per process, its own copy of the weights)."""

    def __init__(
        self, model: str, tokenizer: Any = None, *, max_seq_len: int | None = None, **engine_args: Any
    ):
        """`model`: a path or hub id; `engine_args` go to `vllm.AsyncEngineArgs` (e.g. dtype,
        gpu_memory_utilization, enable_sleep_mode=True for sleep/wake_up)."""
        vllm = _import_vllm()
        if not isinstance(model, str):
            raise TypeError(
                "VLLMEngine takes a model path or hub id (str), not a loaded module; save it first"
            )
        args = dict(model=model, tokenizer=getattr(tokenizer, "name_or_path", None) or model, **engine_args)
        if max_seq_len is not None:
            args["max_model_len"] = max_seq_len
        if "logprobs_mode" in getattr(vllm.AsyncEngineArgs, "__dataclass_fields__", {}):
            args.setdefault("logprobs_mode", "processed_logprobs")
        self._vllm = vllm
        self._engine = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(**args))

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        p = request.params
        sp = self._vllm.SamplingParams(
            n=p.n,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=p.max_new_tokens,
            stop_token_ids=list(p.stop_token_ids),
            seed=p.seed,
            logprobs=0 if p.logprobs else None,
        )
        prompt = self._vllm.inputs.TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        final = None
        async for out in self._engine.generate(prompt, sp, request.request_id or uuid.uuid4().hex):
            final = out
        completions = [_completion(o) for o in sorted(final.outputs, key=lambda o: o.index)]
        return GenerationResult(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids), completions=completions
        )

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        if named_tensors is None:
            raise ValueError(
                "the vllm engine holds its own copy of the weights: pass named tensors to load_weights"
            )
        named = list(named_tensors)

        def _load(worker) -> None:  # runs inside each vLLM worker
            worker.model_runner.model.load_weights(weights=named)

        self._engine.engine.collective_rpc(_load)

    def sleep(self) -> None:
        self._call_async(self._engine.sleep, 1)

    def wake_up(self) -> None:
        self._call_async(self._engine.wake_up)

    def close(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None)
        if shutdown is not None:
            shutdown()

    @staticmethod
    def _call_async(fn, *args) -> None:
        import asyncio
        import inspect

        res = fn(*args)
        if inspect.isawaitable(res):
            asyncio.run(res)


def _completion(out: Any) -> Completion:
    token_ids = list(out.token_ids)
    logprobs = [float(step[t].logprob) for step, t in zip(out.logprobs or [], token_ids, strict=False)]
    return Completion(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=_REASONS.get(out.finish_reason, FinishReason.LENGTH),
    )
