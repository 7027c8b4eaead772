"""Models built without their weights, plus the plan that reads each parameter's rows from the checkpoint:
the models-layer half of sharded loading (the distributed half, relayrl.distributed.sharded_load, fills
each rank's FSDP2 shards from the plan after `fully_shard`).

    built = empty_causal_lm(cfg)                      Built(model, plan) or Unsupported(reason)
    built = empty_value_model(cfg, init=..., pad_token_id=...)
    plan = fill_plan(model)                           the plan of a model built here (None otherwise)
    rows = plan.read(name, start, stop)               rows [start, stop) of parameter `name` (its dim 0), in
                                                      the checkpoint's dtype; only those bytes are read from
                                                      the memory-mapped safetensors files

The model is what `load_causal_lm` / `build_value_model` return (same class, config, dtype, attention kernel,
gradient checkpointing, MoE blocks installed), except that every PARAMETER is on the meta device: the
structure costs no memory. Buffers are real (built by the model's own constructor on the CPU: the rotary
`inv_freq` tables), so sharding code keeps them across `to_empty`.

The plan maps every parameter (`named_parameters()` of the transformers model; a tied LM head is the
embedding's parameter, so it has one entry) to where its values are:
- `Direct(key)`: the checkpoint tensor of that name (the name itself, or without / with the model's
  `base_model_prefix`, as transformers resolves a base-model checkpoint; Mixtral's `block_sparse_moe` for
  `mlp`);
- `Stacked(rows)`: a fused mixture-of-experts parameter ([E, ...], transformers 5's `experts.gate_up_proj` /
  `experts.down_proj`) whose row e is the concatenation (dim 0) of the per-expert checkpoint tensors of
  expert e (gate then up, as transformers' own Qwen2-MoE / Mixtral conversion; Mixtral's `block_sparse_moe`
  and w1 / w3 / w2 names included);
- `Given(tensor)`: a value head that is new (a causal-LM folder turned into a critic or reward model): drawn
  here, on the CPU, with the process's RNG exactly as `build_value_model` draws it (transformers' missing-key
  init, then `_init_head`), so every rank (seeded alike) holds the same head as on the old path.

Unsupported (the caller loads the whole model the old way, and logs the reason): a folder without safetensors
files (.bin), a quantized checkpoint (config.quantization_config), a Hub id that is not a local folder, LoRA / QLoRA (peft initialises adapters with the process's
RNG on real tensors), vision-language models (their checkpoints are renamed on load), persistent buffers, and
any parameter the plan cannot find in the checkpoint with the same shape (transformers would initialise or
convert it). Every check reads the safetensors headers only.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from relayrl.config.components import LoraConfig, ModelConfig
from relayrl.models import vlm
from relayrl.models.loading import finish_model, resolve_source, torch_dtype
from relayrl.models.moe import install_moe


@dataclass(frozen=True, slots=True)
class Direct:
    """The parameter is the checkpoint tensor `key` (same shape)."""

    key: str


@dataclass(frozen=True, slots=True)
class Stacked:
    """Row e of the parameter is cat(checkpoint tensors rows[e], dim 0) (fused MoE experts)."""

    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True, slots=True)
class Given:
    """The parameter's full value, made here (a new value head)."""

    tensor: torch.Tensor


Source = Direct | Stacked | Given


@dataclass(slots=True)
class FillPlan:
    """Where each parameter of an empty model is in the checkpoint (module doc)."""

    files: dict[str, Path]
    """Checkpoint tensor name -> the safetensors file holding it."""
    sources: dict[str, Source]
    """Parameter name (of the transformers model) -> its source."""
    bytes_read: int = 0
    """Bytes read from the checkpoint so far (tests, logs)."""
    folder: str = ""
    """The checkpoint folder (logs)."""

    def read(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of parameter `name` (dim 0; a 0-d parameter: the whole value), in the
        checkpoint's dtype, on the CPU. Each call maps the files it reads (once each) and unmaps them before
        it returns, so the mapped pages never add up beyond one parameter's rows."""
        from safetensors import safe_open

        src = self.sources[name]
        if isinstance(src, Given):
            return src.tensor[start:stop] if src.tensor.dim() else src.tensor
        with contextlib.ExitStack() as stack:
            handles: dict[Path, Any] = {}

            def rows_of(key: str, a: int | None = None, b: int | None = None) -> torch.Tensor:
                path = self.files[key]
                if path not in handles:
                    handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
                sl = handles[path].get_slice(key)
                t = sl[a:b] if len(sl.get_shape()) else sl[:]
                self.bytes_read += t.numel() * t.element_size()
                return t

            if isinstance(src, Direct):
                return rows_of(src.key, start, stop)
            rows = [torch.cat([rows_of(k) for k in keys]) for keys in src.rows[start:stop]]
            return torch.stack(rows) if rows else torch.empty(0)


@dataclass(frozen=True, slots=True)
class Built:
    """An empty model and its fill plan."""

    model: Any
    plan: FillPlan


@dataclass(frozen=True, slots=True)
class Unsupported:
    """Why this model cannot be built empty (the caller loads it whole)."""

    reason: str


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, FillPlan] = weakref.WeakKeyDictionary()


def fill_plan(model: torch.nn.Module) -> FillPlan | None:
    """The fill plan of a model built by this module (None for any other model, or once it was filled)."""
    return _PLANS.get(model)


def forget_plan(model: torch.nn.Module) -> None:
    """Drop the plan once the model holds its weights."""
    _PLANS.pop(model, None)


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers stay where they are made (as
    accelerate's init_empty_weights(include_buffers=False)). It patches nn.Module for its duration: build
    nothing else in another thread meanwhile."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def safetensors_files(folder: Path) -> dict[str, Path] | None:
    """Checkpoint tensor name -> file, from model.safetensors or its index; None when the folder has none."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for path in set(files.values()):
        with safe_open(str(path), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[k] = tuple(f.get_slice(k).get_shape())
    return out


_RENAMES = ((".mlp.", ".block_sparse_moe."),)
"""(model name part, checkpoint name part) that transformers renames on load (Mixtral's sparse block)."""

_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""Per-expert checkpoint names (gate, up, down): Qwen-MoE style and Mixtral style."""


def _expert_source(name: str, shape: tuple[int, ...], shapes: dict[str, tuple[int, ...]]) -> Source | None:
    """The Stacked source of a fused experts parameter (module doc), None when the checkpoint lacks it."""
    m = re.fullmatch(r"(.*)\.experts\.(gate_up_proj|down_proj)", name)
    if m is None or len(shape) != 3:
        return None
    prefix, which = m.groups()
    for owner in dict.fromkeys((prefix, prefix.replace(".mlp", ".block_sparse_moe"))):
        for gate, up, down in _EXPERT_NAMES:
            parts = (gate, up) if which == "gate_up_proj" else (down,)
            rows = tuple(tuple(f"{owner}.experts.{e}.{p}.weight" for p in parts) for e in range(shape[0]))
            keys = [k for r in rows for k in r]
            if all(k in shapes for k in keys) and all(
                sum(shapes[k][0] for k in r) == shape[1] and all(shapes[k][1:] == shape[2:] for k in r)
                for r in rows
            ):
                return Stacked(rows)
    return None


def plan_sources(
    hf: Any, shapes: dict[str, tuple[int, ...]], given: dict[str, torch.Tensor]
) -> dict[str, Source] | str:
    """Parameter name -> source for every parameter of `hf` (module doc), or why one has none."""
    prefix = getattr(hf, "base_model_prefix", "") or ""
    out: dict[str, Source] = {}
    for name, p in hf.named_parameters():
        shape = tuple(p.shape)
        if name in given:
            out[name] = Given(given[name])
            continue
        candidates = [name]
        if prefix and name.startswith(prefix + "."):
            candidates.append(name[len(prefix) + 1 :])
        elif prefix:
            candidates.append(f"{prefix}.{name}")
        candidates += [c.replace(a, b) for a, b in _RENAMES for c in candidates if a in c]
        key = next((k for k in candidates if k in shapes), None)
        if key is not None:
            if shapes[key] != shape:
                return (
                    f"{name}: the checkpoint's {key} has shape {list(shapes[key])}, the model {list(shape)}"
                )
            out[name] = Direct(key)
            continue
        stacked = _expert_source(name, shape, shapes)
        if stacked is None:
            return f"{name} (shape {list(shape)}) is not in the checkpoint under a name this loader maps"
        out[name] = stacked
    return out


def _why_not(cfg: ModelConfig, source: str) -> str | None:
    if cfg.lora.rank > 0 or cfg.load_in_4bit:
        return "LoRA / QLoRA adapters are initialised on real weights"
    if not Path(source).is_dir():
        return f"{source!r} is not a local folder"
    if vlm.is_vlm_folder(source):
        return "vision-language checkpoints are renamed on load"
    if safetensors_files(Path(source)) is None:
        return "the folder has no safetensors files (a .bin checkpoint)"
    return None


def _empty(
    auto: Any,
    cfg: ModelConfig,
    source: str,
    hf_config: Any,
    given: Callable[[Any], dict[str, torch.Tensor]],
    *,
    finish: bool = True,
) -> Built | Unsupported:
    """The shared build: model on meta params, then its plan (module doc)."""
    files = safetensors_files(Path(source))
    assert files is not None
    if getattr(hf_config, "quantization_config", None) is not None:  # e.g. fp8 weights with scales
        return Unsupported("a quantized checkpoint (config.quantization_config) is dequantized on load")
    with _params_on_meta():
        model = auto.from_config(
            hf_config,
            dtype=torch_dtype(cfg.dtype),
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
        )
    model.eval()  # as from_pretrained returns it
    persistent = [n for n, _ in model.named_buffers() if n in model.state_dict()]
    if persistent:
        return Unsupported(f"persistent buffers ({persistent[0]}, ...) are loaded from the checkpoint")
    _generation_config(model, source)
    sources = plan_sources(model, _shapes(files), given(model))
    if isinstance(sources, str):
        return Unsupported(sources)
    install_moe(model)
    plan = FillPlan(files=files, sources=sources, folder=source)
    if finish:  # gradient checkpointing (adapters were refused above)
        model = finish_model(model, cfg, task_type="CAUSAL_LM")
    _PLANS[model] = plan
    return Built(model=model, plan=plan)


def _generation_config(model: Any, source: str) -> None:
    """What from_pretrained sets beside the weights: the folder's name and generation config."""
    model.config._name_or_path = source
    if (Path(source) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(source)


def empty_causal_lm(cfg: ModelConfig, *, lora: bool = True) -> Built | Unsupported:
    """`load_causal_lm(cfg, lora=lora)` without the weights (module doc); adapters (lora and
    cfg.lora.rank > 0) are Unsupported; lora=False skips gradient checkpointing as load_causal_lm does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve_source(cfg.name_or_path)
    why = _why_not(cfg if lora else replace(cfg, lora=LoraConfig()), source)
    if why is not None:
        return Unsupported(why)
    hf_config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    return _empty(AutoModelForCausalLM, cfg, source, hf_config, lambda _: {}, finish=lora)


def empty_value_model(
    cfg: ModelConfig, *, init: str = "zeros", pad_token_id: int | None = None
) -> Built | Unsupported:
    """`build_value_model(cfg, init=..., pad_token_id=...)` without the weights (module doc): a new head is a
    Given tensor drawn as build_value_model draws it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    source = resolve_source(cfg.name_or_path)
    why = _why_not(cfg, source)
    if why is not None:
        return Unsupported(why)
    hf_config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    hf_config.num_labels = 1
    if pad_token_id is not None:
        hf_config.pad_token_id = pad_token_id
    shapes = _shapes(safetensors_files(Path(source)) or {})

    def new_head(model: Any) -> dict[str, torch.Tensor]:
        if "score.weight" in shapes:
            return {}
        return {"score.weight": draw_head(model, init)}

    return _empty(AutoModelForSequenceClassification, cfg, source, hf_config, new_head)


@torch.no_grad()
def draw_head(model: Any, init: str) -> torch.Tensor:
    """A new value head's weight [1, H] as the old path draws it: transformers' init of a missing `score`
    (its `_init_weights`), then relayrl's (value_head._init_head: zeros, or N(0, 1/(H+1)))."""
    head = model.score
    real = torch.nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
    real.weight = torch.nn.Parameter(torch.empty(real.weight.shape, dtype=head.weight.dtype))  # no RNG use
    model._init_weights(real)
    if init == "zeros":
        real.weight.zero_()
    else:
        real.weight.normal_(0.0, 1.0 / math.sqrt(head.in_features + 1))
    return real.weight.detach().clone()
