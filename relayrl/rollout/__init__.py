"""Rollout engines: token ids in, token ids + log-probs out. See base.py for the protocol and its declared
capabilities, build.py for the one factory.

    engine = build_engine("native", model, tokenizer, EngineSettings(max_seq_len=1024, max_seqs=64))
    results = generate_all(engine, [GenerationRequest(prompt_ids=ids, params=SamplingParams(n=4))])

Registry (build.ENGINES, name -> class): "native" (default, built in: relayrl/rollout/native.py), "hf"
(`transformers.generate`, the reference: hf.py), "vllm" (optional adapter, needs the vllm package:
vllm_engine.py; `model` is then a path or hub id). Classes are imported when built, so importing this package
never imports vllm.
"""

from __future__ import annotations

from relayrl.rollout.base import (
    Completion,
    EngineCapabilities,
    EngineSettings,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Pausable,
    RolloutEngine,
    SamplingParams,
    WorkerLoading,
    generate_all,
    paused,
)
from relayrl.rollout.build import ENGINES, build_engine, engine_capabilities, engine_class

__all__ = [
    "ENGINES",
    "Completion",
    "EngineCapabilities",
    "EngineSettings",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "Pausable",
    "RolloutEngine",
    "SamplingParams",
    "WorkerLoading",
    "build_engine",
    "engine_capabilities",
    "engine_class",
    "generate_all",
    "paused",
]
