"""The ranks of tests/distributed/test_sharded_load.py (spawned over a real gloo group; a module of its own so
torch.multiprocessing's children can import it by name)."""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relayrl.config.components import ModelConfig
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.distributed.sharded_load import load_for_shards
from relayrl.models.empty import Built, empty_causal_lm, empty_value_model, fill_plan
from relayrl.models.forward import hf_model
from relayrl.models.loading import load_causal_lm
from relayrl.models.value_head import build_value_model

CPU = torch.device("cpu")


def init(rank: int, world: int, store_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)


def build(case: dict[str, Any], empty: bool) -> Any:
    """The case's model, the old way (whole, on the CPU) or empty; both after the same seed (value heads)."""
    cfg = ModelConfig(name_or_path=case["folder"], dtype=case.get("dtype", "fp32"))
    torch.manual_seed(123)
    if case["kind"] == "lm":
        if empty:
            built = empty_causal_lm(cfg)
            assert isinstance(built, Built), built
            return built.model
        return load_causal_lm(cfg, device=CPU)
    init_kind = case["init"]
    if empty:
        built = empty_value_model(cfg, init=init_kind, pad_token_id=0)
        assert isinstance(built, Built), built
        return built.model
    return build_value_model(cfg, init=init_kind, pad_token_id=0, device=CPU)


def snapshot(model: Any) -> dict[str, Any]:
    """Full parameters (gathered), buffers, trainability, tie and the config of a sharded model."""
    hf = hf_model(model)
    out: dict[str, Any] = {
        "params": {n: t.clone() for n, t in full_tensors(model)},
        "buffers": {n: b.clone() for n, b in hf.named_buffers()},
        "requires_grad": {n: p.requires_grad for n, p in hf.named_parameters()},
        "dtype": {n: p.dtype for n, p in hf.named_parameters()},
        "config": hf.config.to_dict(),
        "training": [m.training for m in hf.modules()],
    }
    head = getattr(hf, "lm_head", None)
    out["tied"] = head is not None and head.weight is hf.model.embed_tokens.weight
    return out


def equality_case(case: dict[str, Any]) -> dict[str, Any]:
    """The case loaded both ways and sharded: both snapshots, the bytes this rank read, both logits."""
    old = build(case, empty=False)
    shard_model(old, ShardSpec(device=CPU))
    new = build(case, empty=True)
    plan = fill_plan(hf_model(new))
    assert plan is not None
    shard_model(new, ShardSpec(device=CPU))
    assert fill_plan(hf_model(new)) is None, "the plan is dropped once filled"
    ids = torch.arange(3, 14).reshape(1, -1)
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (old, new)]
    return {"old": snapshot(old), "new": snapshot(new), "bytes_read": plan.bytes_read, "logits": logits}


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak() -> float:
    """Free what earlier loads left (garbage, the C heap's free pages), then reset the peak resident memory
    to the current one (Linux clear_refs 5); returns the current MB."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status_mb("VmRSS")


def memory_share(folder: str, sharded: bool) -> dict[str, Any]:
    """Load `folder` (fp32) for shards, new or old path, and record the peak host memory it added (MB)."""
    cfg = ModelConfig(name_or_path=folder, dtype="fp32")
    base = _reset_peak()
    if sharded:
        model = load_for_shards(
            lambda: empty_causal_lm(cfg), lambda: load_causal_lm(cfg, device=CPU), what="test"
        )
    else:
        model = load_causal_lm(cfg, device=CPU)
    plan = fill_plan(hf_model(model))
    shard_model(model, ShardSpec(device=CPU))
    grown = _status_mb("VmHWM") - base
    return {"grown_mb": grown, "bytes_read": plan.bytes_read if plan is not None else None}


def rank_main(
    rank: int, world: int, store_path: str, out: str, cases: list[dict[str, Any]], big: str
) -> None:
    """Every case loaded both ways and sharded (rank{r}.pt: both snapshots, bytes read); then `big` loaded the
    new way and the old way (mem{r}.pt: peak host memory added by each, bytes read)."""
    init(rank, world, store_path)
    try:
        results = [equality_case(case) for case in cases]
        torch.save(results, Path(out) / f"rank{rank}.pt")
        empty_causal_lm(ModelConfig(name_or_path=big))  # warm: the structure code paths run once
        mem = {"new": memory_share(big, True), "old": memory_share(big, False)}
        torch.save(mem, Path(out) / f"mem{rank}.pt")
    finally:
        dist.destroy_process_group()
