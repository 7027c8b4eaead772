"""The gather of an FSDP2-sharded policy's full weights (what a streamed or tensor-parallel colocated engine
refresh, and the weight canary, pull after every RL step): relayrl/distributed/fsdp.full_tensors one parameter
at a time (bucket_bytes=0, one all-gather each) against bucketed (fsdp.BUCKET_BYTES: one all-gather per
bucket), and FSDP's own per-unit gather (fsdp.unit_tensors: what the native colocated engine's refresh uses).
The colocated engine's whole refresh (relayrl.distributed.weights.local.LocalWeights.refresh: the gather plus
the copy into the engine's bf16 replica) is timed too, per unit (bucket_bytes=0, the refresh before
2026-11-27) and by default (bucketed on a CUDA mesh), after which the weight canary must read 0 and the two
replicas must be equal bit for bit. One process per GPU (torchrun):

    torchrun --standalone --nproc_per_node=2 bench/refresh_gather.py --shape qwen0.5b-char    # 2 GPUs
    torchrun --standalone --nproc_per_node=2 bench/refresh_gather.py --shape tiny --device cpu   # smoke test

Every rank builds a random fp32 Qwen2 of the shape (bench/scale.py's SHAPES) on its device and shards it
(relayrl's shard_model, bf16 compute). Per mode: one warm-up pass, then --reps timed passes (the slowest rank,
device synchronised), each pass iterating every (name, tensor) in bf16 and dropping it; the collectives of
each pass are counted; then one lockstep pass checks the bucketed tensors equal the per-parameter ones bit
for bit. JSON: $OUT/refresh_gather.json (bench/results/ without $OUT), rewritten after every mode; a
watchdog writes what was measured and exits (124) after --time-limit seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import SHAPES

from relayrl.distributed import fsdp
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model, unit_tensors
from relayrl.distributed.weights.local import LocalWeights


def _build(shape: str, device: torch.device) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    over = dict(SHAPES[shape])
    config = Qwen2Config(
        vocab_size=over.pop("vocab_size", 100), tie_word_embeddings=not shape.startswith("qwen7b"), **over
    )
    torch.manual_seed(0)
    with device:
        return Qwen2ForCausalLM._from_config(config, dtype=torch.float32)


def _pass(model: Any, mode: str, device: torch.device) -> tuple[float, int]:
    """Seconds (slowest rank) and collectives of one pass over every gathered tensor."""
    calls = [0]
    orig_gather, orig_full = fsdp._all_gather, fsdp._full_tensor

    def gather(*a: Any) -> None:
        calls[0] += 1
        orig_gather(*a)

    def full(*a: Any) -> torch.Tensor:
        calls[0] += 1
        return orig_full(*a)

    fsdp._all_gather, fsdp._full_tensor = gather, full
    try:
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "unit":
            items = unit_tensors(model)
        else:
            items = full_tensors(
                model, torch.bfloat16, bucket_bytes=0 if mode == "per_parameter" else fsdp.BUCKET_BYTES
            )
        for _, t in items:
            del t
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = torch.tensor([time.perf_counter() - t0], device=device)
    finally:
        fsdp._all_gather, fsdp._full_tensor = orig_gather, orig_full
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds), calls[0] if mode != "unit" else len(fsdp._units(model))


def _refresh_pass(lw: LocalWeights, device: torch.device) -> tuple[float, int]:
    """Seconds (slowest rank) and all-gathers of one engine refresh (gather + copy into the replica)."""
    calls = [0]
    orig_gather = fsdp._all_gather

    def gather(*a: Any) -> None:
        calls[0] += 1
        orig_gather(*a)

    fsdp._all_gather = gather
    try:
        dist.barrier()
        t0 = time.perf_counter()
        lw.refresh()  # device-synchronised
        seconds = torch.tensor([time.perf_counter() - t0], device=device)
    finally:
        fsdp._all_gather = orig_gather
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds), calls[0] if lw.bucket_bytes != 0 else len(fsdp._units(lw.source))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen0.5b-char", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--time-limit", type=float, default=200)
    args = p.parse_args()
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"shape": args.shape, "ranks": world, "device": args.device, "modes": {}}
    if args.device == "cuda":
        report["card"] = torch.cuda.get_device_name(device)

    def write() -> None:
        if rank == 0:
            (out_dir / "refresh_gather.json").write_text(json.dumps(report, indent=1))

    def watchdog() -> None:
        time.sleep(args.time_limit)
        report["timed_out"] = True
        write()
        os._exit(124)

    threading.Thread(target=watchdog, daemon=True).start()
    model = _build(args.shape, device)
    replicas = {  # the engine's bf16 replica, made before sharding as the policy worker does
        "refresh_unit": LocalWeights(model, dtype=torch.bfloat16, gather=True, bucket_bytes=0),
        "refresh_default": LocalWeights(model, dtype=torch.bfloat16, gather=True),
    }
    model = shard_model(model, ShardSpec(device=device, compute_dtype=torch.bfloat16))
    report["parameters"] = sum(1 for _ in model.parameters())
    report["bucket_bytes"] = fsdp.BUCKET_BYTES
    for mode in ("per_parameter", "bucketed", "unit"):
        _pass(model, mode, device)  # warm-up
        runs = [_pass(model, mode, device) for _ in range(args.reps)]
        report["modes"][mode] = {"seconds": [s for s, _ in runs], "min_s": min(s for s, _ in runs),
                                 "collectives": runs[0][1]}  # fmt: skip
        if rank == 0:
            print(mode, report["modes"][mode], flush=True)
        write()
    for mode, lw in replicas.items():
        with torch.no_grad():  # the shards move (as after an optimizer step): a stale replica shows
            for q in model.parameters():
                q.mul_(1.001)
        _refresh_pass(lw, device)  # warm-up
        runs = [_refresh_pass(lw, device) for _ in range(args.reps)]
        report["modes"][mode] = {"seconds": [s for s, _ in runs], "min_s": min(s for s, _ in runs),
                                 "collectives": runs[0][1], "canary": lw.max_abs_diff()}  # fmt: skip
        if rank == 0:
            print(mode, report["modes"][mode], flush=True)
        write()
    unit, default = (dict(replicas[m].model.named_parameters()) for m in ("refresh_unit", "refresh_default"))
    replicas["refresh_unit"].refresh()  # both now from the same shards
    report["refresh_bitwise_equal"] = all(torch.equal(unit[n], default[n]) for n in unit)
    write()
    a = full_tensors(model, torch.bfloat16, bucket_bytes=0)
    b = full_tensors(model, torch.bfloat16)
    report["bitwise_equal"] = all(
        na == nb and torch.equal(x, y) for (na, x), (nb, y) in zip(a, b, strict=True)
    )
    write()
    if rank == 0:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
