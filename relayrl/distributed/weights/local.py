"""The local transport (base.py): the rollout engine's weights beside a trainer's, in the same process.

    lw = LocalWeights(policy, dtype=torch.bfloat16)    lw.model: what the engine runs on
    ...optimizer step on `policy`...
    seconds = lw.load_into(engine, version=step)       rounds paused; on-device cast-copy into the engine's
                                                       buffers (`refresh`); engine.load_weights(
                                                       lw.engine_tensors(), version=step)
    lw.max_abs_diff()                                  the weight canary: 0 when the engine matches the
                                                       trainer's weights cast to the engine dtype

The cases, decided once at construction:
- shared (dtype and device equal, e.g. fp32 on a CPU): the engine runs on the policy module itself; refresh
  is a no-op (nothing to copy; the engine reads the parameters in place).
- copy (mixed precision on a GPU: fp32 master weights, bf16 engine): `model` is a structural copy of the
  policy (LoRA adapters included) whose parameters are held in `dtype`; buffers (e.g. rotary inv_freq) keep
  their dtype. `refresh` copies every parameter with `Tensor.copy_` (a cast on the device, no host round
  trip, no serialisation, storage addresses unchanged, so CUDA graphs captured over them stay valid).
- gather (the trainer is sharded with FSDP2 over its ranks, relayrl.distributed.fsdp): `model` is a full
  replica made BEFORE the trainer is sharded (so every rank's engine holds the whole model in `dtype`);
  `refresh` gathers the shards and copies each parameter into the replica's buffer, on the device, every
  rank at once (a collective: all ranks call `refresh` and `max_abs_diff` together). On a CUDA mesh the
  shards are cast to `dtype` and gathered in buckets (`fsdp.full_tensors`, BUCKET_BYTES each: 3 all-gathers
  for a Qwen2.5-0.5B, 0.024 s on 2 H200s, against 25 per-unit all-gathers, 0.044-0.066 s,
  bench/refresh_gather.py; extra memory about two buckets or two of the largest parameter); on a CPU (gloo)
  one FSDP unit (decoder layer) at a time with FSDP's own all-gather in the mixed-precision param dtype
  (`fsdp.unit_tensors`: fewer packing copies, which cost more than gloo's calls there). `bucket_bytes`
  chooses explicitly (0: per unit). Both give the same bits: the fp32 shard cast to `dtype` (the unit path
  gathers in the param dtype, which equals `dtype` on a GPU and fp32 on a CPU, then casts in `copy_`).
- stream (`stream=True`: the engine holds its own weights, vllm): nothing is copied here and no memory is
  spent; `model` is the source module itself (the vllm builder ignores it) and `refresh` is a no-op.
  `engine_tensors()` yields (HF name, tensor in `dtype`) of the trainer's CURRENT weights, lazily, for
  `engine.load_weights`: every parameter as `named_parameters()` names it (tied weights once: the tied
  lm_head is skipped, vLLM's loaders tie it back); a LoRA model's adapters merged into the base weights
  (W + scale * B @ A in fp32, by peft's own `get_delta_weight`, names without peft's prefixes); a sharded
  source (gather) as full tensors, all-gathered in buckets (`fsdp.full_tensors`, a collective per bucket:
  every rank iterates the whole sequence). Not supported (ValueError at construction): a LoRA model that is
  also sharded, a 4-bit (QLoRA) base, and adapter variants such as DoRA.
Only parameters that train (requires_grad) are refreshed, or streamed (non-LoRA): frozen ones (a LoRA run's
base weights, a VLM's frozen vision tower) were copied (or loaded by the engine) at construction and never
change.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from relayrl.distributed.fsdp import compute_device, full_tensors, unit_tensors
from relayrl.models.forward import hf_model
from relayrl.rollout.base import RolloutEngine, paused
from relayrl.rollout.native_tp import real_rotary


class LocalWeights:
    """The engine-side weights of a trained module, in the trainer's process (a `WeightSource`, base.py; see
    the module doc)."""

    def __init__(
        self,
        source: torch.nn.Module,
        *,
        dtype: torch.dtype,
        gather: bool = False,
        device: torch.device | None = None,
        own_copy: bool = False,
        stream: bool = False,
        bucket_bytes: int | None = None,
    ) -> None:
        """`own_copy`: hold a copy even when dtype and device match (async training: the engine must not see
        optimizer steps until `refresh`); `stream`: the engine holds its own weights (vllm), see
        `engine_tensors`; `bucket_bytes` (gather): how `refresh` gathers the shards, None: by the mesh's
        device (module doc), 0: one FSDP unit at a time, > 0: buckets of that many full bytes."""
        self.source = source
        self.dtype = dtype
        self.gather = gather
        self.bucket_bytes = bucket_bytes
        self.stream = stream
        self.trained = {n for n, p in source.named_parameters() if p.requires_grad}
        if stream:
            self._lora = _check_streamable(source, gather)
            self.shared = False
            self.model = source  # no copy: the engine loads its own weights, then takes `engine_tensors()`
            return
        params = list(source.parameters())
        same_device = device is None or all(p.device == torch.device(device) for p in params)
        self.shared = not gather and not own_copy and same_device and all(p.dtype == dtype for p in params)
        if self.shared:
            self.model = source
            return
        # the structure is deep-copied, each parameter is made directly in `dtype` on `device` (memo): no
        # second full-precision copy of the model ever exists. A source on the meta device (a policy
        # initialised after FSDP sharded it) gives zeros until the first `refresh`.
        memo: dict[int, object] = {
            id(p): torch.nn.Parameter(
                torch.zeros(p.shape, dtype=dtype, device=device)
                if p.is_meta
                else p.detach().to(device=device or p.device, dtype=dtype, copy=True),
                requires_grad=False,
            )
            for p in params
        }
        self.model = copy.deepcopy(source, memo)
        self.model.eval()
        if any(p.is_meta for p in params):
            real_rotary(self.model, device)
        if device is not None:
            self.model.to(device)  # buffers (rotary tables) too

    def _targets(self) -> dict[str, torch.Tensor]:
        """The engine copy's parameters, read now: an engine may re-lay them out after construction (fused
        projections, rollout/native_fused.py), so their storage is never cached here."""
        return {n: p.data for n, p in self.model.named_parameters()}

    @property
    def kind(self) -> str:
        """How the engine gets the weights: shared, copy, gathered (a full replica of a sharded trainer) or
        streamed (module doc)."""
        if self.stream:
            return "streamed"
        return "shared" if self.shared else ("gathered" if self.gather else "copy")

    @torch.no_grad()
    def refresh(self) -> float:
        """Copy (cast) the trainer's current weights into the engine's; returns the seconds it took (device
        synchronised, so the number is the real cost). 0 when shared or streamed (nothing is copied here)."""
        if self.shared or self.stream:
            return 0.0
        t0 = time.perf_counter()
        targets = self._targets()
        if self.gather:
            for name, full in self._gathered():
                targets[name].copy_(full)
        else:
            src = dict(self.source.named_parameters())
            for name in self.trained:
                targets[name].copy_(src[name].data)
        first = next(iter(targets.values()), None)
        if first is not None and first.is_cuda:
            torch.cuda.synchronize(first.device)
        return time.perf_counter() - t0

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of the trained parameters of the sharded source, as `refresh` gathers them
        (module doc: buckets on a CUDA mesh, one FSDP unit at a time on a CPU, or as `bucket_bytes` says)."""
        size = self.bucket_bytes
        if size is None:
            device = compute_device(self.source)
            size = 0 if device is None or device.type != "cuda" else None  # None: full_tensors' CUDA buckets
        if size == 0:
            return unit_tensors(self.source, self.trained)
        return full_tensors(self.source, self.dtype, self.trained, bucket_bytes=size)

    def engine_tensors(self) -> Iterator[tuple[str, torch.Tensor]] | None:
        """What `engine.load_weights` gets after `refresh`: None (the engine's module was updated in place),
        or, streamed, a lazy iterator of (HF name, tensor in `dtype`) of the current weights (module doc);
        consume it once, at once (the tensors may alias the trainer's parameters)."""
        if not self.stream:
            return None
        if self.gather:
            return full_tensors(self.source, self.dtype)
        if self._lora:
            return _merged_lora(self.source, self.dtype)
        params = self.source.named_parameters()  # trained ones only (a frozen vision tower never changes)
        return ((n, p.detach().to(self.dtype)) for n, p in params if n in self.trained)

    def load_into(
        self, engine: RolloutEngine, version: int | None, before_load: Callable[[], None] | None = None
    ) -> float:
        """The same-process load: with the engine's rounds paused, `refresh`, then `before_load` (e.g. wake a
        sleeping engine), then engine.load_weights(engine_tensors(), version=version); requests in flight go
        on under the new weights. Returns `refresh`'s seconds."""
        with paused(engine):
            seconds = self.refresh()
            if before_load is not None:
                before_load()
            engine.load_weights(self.engine_tensors(), version=version)
        return seconds

    @torch.no_grad()
    def max_abs_diff(self) -> float:
        """max |engine weight - trainer weight cast to the engine dtype| over every parameter (0 = in sync).
        Streamed: 0.0, nothing to compare here (the engine's copy lives inside the engine; it equals
        `engine_tensors()` after each `load_weights`)."""
        if self.shared or self.stream:
            return 0.0
        targets = self._targets()
        if self.gather:
            pairs = ((full, targets[n]) for n, full in full_tensors(self.source, self.dtype))
        else:
            src = dict(self.source.named_parameters())
            pairs = ((src[n].data, d) for n, d in targets.items())
        return max((float((d - s.to(d.dtype)).abs().max()) for s, d in pairs), default=0.0)


def _check_streamable(source: torch.nn.Module, gather: bool) -> bool:
    """Raise a ValueError when `engine_tensors` cannot give the engine full HF weights; True for a LoRA model
    (its adapters are merged on the fly)."""
    hf = hf_model(source)
    if getattr(hf, "is_loaded_in_4bit", False) or getattr(hf, "hf_quantizer", None) is not None:
        raise ValueError(
            "rollout.engine vllm with model.load_in_4bit (QLoRA) is not supported: vLLM needs full-precision "
            "weights; train with load_in_4bit false or use rollout.engine native"
        )
    lora = hf is not source
    if lora and gather:
        raise ValueError(
            "rollout.engine vllm with model.lora.rank > 0 and the policy sharded over several ranks is not "
            "supported: merge the adapters (relayrl merge-lora), run the policy on one rank, or use "
            "rollout.engine native"
        )
    for name, layer in _lora_layers(hf).items():
        variants = getattr(layer, "lora_variant", None) or {}
        for a in layer.active_adapters:
            if a in variants:
                raise ValueError(
                    f"rollout.engine vllm: LoRA layer {name} uses the adapter variant "
                    f"{type(variants[a]).__name__} (e.g. DoRA), which relayrl does not merge for vLLM; use "
                    "plain LoRA or rollout.engine native"
                )
    return lora


def _lora_layers(hf: torch.nn.Module) -> dict[str, Any]:
    """Module name -> peft LoRA layer (empty without peft adapters)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    return {n: m for n, m in hf.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def _merged_lora(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, merged weight in `dtype`) of a peft LoRA model: W + sum of the active adapters' deltas
    (peft's `get_delta_weight`: scale * B @ A, transposed for fan_in_fan_out), added in fp32; the adapter
    parameters themselves are not yielded and ".base_layer" is dropped from the names."""
    hf = hf_model(model)
    layers = _lora_layers(hf)
    for name, p in hf.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        if not owner.endswith(".base_layer"):
            yield name, p.detach().to(dtype)
            continue
        base = owner.removesuffix(".base_layer")
        layer = layers[base]
        t = p.detach()
        if leaf == "weight" and not layer.merged and not layer.disable_adapters:
            t = t.float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A or adapter in getattr(layer, "lora_embedding_A", {}):
                    t = t + layer.get_delta_weight(adapter).float()
        yield f"{base}.{leaf}", t.to(dtype)
