"""Rollout engines: token ids in, token ids + log-probs out. See base.py for the protocol.

    engine = build_engine("native", model, tokenizer, max_slots=64, max_seq_len=1024)
    results = generate_all(engine, [GenerationRequest(prompt_ids=ids, params=SamplingParams(n=4))])

Registry (name -> builder): "native" (default, built in: relayrl/rollout/native.py), "hf"
(`transformers.generate`, the reference: hf.py), "vllm" (optional adapter, needs the vllm package:
vllm_engine.py; `model` is then a path or hub id). Builders are imported lazily, so importing this package
never imports vllm.
"""

from __future__ import annotations

import importlib
from typing import Any

from relayrl.rollout.base import (
    Completion,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    RolloutEngine,
    SamplingParams,
    generate_all,
)

ENGINES: dict[str, str] = {
    "native": "relayrl.rollout.native:NativeEngine",
    "hf": "relayrl.rollout.hf:HFEngine",
    "vllm": "relayrl.rollout.vllm_engine:VLLMEngine",
}
"""Engine name -> "module:Class"; each class takes (model, tokenizer=None, **opts)."""


def build_engine(name: str, model: Any, tokenizer: Any = None, **opts: Any) -> RolloutEngine:
    """Build the engine registered as `name` ("native" | "hf" | "vllm") over `model`.

    `opts` go to the engine's constructor (e.g. native: max_slots, max_seq_len, cuda_graphs).
    """
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; choose one of {sorted(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return getattr(importlib.import_module(module), cls)(model, tokenizer, **opts)


__all__ = [
    "ENGINES",
    "Completion",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "RolloutEngine",
    "SamplingParams",
    "build_engine",
    "generate_all",
]
