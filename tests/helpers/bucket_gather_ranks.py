"""The ranks of tests/distributed/test_bucket_gather.py (spawned over a real gloo group; a module of its own so
torch.multiprocessing's children can import it by name)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from relayrl.distributed import fsdp
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_moe_model, build_tiny_tokenizer

CPU = torch.device("cpu")


def build(kind: str) -> Any:
    """The case's model on every rank (same seed: same weights), unsharded."""
    tok = build_tiny_tokenizer()
    if kind == "qwen2":  # tied embeddings; 101-row vocab, 34 / 17 / 50 rows: uneven over 2 and 3 ranks
        return build_tiny_model(tok, TinyModelSpec(hidden=34, layers=2, heads=2, kv_heads=1, intermediate=50))
    if kind == "moe":  # 3-D expert tensors [2, ...]: over 3 ranks the last one holds 0 experts
        return build_tiny_moe_model(tok, TinyModelSpec(hidden=32, layers=2, moe="qwen3", experts=2, seed=1))
    torch.manual_seed(2)  # "mixed": sharded / plain (never sharded) / sharded modules, in that order
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Linear(3, 11))


def shard(kind: str, model: Any, world: int) -> Any:
    if kind != "mixed":
        return shard_model(model, ShardSpec(device=CPU))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    return model


class Counter:
    """Wraps the bucketed path's collective (fsdp._all_gather, bytes per call) and DTensor.full_tensor (the
    per-parameter path's collective, calls)."""

    def __init__(self) -> None:
        self.gathers: list[int] = []
        self.full_tensor = 0
        self._gather = fsdp._all_gather
        self._full = DTensor.full_tensor

    def __enter__(self) -> Counter:
        def gather(out: torch.Tensor, local: torch.Tensor, group: Any) -> None:
            self.gathers.append(out.numel() * out.element_size())
            self._gather(out, local, group)

        def full(t: Any, *a: Any, **kw: Any) -> torch.Tensor:
            self.full_tensor += 1
            return self._full(t, *a, **kw)

        fsdp._all_gather = gather
        DTensor.full_tensor = full  # pyright: ignore[reportAttributeAccessIssue]
        return self

    def __exit__(self, *exc: object) -> None:
        fsdp._all_gather = self._gather
        DTensor.full_tensor = self._full  # pyright: ignore[reportAttributeAccessIssue]


def run(model: Any, dtype: torch.dtype | None, names: set[str] | None, bucket: int | None) -> dict[str, Any]:
    with Counter() as c:
        items = [(n, t.clone()) for n, t in full_tensors(model, dtype, names, bucket_bytes=bucket)]
    return {"items": items, "gathers": c.gathers, "full_tensor": c.full_tensor}


def rank_main(rank: int, world: int, store_path: str, out: str, cases: list[dict[str, Any]]) -> None:
    """Every case: the unsharded weights, then the per-parameter (bucket 0) and bucketed gathers with their
    collectives counted (rank{r}.pt)."""
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        models: dict[str, Any] = {}
        plain: dict[str, dict[str, torch.Tensor]] = {}
        results = []
        for case in cases:
            kind = case["kind"]
            if kind not in models:
                model = build(kind)
                plain[kind] = {n: p.detach().clone() for n, p in model.named_parameters()}
                models[kind] = shard(kind, model, world)
            dtype, names, bucket = case["dtype"], case["names"], case["bucket"]
            shapes = {
                n: (tuple(p.shape), isinstance(p.data, DTensor)) for n, p in models[kind].named_parameters()
            }
            results.append(
                {
                    "plain": plain[kind],
                    "shapes": shapes,
                    "ref": run(models[kind], dtype, names, 0),
                    "new": run(models[kind], dtype, names, bucket),
                }
            )
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
