"""Sharded loading: a role of N ranks (ray mode, FSDP2) never holds its whole model on any rank. Each rank
builds the model's structure on the meta device (relayrl.models.empty: parameters on meta, buffers real),
FSDP2 shards it (`fully_shard` works on meta modules), `materialize` allocates only this rank's shards on
its device (`to_empty`; the CPU under dist.offload) and fills them by reading ONLY the rows it owns from the
checkpoint's memory-mapped safetensors files, cast to the model's dtype (fp32 master weights for trained
roles, the inference dtype for a reference) as it goes.

    model = load_for_shards(lambda: empty_causal_lm(cfg), old_path, what="policy")
                              the empty model, or (logged) the old path's full CPU model when the checkpoint
                              cannot be read in slices (models/empty.py's Unsupported cases)
    shard_model(model, spec)  (distributed/fsdp.py) shards, then calls `materialize` for an empty model

Which rows a rank owns: FSDP2 shards dim 0 of every parameter like `torch.chunk` over the mesh: with D rows
and W ranks every rank gets ceil(D / W) rows, rank r the rows [r * c, min((r + 1) * c, D)) (the last ranks
fewer or none; FSDP2 pads its own storage to equal sizes and drops the padding after every all-gather).
`materialize` reads r's rows [start, start + n) where n is the local tensor's (`DTensor.to_local()`) own
row count, and checks that layout (a Shard(0) placement on a 1-D mesh, n as the chunk rule says); anything
else raises. Per rank the host memory needed is one parameter shard at a time (at 7B the embedding's:
152064 x 3584 / 4 x 4 bytes = 545 MB), never the model; the bytes read are the rank's share of the checkpoint
(plus whole per-expert tensors of the experts it owns, for fused MoE parameters).

What stays as it was: buffers (the rotary `inv_freq` tables, computed by the model's own constructor) are
kept across `to_empty`; a tied LM head is the embedding's parameter (one entry, filled once, still tied); a
new value head is drawn on every rank with the process RNG exactly as the old path draws it (the ranks are
seeded alike), so the full state dict equals the old path's bit for bit (tests/distributed/
test_sharded_load.py). Local mode and 1-rank roles never come here (they load whole, on their device), nor do
LoRA, QLoRA, vision-language and .bin checkpoints (the old path, logged). `dist.sharded_load false` turns it
off. Resuming from a relayrl checkpoint (DCP) loads into the filled shards afterwards, as before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from relayrl.config.dist import DistConfig
from relayrl.distributed.group import sharded_role
from relayrl.models.empty import Built, FillPlan, Unsupported, fill_plan, forget_plan
from relayrl.models.forward import hf_model

log = logging.getLogger(__name__)


def wanted(dist: DistConfig | None) -> bool:
    """Whether this process loads a role's model by shards: one rank of several that shard (not
    dist.replicate), dist.sharded_load on."""
    return sharded_role(dist) and (dist is None or dist.sharded_load)


def load_for_shards(
    build: Callable[[], Built | Unsupported], old_path: Callable[[], Any], *, what: str
) -> Any:
    """The empty model `build` makes (filled after sharding), or `old_path()` (the whole model on the CPU)
    with a log line saying why, when this checkpoint cannot be read in slices."""
    built = build()
    if isinstance(built, Built):
        log.info("%s: sharded loading from %s (each rank reads its own rows)", what, built.plan.folder)
        return built.model
    log.warning(
        "%s: loading the whole model on every rank before sharding (the old path): %s", what, built.reason
    )
    return old_path()


def is_empty(model: Any) -> bool:
    """True for a model built empty that waits for `materialize`."""
    return fill_plan(hf_model(model)) is not None


@torch.no_grad()
def materialize(model: Any, device: torch.device) -> int:
    """Allocate this rank's shards of an empty, FSDP2-sharded `model` on `device` and fill them from its
    plan (module doc); buffers keep their values and devices. Returns the bytes read."""
    hf = hf_model(model)
    plan = fill_plan(hf)
    if plan is None:
        raise ValueError("materialize: the model was not built empty (relayrl.models.empty)")
    t0 = time.perf_counter()
    owners = [(m, n, b) for m in hf.modules() for n, b in m._buffers.items() if b is not None]
    hf.to_empty(device=device)
    for module, name, buf in owners:  # to_empty left uninitialised memory in the buffers
        module._buffers[name] = buf
    fill_shards(hf, plan)
    forget_plan(hf)
    log.info(
        "filled this rank's shards: %.2f GB read in %.1f s", plan.bytes_read / 1e9, time.perf_counter() - t0
    )
    return plan.bytes_read


def owned_rows(p: Any) -> tuple[int, int]:
    """(start, count) of the dim-0 rows of parameter `p` (an FSDP2 DTensor) this rank holds (module doc)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return 0, (p.shape[0] if p.dim() else 1)
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(
            f"sharded loading expects FSDP2's Shard(0) placement on a 1-D mesh, got {p.placements} on "
            f"{p.device_mesh}; set dist.sharded_load false"
        )
    rows, world, r = p.shape[0], p.device_mesh.size(), p.device_mesh.get_local_rank()
    chunk = -(-rows // world)
    start = min(r * chunk, rows)
    count = p.to_local().shape[0]
    if count != min(chunk, rows - start):
        raise ValueError(
            f"rank {r} holds {count} of {rows} rows, expected {min(chunk, rows - start)} (chunks of {chunk}): "
            "FSDP2's sharding changed; set dist.sharded_load false"
        )
    return start, count


def fill_shards(hf: Any, plan: FillPlan) -> None:
    """Copy every parameter's owned rows from the checkpoint into this rank's local shard (cast on copy)."""
    for name, p in hf.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p.data
        start, count = owned_rows(p)
        if count:
            local.copy_(plan.read(name, start, start + count).reshape(local.shape))
