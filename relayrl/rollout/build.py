"""The one engine factory: every engine of relayrl (RL workers, generate, serve, demo, tests, benches) is built
here, by its registered name.

    engine = build_engine("native", model, tokenizer, EngineSettings(max_seq_len=1024, max_seqs=64))
    engine = build_engine("hf", model, tokenizer, max_seq_len=256)      raw options of the engine's constructor
    engine_capabilities("vllm").own_weights                            True: build it from a folder, not a module

ENGINES maps a name to "module:Class"; the class is imported when it is built or asked for its capabilities
(the vllm adapter imports vllm only in its constructor, so no name here imports vllm). Each class declares
`capabilities` (rollout/base.py EngineCapabilities) and maps the shared `EngineSettings` to its own constructor
keywords (`Class.options(settings)`: native slots, vllm memory share / executor / sleep mode, ...); keywords
given to `build_engine` directly win over the mapped ones. `model` is a torch module, or for an engine with
`own_weights` (vllm) the folder or hub id it loads itself.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

from relayrl.rollout.base import EngineCapabilities, EngineClass, EngineSettings, RolloutEngine
from relayrl.rollout.media import vision_token_ids

ENGINES: dict[str, str] = {
    "native": "relayrl.rollout.native:NativeEngine",
    "hf": "relayrl.rollout.hf:HFEngine",
    "vllm": "relayrl.rollout.vllm_engine:VLLMEngine",
}
"""Engine name -> "module:Class"; each class takes (model, tokenizer=None, **opts) and has `capabilities` and
`options(settings)`."""

TP_ENGINES: dict[str, str] = {"native": "relayrl.rollout.native_tp:TPNativeEngine"}
"""Engine name -> the "module:Class" of its tensor-parallel variant over one shard per process of a group
(`build_engine(name, shard, ..., group=tp_group)`; rollout/native_tp.py)."""


def engine_class(name: str) -> EngineClass:
    """The class registered as `name`; a ValueError listing the names when there is none."""
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; choose one of {sorted(ENGINES)}")
    module, cls = ENGINES[name].split(":")
    return cast(EngineClass, getattr(importlib.import_module(module), cls))


def engine_capabilities(name: str) -> EngineCapabilities:
    """What the engine registered as `name` declares (before building it)."""
    return engine_class(name).capabilities


def build_engine(
    name: str, model: Any, tokenizer: Any = None, settings: EngineSettings | None = None, **opts: Any
) -> RolloutEngine:
    """The engine registered as `name` ("native" | "hf" | "vllm") over `model` (a module; a folder for an
    engine with own_weights), built from `settings` (mapped by the class) and `opts` (its constructor's own
    keywords, e.g. native: max_slots, cuda_graphs; they win over the mapped ones). `group=` a TP process group:
    the engine's tensor-parallel variant (TP_ENGINES) over `model`, this rank's shard."""
    cls = engine_class(name)
    if name == "native" and vision_token_ids(model):
        raise ValueError(
            "rollout.engine native does not run vision-language models (no image encoder, no 3-D rope "
            "positions; docs/vlm.md says what it would take): use --rollout.engine hf (CPU or GPU) or vllm (GPU)"
        )
    if opts.get("group") is not None:
        if name not in TP_ENGINES:
            raise ValueError(f"rollout engine {name!r} has no process-group tensor parallelism; use native")
        module, cls_name = TP_ENGINES[name].split(":")
        cls = cast(EngineClass, getattr(importlib.import_module(module), cls_name))
    else:
        opts.pop("group", None)
    mapped = cls.options(settings) if settings is not None else {}
    return cls(model, tokenizer, **{**mapped, **opts})
