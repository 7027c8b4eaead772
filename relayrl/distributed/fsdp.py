"""FSDP2 sharding of a role's model over its process group (torch.distributed.fsdp.fully_shard).

    model = shard_model(model, ShardSpec(device=dev, compute_dtype=torch.bfloat16, offload=False))
    is_sharded(model)                    True once `shard_model` ran (the model's weights are DTensors)
    defer_sync(dist)                     reduce the gradients once per optimizer step (not under dist.offload)
    keep_gathered(dist, model, dev, p)   dist.keep_gathered resolved: the train step keeps every unit gathered
                                         from its first micro-batch to its last (relayrl.training.sharded)
    full_tensors(model)                  (name, full tensor) per parameter; on GPUs gathered in buckets of
                                         BUCKET_BYTES (one all-gather each), on CPUs one parameter at a time

Layout: every decoder layer (the classes in the transformers model's `_no_split_modules`) is one FSDP unit,
and the transformers model itself (embeddings, final norm, LM / value head, tied or not) is the root unit.
The root must be the module whose forward runs: relayrl.models.forward calls the transformers model (not its
trunk) when the model is sharded, so FSDP's hooks gather and reshard the weights around every forward and
reduce-scatter the gradients in backward. Under peft the root is the base transformers model (inside the
PeftModel), so the LoRA adapters are sharded with the layer that holds them. Every parameter is sharded along
its first dimension (FSDP2's Shard(0)), a mixture-of-experts layer's 3-D expert tensors [experts, ...] included:
each of N ranks holds experts / N whole experts (bench/moe_grpo.py records the placements).

A model built empty (relayrl.models.empty, on the meta device) is allocated and filled with this rank's rows
of the checkpoint right after sharding (relayrl.distributed.sharded_load: no rank holds the whole model).

Precision: the sharded parameters are the fp32 master weights (what AdamW updates, what checkpoints hold);
`compute_dtype` (bf16 on a GPU) is FSDP's MixedPrecisionPolicy param dtype, the weights are all-gathered in it
and gradients are reduced in fp32. On a CPU (gloo) everything stays fp32. `offload` keeps the sharded
parameters, gradients and optimizer states in CPU memory (CPUOffloadPolicy; the optimizer step runs on CPU).
`reshard_after_forward` frees the gathered weights after each layer's forward (ZeRO-3); False keeps them
for the backward (ZeRO-2-like: faster, more memory).

Gradient averaging: FSDP averages the reduced gradients over ranks; TrainStep then multiplies them by
world / (global unit count), which makes the update equal to the 1-rank update on the same global batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.config.dist import DistConfig
from relayrl.distributed.sharded_load import is_empty, materialize
from relayrl.models.forward import hf_model


@dataclass(kw_only=True, slots=True)
class ShardSpec:
    """How to shard one model."""

    device: torch.device
    """The rank's device (cuda:i or cpu)."""
    compute_dtype: torch.dtype | None = None
    """Dtype the weights are gathered and computed in (None: the stored dtype, fp32)."""
    offload: bool = False
    """Keep parameters, gradients and optimizer states on the CPU (CPUOffloadPolicy)."""
    reshard_after_forward: bool = True
    """Free gathered layer weights after each forward (ZeRO-3); False keeps them until backward."""


def defer_sync(dist: DistConfig | None) -> bool:
    """Reduce gradients once per optimizer step (faster) unless parameters are offloaded to the CPU (then
    the unsharded fp32 gradients would have to fit the GPU)."""
    return not (dist is not None and dist.offload)


KEEP_GATHERED_SHARE = 1 / 16
"""dist.keep_gathered auto: keep the gathered weights through a step when they take at most this share of
the GPU's memory."""


def keep_gathered(
    dist: DistConfig | None, model: torch.nn.Module, device: torch.device, precision: str
) -> bool:
    """dist.keep_gathered resolved for `model` on `device` (see its doc): yes / no as set; auto: yes unless
    dist.offload, on a GPU only when the whole model in the compute dtype fits KEEP_GATHERED_SHARE of it (CPU
    ranks: yes)."""
    d = dist or DistConfig()
    if d.keep_gathered != "auto":
        return d.keep_gathered == "yes"
    if d.offload:
        return False
    if device.type != "cuda":
        return True
    nbytes = sum(p.numel() for p in model.parameters()) * (2 if precision == "bf16" else 4)
    return nbytes <= torch.cuda.get_device_properties(device).total_memory * KEEP_GATHERED_SHARE


def layer_classes(hf: Any) -> set[str]:
    """Class names of the decoder layers (`_no_split_modules` of the transformers model)."""
    names: set[str] = set(getattr(hf, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(hf).__name__} does not declare its decoder layer classes (_no_split_modules): "
            "relayrl cannot shard it with FSDP2; run this role on one rank"
        )
    return names


def shard_model(model: Any, spec: ShardSpec) -> Any:
    """Shard `model` in place over the default process group (see module doc); returns `model`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    hf = hf_model(model)
    mesh = init_device_mesh(spec.device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=spec.compute_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=spec.device.type == "cuda") if spec.offload else OffloadPolicy()
    names = layer_classes(hf)
    layers = [m for m in hf.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(hf).__name__}: no module of the classes {sorted(names)} found to shard")
    kw = {"mesh": mesh, "mp_policy": mp, "offload_policy": offload}
    for layer in layers:
        fully_shard(layer, reshard_after_forward=spec.reshard_after_forward, **kw)
    fully_shard(hf, **kw)
    if is_empty(model):  # built on the meta device: allocate and fill this rank's shards (sharded_load.py)
        materialize(model, torch.device("cpu") if spec.offload else spec.device)
    return model


def is_sharded(model: Any) -> bool:
    """True when `model` (or the transformers model under its peft wrapper) was sharded by `shard_model`."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(hf_model(model), FSDPModule)


BUCKET_BYTES = 256 * 2**20
"""Bytes of full (gathered) tensors that `full_tensors` gathers in one collective: consecutive parameters'
local shards are packed into one flat buffer until their full sizes reach this (a bigger parameter goes
alone). A refresh then costs a handful of all-gathers instead of one per parameter (290 for a Qwen2.5-0.5B):
the per-collective latency, not the bytes, dominated it. Peak extra memory is about two buckets (the
gathered buffer and the tensors rebuilt from it)."""


@torch.no_grad()
def full_tensors(
    model: Any,
    dtype: torch.dtype | None = None,
    names: set[str] | None = None,
    bucket_bytes: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter (or of those in `names`), in `named_parameters` order, each
    local shard cast to `dtype` BEFORE the gather (a bf16 gather moves half the bytes of fp32) and moved to
    the mesh's device (a CPU-offloaded shard travels to the GPU: NCCL needs it).

    Consecutive sharded parameters are packed into buckets of up to `bucket_bytes` full bytes, each gathered
    by ONE all-gather over the mesh's group, then every parameter is rebuilt from the ranks' rows (Shard(0),
    uneven shards padded to the largest rank's rows for the gather and sliced back). Lazy: a bucket is
    gathered when the caller reaches its first item; extra memory stays about two buckets (the gathered
    buffer and the rebuilt tensors) if the caller drops each tensor. `bucket_bytes` None: BUCKET_BYTES on a
    CUDA mesh (NCCL's per-call latency is the cost there; not yet measured on a GPU), 0 on a CPU (gloo), where
    the per-parameter path measured faster (2 ranks, 0.5B shape: 0.86 s against 1.36 s bucketed: the packing
    copies cost more than the calls). `bucket_bytes=0` gathers one parameter at a time (DTensor.full_tensor; the reference; extra memory one parameter). Every rank must iterate the
    whole sequence with the same `names` and `bucket_bytes` (each bucket is a collective). Non-sharded
    parameters are yielded as they are (cast to `dtype`)."""
    from torch.distributed.tensor import DTensor

    pending: list[tuple[str, Any]] = []  # (name, parameter data) of the bucket being filled, in order
    size = 0
    for name, p in model.named_parameters():
        if names is not None and name not in names:
            continue
        t = p.data
        limit = _bucket_limit(t, bucket_bytes) if isinstance(t, DTensor) else 0
        if isinstance(t, DTensor) and limit > 0 and _bucketable(t):
            full = _padded_rows(t) * t.device_mesh.size() * _row_numel(t) * _itemsize(t, dtype)
            if pending and (size + full > limit or not _same_bucket(pending, t, dtype)):
                yield from _gather_bucket(pending, dtype)
                pending, size = [], 0
            pending.append((name, t))
            size += full
        elif isinstance(t, DTensor):
            yield from _gather_bucket(pending, dtype)
            pending, size = [], 0
            yield name, _full_tensor(t, dtype)
        elif pending:
            pending.append((name, t))  # yielded in its place, after the bucket's earlier items
        else:
            yield name, (t if dtype is None else t.to(dtype))
    yield from _gather_bucket(pending, dtype)


def _bucket_limit(t: Any, bucket_bytes: int | None) -> int:
    """`full_tensors`' bucket size for DTensor `t`: `bucket_bytes`, or by its mesh's device when None."""
    if bucket_bytes is not None:
        return bucket_bytes
    return BUCKET_BYTES if t.device_mesh.device_type == "cuda" else 0


def _full_tensor(t: Any, dtype: torch.dtype | None) -> torch.Tensor:
    """One DTensor's full tensor by its own all-gather (the per-parameter path)."""
    from torch.distributed.tensor import DTensor

    local = t.to_local()
    target = _mesh_device(t)
    if local.device != target or (dtype is not None and local.dtype != dtype):
        local = local.to(device=target, dtype=dtype or local.dtype)
        t = DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t.full_tensor()


def _bucketable(t: Any) -> bool:
    """A DTensor sharded along dim 0 over a 1-D mesh (what shard_model makes); others go alone."""
    from torch.distributed.tensor import Shard

    return t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.dim() >= 1


def _padded_rows(t: Any) -> int:
    """Rows of the largest rank's piece: Shard(0) splits dim 0 like torch.chunk (ceil(rows / ranks) each,
    the last ranks fewer, possibly 0)."""
    world = t.device_mesh.size()
    return -(-t.shape[0] // world)


def _rows(t: Any, rank: int) -> int:
    """Rows of dim 0 that `rank` of the mesh holds (torch.chunk's split)."""
    c = _padded_rows(t)
    return max(0, min(c, t.shape[0] - rank * c))


def _row_numel(t: Any) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def _itemsize(t: Any, dtype: torch.dtype | None) -> int:
    return torch.empty((), dtype=dtype or t.dtype).element_size()


def _same_bucket(pending: list[tuple[str, Any]], t: Any, dtype: torch.dtype | None) -> bool:
    """Whether `t` can join the bucket (same mesh, same gathered dtype as its first DTensor)."""
    from torch.distributed.tensor import DTensor

    first = next(x for _, x in pending if isinstance(x, DTensor))
    return first.device_mesh == t.device_mesh and (dtype or first.dtype) == (dtype or t.dtype)


def _gather_bucket(
    pending: list[tuple[str, Any]], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Gather a bucket with one all-gather and yield its items in order (see `full_tensors`)."""
    from torch.distributed.tensor import DTensor

    sharded = [(n, t) for n, t in pending if isinstance(t, DTensor)]
    if not sharded:
        for name, t in pending:
            yield name, (t if dtype is None else t.to(dtype))
        return
    mesh = sharded[0][1].device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    device = _mesh_device(sharded[0][1])
    out_dtype = dtype or sharded[0][1].dtype
    offsets: dict[str, int] = {}
    total = 0
    for name, t in sharded:
        offsets[name] = total
        total += _padded_rows(t) * _row_numel(t)
    flat = torch.empty(total, dtype=out_dtype, device=device)  # the padding is gathered but never read
    for name, t in sharded:
        local = t.to_local()
        rows = _rows(t, rank)
        if tuple(local.shape) != (rows, *t.shape[1:]):
            raise RuntimeError(
                f"full_tensors: rank {rank}'s shard of {name} is {tuple(local.shape)}, expected {rows} rows of "
                f"{tuple(t.shape)} (Shard(0) split like torch.chunk); gather it with bucket_bytes=0"
            )
        n = rows * _row_numel(t)
        flat[offsets[name] : offsets[name] + n].copy_(local.reshape(-1))  # the cast happens here
    gathered = torch.empty(world * total, dtype=out_dtype, device=device)
    _all_gather(gathered, flat, mesh.get_group())
    del flat
    for name, t in pending:
        if not isinstance(t, DTensor):
            yield name, (t if dtype is None else t.to(dtype))
            continue
        row = _row_numel(t)
        pieces = [
            gathered[r * total + offsets[name] : r * total + offsets[name] + _rows(t, r) * row]
            for r in range(world)
        ]
        yield name, torch.cat(pieces).view(t.shape)


def _all_gather(out: torch.Tensor, local: torch.Tensor, group: Any) -> None:
    """The bucket's one collective: `out` = the ranks' `local` buffers end to end, in group-rank order."""
    dist = torch.distributed
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer name first
    gather(out, local, group=group)


def _mesh_device(t: Any) -> torch.device:
    kind = t.device_mesh.device_type
    return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def compute_device(model: Any) -> torch.device | None:
    """Where a sharded model computes (its mesh's device: a CPU-offloaded model stores its shards on the CPU
    but gathers them on the GPU); None for a model that is not sharded."""
    for p in hf_model(model).parameters():
        if getattr(p, "device_mesh", None) is not None:
            return _mesh_device(p)
        return None
    return None


def _units(model: Any) -> list[tuple[str, Any]]:
    """(prefix, FSDP module) of every FSDP unit of the sharded model, deepest first."""
    from torch.distributed.fsdp import FSDPModule

    units = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    return sorted(units, key=lambda nm: -nm[0].count("."))


@torch.no_grad()
def unit_tensors(model: Any, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every parameter (or of those in `names`), gathered one FSDP unit (a decoder
    layer; then the root) at a time through FSDP's own all-gather (`unshard`: one collective per unit, in the
    mixed-precision param dtype, e.g. bf16), valid until the next item of another unit. Every rank must
    iterate the whole sequence with the same `names`."""
    owner: dict[str, Any] = {}
    for prefix, unit in _units(model):
        for n, _ in unit.named_parameters(prefix=prefix):
            owner.setdefault(n, unit)
    wanted = [n for n, _ in model.named_parameters() if names is None or n in names]
    by_unit: dict[int, list[str]] = {}
    units = {}
    for n in wanted:
        u = owner[n]
        by_unit.setdefault(id(u), []).append(n)
        units[id(u)] = u
    for uid, unit_names in by_unit.items():
        unit = units[uid]
        unit.unshard()
        try:
            params = dict(model.named_parameters())
            for n in unit_names:
                yield n, params[n].data
        finally:
            unit.reshard()
