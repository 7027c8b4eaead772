"""Process bodies of the vocabulary-parallel sampler kernel tests (tests/rollout/test_vocab_parallel_kernel*.py):
spawned over a real gloo group (CPU, Triton's interpreter) or an NCCL group (one GPU a rank); importable by name
in the children."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from relayrl.rollout.sampling import uniform
from relayrl.rollout.vocab_parallel import sample_split, vocab_bounds

BOUNDARY = 1e-5
"""A token that differs from a reference's must have a fp64 CDF boundary within this of u (in units of the
total mass): test_sampling_fast.py's bound for the TP = 1 kernel."""

GLOO_CASE = (32, 12_003)
"""(rows, vocabulary) of the gloo test: at TP 4 each slice is one 3001-entry block, at TP 2 two blocks."""


def case(b: int, v: int, seed: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """(logits [b, v], temperature [b] with every 7th row greedy, u [b]): flat to peaked rows."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(b, 1, generator=gen) * 6 + 0.5
    logits = (torch.randn(b, v, generator=gen) * scale).to(dtype)
    temp = torch.rand(b, generator=gen) * 1.4 + 0.2
    temp[::7] = 0.0
    u = uniform(torch.arange(b, dtype=torch.long) * 7919 + seed, torch.full((b,), 11))
    return logits.to(device), temp.to(device), u.to(device)


def boundary_rows(logits, temp, u, tok, ref_tok) -> tuple[int, list[float]]:
    """(rows whose tokens differ, the largest |fp64 CDF - u| over the boundaries between each pair)."""
    diff = (tok != ref_tok).nonzero().flatten().tolist()
    gaps = []
    for r in diff:
        t = float(temp[r]) if temp[r] > 0 else 1.0
        cdf = torch.softmax(logits[r].double() / t, -1).cumsum(-1)
        lo, hi = sorted((int(tok[r]), int(ref_tok[r])))
        gaps.append(float((cdf[lo:hi] - float(u[r])).abs().max()))
    return len(diff), gaps


def both_paths(logits, temp, u, rank: int, world: int, group: Any) -> dict:
    """{mode: {"kernel" | "torch": (token, logprob)}} of this rank's slice, the sum through dist.all_reduce."""
    bounds = vocab_bounds(logits.shape[1], world)
    lo, hi = bounds[rank], bounds[rank + 1]

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    res: dict = {}
    for mode, t in (("sample", temp), ("greedy", torch.zeros_like(temp))):
        res[mode] = {
            name: sample_split(logits[:, lo:hi], t, u, mode == "greedy", lo=lo, rank=rank, size=world,
                               reduce=reduce, fast=fast)  # fmt: skip
            for name, fast in (("kernel", True), ("torch", False))
        }
    return res


def gloo_worker(rank: int, world: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        logits, temp, u = case(*GLOO_CASE, seed=world)
        torch.save(both_paths(logits, temp, u, rank, world, dist.group.WORLD), f"{out}.{rank}")
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    finally:
        dist.destroy_process_group()
