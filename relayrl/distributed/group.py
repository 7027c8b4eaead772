"""One role's process group and each rank's share of the work (data parallelism).

A trainable role (policy, critic) or a sharded frozen one (reference) runs as N processes, one per GPU (or CPU
process), that form ONE torch.distributed process group (NCCL on GPU, gloo on CPU). Ray starts the processes
(relayrl.distributed.launch); this module only joins them and splits work among them.

    join_group(GroupSpec(rank=r, world=n, addr=..., port=..., backend="gloo", timeout_s=600))
    rank(), world()                          0 and 1 outside a group (local mode): the same code runs there
    sharded_role(dist) / replicated_role(dist)  one rank of several with FSDP2 shards / with the whole model
                                             (dist.replicate)
    shares(weights, world)                   contiguous, balanced split of items into `world` ranges
    my_share(weights)                        this rank's range of `shares`
    my_data_share(weights)                   this rank's data-parallel range: under sequence parallelism the
                                             W ranks of an SP group share one range (relayrl.distributed.
                                             sequence_parallel), so ranks // W ranges
    reports()                                False on an SP group's ranks after its first (their results
                                             repeat the first's: "concat" merges leave them out)
(the small all-reduces of a step -- equal pass counts, global metric sums -- live in relayrl/training/step.py,
which talks to torch.distributed directly)

Why contiguous shares: results come back in rank order, so concatenating them restores the input order (the
n samples of a prompt stay contiguous, as the group advantage estimators expect). Shares are balanced by a
weight per item (expected tokens), every rank gets at least one item when there are at least `world` items,
and every rank computes the same split from the same inputs, so no coordination is needed.

Collective timeouts: `timeout_s` bounds every collective, so a rank that died makes the others raise within
that time instead of hanging (the launcher then names the role, rank and host).
"""

from __future__ import annotations

import datetime
import os
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, pairwise
from typing import Any

import torch
import torch.distributed as dist

from relayrl.models import sequence_parallel
from relayrl.training.collectives import grouped


@dataclass(kw_only=True, slots=True)
class GroupSpec:
    """Where this process sits in its role's process group."""

    rank: int
    """This process's rank in [0, world)."""
    world: int
    """Number of processes of the role."""
    addr: str
    """Rank 0's host (the rendezvous address)."""
    port: int
    """A free TCP port on rank 0's host."""
    backend: str = "gloo"
    """gloo (CPU) or nccl (GPU)."""
    timeout_s: float = 600.0
    """Bound on every collective: a dead peer makes the others fail within this time, never hang."""


def join_group(spec: GroupSpec) -> None:
    """Initialise torch.distributed for this process (no-op for a 1-process role)."""
    if spec.world <= 1 or dist.is_initialized():
        return
    if spec.backend == "nccl":
        torch.cuda.set_device(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    # NCCL for CUDA tensors plus gloo for CPU ones (CPU-offloaded shards reduce their gradient norm on the CPU)
    backend = "cpu:gloo,cuda:nccl" if spec.backend == "nccl" else spec.backend
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{spec.addr}:{spec.port}",
        rank=spec.rank,
        world_size=spec.world,
        timeout=datetime.timedelta(seconds=spec.timeout_s),
    )


def leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def in_group() -> bool:
    """True when this process is one rank of a multi-process group (relayrl.training.collectives.grouped, the
    one home of the test)."""
    return grouped()


def sharded_role(config: Any) -> bool:
    """Whether this rank's role model is FSDP2-sharded: one rank of several, `config` (the DistConfig, or
    None) without dist.replicate."""
    return in_group() and not (config is not None and config.replicate)


def replicated_role(config: Any) -> bool:
    """Whether this rank holds its role's whole model beside the other ranks' copies (dist.replicate)."""
    return in_group() and not sharded_role(config)


def rank() -> int:
    return dist.get_rank() if in_group() else 0


def world() -> int:
    return dist.get_world_size() if in_group() else 1


def shares(weights: Sequence[float], parts: int) -> list[range]:
    """Split items 0..len-1 into `parts` contiguous ranges of nearly equal total weight.

    Every range is non-empty when len(weights) >= parts (trailing ones are empty otherwise). Deterministic.
    """
    n = len(weights)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    prefix = list(accumulate(max(0.0, float(w)) for w in weights))
    total = prefix[-1] if prefix else 0.0
    bounds = [0]
    for k in range(1, parts):
        if n >= parts:
            lo, hi = bounds[-1] + 1, n - (parts - k)  # leave >= 1 item for each later rank
        else:
            lo = hi = min(k, n)
        if total > 0:
            target = total * k / parts
            cut = bisect_left(prefix, target) + 1  # includes the item that crosses the target ...
            before = prefix[cut - 2] if cut >= 2 else 0.0
            if cut > 1 and target - before < prefix[min(cut, n) - 1] - target:
                cut -= 1  # ... unless leaving it out lands nearer
        else:
            cut = round(n * k / parts)
        bounds.append(min(max(cut, lo), hi))
    bounds.append(n)
    return [range(a, b) for a, b in pairwise(bounds)]


def my_share(weights: Sequence[float]) -> range:
    """This rank's range of `shares(weights, world())`."""
    return shares(weights, world())[rank()]


def my_data_share(weights: Sequence[float]) -> range:
    """This rank's data-parallel range: `shares(weights, world() // W)[rank() // W]`, W the sequence-parallel
    group size (1 without sequence parallelism: `my_share`)."""
    w = sequence_parallel.size()
    return shares(weights, world() // w)[rank() // w]


def reports() -> bool:
    """Whether this rank's share of a "concat" result is its own: False on the ranks of a sequence-parallel
    group after its first, whose results repeat the first's (they return an empty piece)."""
    return sequence_parallel.is_leader()


MERGE_ATTR = "__relayrl_merge__"


def merged(how: str):
    """Declare how the per-rank results of a worker method combine into the caller's one result:

    "first"  rank 0's result (the default for undecorated methods: metrics that are already global,
             facts, None)
    "concat" the ranks' results in rank order: lists are concatenated, tensors joined along dim 0
    "max"    the maximum (e.g. the weight canary)
    """
    if how not in MERGES:
        raise ValueError(f"merge must be one of {sorted(MERGES)}, got {how!r}")

    def mark(fn):
        setattr(fn, MERGE_ATTR, how)
        return fn

    return mark


def _concat(results: list) -> object:
    if isinstance(results[0], torch.Tensor):
        return torch.cat(results, 0)
    return [x for r in results for x in r]


MERGES = {"first": lambda rs: rs[0], "concat": _concat, "max": max}


def merge_results(cls: type, method: str, results: list) -> object:
    """Combine the ranks' results of `cls.method` as its `merged` declaration says."""
    how = getattr(getattr(cls, method, None), MERGE_ATTR, "first")
    return MERGES[how](results)
