"""The ranks of tests/distributed/test_refresh_gather.py (spawned over a real gloo group; a module of its own
so torch.multiprocessing's children can import it by name)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from relayrl.config.components import LoraConfig
from relayrl.distributed import fsdp
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.distributed.weights.local import LocalWeights
from relayrl.models.loading import apply_lora
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer

CPU = torch.device("cpu")
KINDS = {"unit": 0, "default": None, "buckets": 4096, "one_bucket": 2**30}
"""LocalWeights' `bucket_bytes` per case: per FSDP unit, the default (per unit on a CPU), small buckets (several
collectives), everything in one."""


def _count_gathers() -> tuple[list[int], Any]:
    """Wrap the bucketed path's collective (fsdp._all_gather): returns (calls list, the original)."""
    calls: list[int] = []
    original = fsdp._all_gather

    def gather(out: torch.Tensor, local: torch.Tensor, group: Any) -> None:
        calls.append(out.numel())
        original(out, local, group)

    fsdp._all_gather = gather
    return calls, original


def _one(model: Any, rank: int) -> dict[str, Any]:
    """Engine replicas of each kind and dtype made before sharding, one AdamW step on the sharded model (each
    rank its own data), a refresh of each: the replicas, the gathered masters, the collectives counted."""
    replicas = {
        (kind, str(dtype)): LocalWeights(model, dtype=dtype, gather=True, bucket_bytes=size)
        for kind, size in KINDS.items()
        for dtype in (torch.float32, torch.bfloat16)
    }
    shard_model(model, ShardSpec(device=CPU))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    torch.manual_seed(rank)
    ids = torch.randint(4, 60, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    result: dict[str, Any] = {"gathers": {}, "canary": {}, "engine": {}}
    for (kind, dtype), lw in replicas.items():
        calls, original = _count_gathers()
        try:
            lw.refresh()
        finally:
            fsdp._all_gather = original
        result["gathers"][(kind, dtype)] = len(calls)
        result["canary"][(kind, dtype)] = lw.max_abs_diff()
        result["engine"][(kind, dtype)] = {n: p.detach().clone() for n, p in lw.model.named_parameters()}
    result["master"] = {n: t.clone() for n, t in full_tensors(model, bucket_bytes=0)}
    result["trained"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    result["units"] = sum(1 for m in model.modules() if isinstance(m, FSDPModule))
    return result


def build(lora: bool) -> Any:
    """The tiny Qwen2 on every rank (same seed: same weights; the tied 101-row vocabulary is uneven over 2
    ranks), with LoRA adapters (rank 4) when `lora`."""
    torch.manual_seed(0)
    model = build_tiny_model(
        build_tiny_tokenizer(), TinyModelSpec(hidden=36, layers=2, heads=2, kv_heads=1, intermediate=50)
    )
    return apply_lora(model, LoraConfig(rank=4, alpha=8)) if lora else model


def rank_main(rank: int, world: int, store_path: str, out: str) -> None:
    """Every rank: `_one` for the full model and for a LoRA one (rank{r}.pt: {"full": ..., "lora": ...})."""
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results = {case: _one(build(case == "lora"), rank) for case in ("full", "lora")}
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
