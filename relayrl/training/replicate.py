"""Data parallelism without sharding (dist.replicate): every rank of a role holds the whole model, trains on its
own share of each step's micro-batches, and sums the gradients over the ranks once, after its last micro-batch.

    broadcast_params(model)        every rank: each parameter and floating buffer <- rank 0's (at build time, so
                                   randomly initialised parts such as a value head or LoRA adapters start equal)
    all_reduce_grads(params)       every rank: p.grad <- the sum over ranks of p.grad, for each parameter that has
                                   a gradient on some rank (zeros stand in where this rank has none; a parameter
                                   with no gradient anywhere keeps None, so AdamW still skips it); one all-reduce
                                   per BUCKET_BYTES of gradients of one (device, dtype)
    check_replicas(params, what)   every rank: a RuntimeError naming `what` when the ranks' weights differ (one
                                   float64 sum per rank, compared exactly; run before every checkpoint)

Why a sum and not an average: TrainStep multiplies the gradients by 1 / (global unit count), so summed
gradients give the one-rank update on the global batch. (FSDP2 averages over ranks, so there TrainStep
multiplies by world / count instead: the same update.)

Why the replicas stay identical: they start from rank 0's weights and apply the same summed gradients with
the same optimizer ops on the same kind of device, so every step keeps them bit-equal; check_replicas makes
that an error rather than an assumption whenever a checkpoint is written.

What it saves against FSDP2 (docs/benchmarks.md, 4 x H200): no per-layer all-gather or reduce-scatter, and none
of FSDP2's per-unit hooks on every micro-batch's forward and backward (14% of a 0.5B update on one rank, before
any communication); in exchange every GPU holds the whole training state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from relayrl.training.collectives import comm_device, grouped

__all__ = ["BUCKET_BYTES", "all_reduce_grads", "broadcast_params", "check_replicas"]

BUCKET_BYTES = 128 << 20
"""Gradient bytes flattened into one all-reduce (a 0.5B model's fp32 gradients: 16 all-reduces)."""


@torch.no_grad()
def broadcast_params(model: torch.nn.Module) -> None:
    """Rank 0's parameters and floating-point buffers on every rank (in place)."""
    if not grouped():
        return
    for t in [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]:
        if t.is_contiguous():
            dist.broadcast(t.data, src=0)
        else:
            tmp = t.data.contiguous()
            dist.broadcast(tmp, src=0)
            t.data.copy_(tmp)


@torch.no_grad()
def all_reduce_grads(params: Sequence[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Sum every parameter's gradient over the ranks (see module doc). Every rank passes the same parameters
    in the same order (the optimizer's)."""
    if not grouped() or not params:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=comm_device())
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p, any_rank in zip(params, has.tolist(), strict=True):
        if not any_rank:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for grads in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= bucket_bytes:
                _sum(bucket)
                bucket, size = [], 0
        if bucket:
            _sum(bucket)


def _sum(bucket: list[torch.Tensor]) -> None:
    """One all-reduce (sum) of the tensors of `bucket`, in place."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        dist.all_reduce(bucket[0])
        return
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat)
    offset = 0
    for g in bucket:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


@torch.no_grad()
def check_replicas(params: Sequence[torch.Tensor], what: str) -> None:
    """A RuntimeError on every rank when the ranks' `params` differ (a float64 sum of every weight per rank,
    gathered and compared exactly)."""
    if not grouped() or not params:
        return
    dev = comm_device()
    mine = torch.stack([p.detach().sum(dtype=torch.float64).to(dev) for p in params]).sum().reshape(1)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    sums = [float(t.item()) for t in every]
    if any(s != sums[0] for s in sums[1:]):
        raise RuntimeError(
            f"{what}: the replicated ranks' weights differ (a float64 sum of every weight per rank: {sums}); "
            "nothing was written. The replicas of dist.replicate must stay identical: resume from the last "
            "checkpoint, and report this with the run's config"
        )
