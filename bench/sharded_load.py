"""Start-up of a sharded role: the policy's model loaded and FSDP2-sharded over N ranks, the old path (every
rank loads the whole model in fp32 on its CPU, then shards) against sharded loading (every rank builds the
model empty and reads only its own rows: relayrl/distributed/sharded_load.py). One process per GPU (torchrun):

    torchrun --standalone --nproc_per_node=4 bench/sharded_load.py --shape qwen2.5-7b          # 4 GPUs
    torchrun --standalone --nproc_per_node=2 bench/sharded_load.py --shape tiny --device cpu   # smoke test

Rank 0 first writes a random bf16 Qwen2 folder of the shape (safetensors files of <= 4 GB with an index, as
the Hub ships them; weights drawn on the GPU when there is one) unless --folder already holds one. Then, per
mode (--modes, default new first, then old), every rank runs the product's own construction
(workers/builders.build_trainable(..., sharded=...) then distributed/fsdp.shard_model, fp32 master shards on
its device, bf16 compute) and records: seconds (the slowest rank), peak host memory the load added per rank
(Linux VmHWM, reset before), GPU memory allocated after, bytes read (new path), and a checksum of every local
shard (float64 sum; the two modes must agree exactly: same rows, same fp32 values). Both modes read the
folder from the page cache (it was just written), so the numbers compare the loading work, not the disk.

JSON: $OUT/sharded_load.json (bench/results/ without $OUT), rewritten after every mode; a watchdog writes what
was measured and exits (124) after --time-limit seconds.
"""

from __future__ import annotations

import os
import sys

if "--device" not in sys.argv or sys.argv[sys.argv.index("--device") + 1] == "cuda":  # one GPU per rank
    _local = int(os.environ.get("LOCAL_RANK", "0"))
    _visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    os.environ["CUDA_VISIBLE_DEVICES"] = _visible[_local] if _visible else str(_local)

import argparse
import ctypes
import datetime
import gc
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.config.components import ModelConfig
from relayrl.distributed.fsdp import ShardSpec, shard_model
from relayrl.models.empty import fill_plan
from relayrl.models.forward import hf_model
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.workers.builders import build_trainable

SHAPES: dict[str, dict[str, int]] = {
    "qwen2.5-32b": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        intermediate_size=27648, vocab_size=152064),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=128, vocab_size=512),
}  # fmt: skip
GB = 1e9
FILE_BYTES = 4 * 10**9


def write_folder(args: argparse.Namespace, folder: Path, device: torch.device) -> dict[str, Any]:
    """A random bf16 Qwen2 of the shape in safetensors files of <= 4 GB plus an index (module doc)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    t0 = time.perf_counter()
    tok = build_tiny_tokenizer()
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    config = Qwen2Config(**shape, max_position_embeddings=4096, tie_word_embeddings=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)  # fmt: skip
    with torch.device("meta"):
        meta = Qwen2ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map: dict[str, str] = {}
    part: dict[str, torch.Tensor] = {}
    size, files = 0, 0

    def flush() -> None:
        nonlocal part, size, files
        files += 1
        name = f"model-{files:05d}.safetensors"
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        part, size = {}, 0

    for name, p in meta.named_parameters():
        t = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
        part[name] = t.to(torch.bfloat16).cpu()
        size += part[name].numel() * 2
        if size >= FILE_BYTES:
            flush()
    if part:
        flush()
    index = {
        "metadata": {"total_size": sum(p.numel() * 2 for p in meta.parameters())},
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    return {
        "write_s": time.perf_counter() - t0,
        "files": files,
        "params_b": index["metadata"]["total_size"] / 2e9,
    }


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> float:
    """Free what earlier loads left, reset the peak RSS (Linux clear_refs 5); the RSS now (MB). Where the
    reset is refused the peak is since the process started (the numbers say so: reset_ok false)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
        RESET_OK[0] = True
    except OSError:
        RESET_OK[0] = False
    return _status_mb("VmRSS")


RESET_OK = [False]


def gathered(value: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def load_once(folder: Path, mode: str, device: torch.device) -> dict[str, Any]:
    """One start-up: build_trainable (old or sharded) + shard_model; this rank's numbers, then gathered."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = _reset_peak()
    t0 = time.perf_counter()
    cfg = ModelConfig(name_or_path=str(folder), dtype="fp32")
    model, _ = build_trainable(cfg, torch.device("cpu"), sharded=mode == "new")
    plan = fill_plan(hf_model(model))
    t_load = time.perf_counter() - t0
    compute = torch.bfloat16 if device.type == "cuda" else None
    shard_model(model, ShardSpec(device=device, compute_dtype=compute))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    sums = [float(p.detach().to_local().double().sum()) for _, p in model.named_parameters()]
    mine = {
        "seconds": seconds,
        "before_shard_s": t_load,
        "host_peak_added_gb": (_status_mb("VmHWM") - base) * 2**20 / GB,
        "gpu_allocated_gb": torch.cuda.memory_allocated(device) / GB if device.type == "cuda" else 0.0,
        "gpu_peak_gb": torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else 0.0,
        "bytes_read_gb": plan.bytes_read / GB if plan is not None else None,
        "reset_ok": RESET_OK[0],
    }
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ranks = gathered(mine)
    return {
        "mode": mode,
        "seconds": max(r["seconds"] for r in ranks),
        "host_peak_added_gb_max": max(r["host_peak_added_gb"] for r in ranks),
        "per_rank": ranks,
        "checksums": gathered(sums),
    }


def write(report: dict) -> None:
    if dist.get_rank() != 0:
        return
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sharded_load.json").write_text(json.dumps(report, indent=2, default=str))


def watchdog(seconds: float, report: dict) -> None:
    def fire() -> None:
        report["timed_out_after_s"] = seconds
        write(json.loads(json.dumps(report, default=str)))
        print(f"sharded_load: time limit {seconds:.0f} s reached; partial results written", flush=True)
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    ap.add_argument("--folder", default="", help="model folder (written when it holds no config.json)")
    ap.add_argument("--modes", nargs="+", choices=("new", "old"), default=["new", "old"])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--time-limit", type=float, default=225.0)
    args = ap.parse_args()
    if args.device == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=600))
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "ranks": dist.get_world_size(),
        "args": vars(args),
        "rows": [],
    }
    watchdog(args.time_limit, report)
    folder = Path(args.folder or f"/tmp/relayrl_sharded_load_{args.shape}_{args.layers}")
    if dist.get_rank() == 0 and not (folder / "config.json").is_file():
        report["folder"] = write_folder(args, folder, device)
        print(f"folder written: {report['folder']}", flush=True)
    dist.barrier()
    for mode in args.modes:
        row = load_once(folder, mode, device)
        report["rows"].append(row)
        if dist.get_rank() == 0:
            print(
                json.dumps({k: v for k, v in row.items() if k not in ("checksums", "per_rank")}), flush=True
            )
        write(report)
    sums = {r["mode"]: r["checksums"] for r in report["rows"]}
    if len(sums) == 2:
        report["same_shards"] = sums["new"] == sums["old"]
        if dist.get_rank() == 0:
            print(f"same shards on both paths: {report['same_shards']}", flush=True)
    write(report)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
