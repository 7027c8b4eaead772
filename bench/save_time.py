"""End-of-run save of a sharded policy: time, bytes and host memory of each phase, old path against new.

    python bench/save_time.py --shape qwen7b-char --ranks 4               # 4 GPUs (NCCL), the 7B shape
    python bench/save_time.py --shape small --ranks 2 --device cpu        # CPU (gloo), ~170M parameters
    python bench/save_time.py --shape qwen7b-char --ranks 4 --paths ckpt  # the checkpoint writers alone

What a `relayrl rl` run on N FSDP2 ranks does when it ends (save_every 0 still writes the last checkpoint),
phase by phase, on N processes started here (torch.multiprocessing; the same RoleState code the Ray rank
actors run, without Ray and the engines):

    export_new      RoleState.export: every rank writes its rows into the HF folder (distributed/hf_export.py)
    export_old      the old export: every tensor gathered to rank 0's CPU, then save_pretrained there
    checkpoint      RoleState.save: DCP shards of weights + AdamW moments (every rank its own), rng/, config,
                    written by relayrl.distributed.dcp_writer (threads per rank, bounded host staging, fsync)
    checkpoint_old  the same with torch.save's per-record zip CRC on (the code before)
    checkpoint_torch  the same through torch's own FileSystemWriter (one file and thread per rank, every
                    tensor's host copy kept until its file closes: the writer before dcp_writer)
    checkpoint_nosync  dcp_writer without fsync: what the disk's writeback costs of `checkpoint`
    checkpoint_again  `checkpoint` once more, warm (the first save of a process pays first-call costs)
    manifest_new    the driver's manifest.json, chunks checksummed by threads (relayrl.training.crc)
    manifest_old    the same manifest, one thread checksumming every file (the code before); must be equal
(in the order PLANS gives for --paths; a real run writes the checkpoint, then its manifest, then the export)

Per phase and rank: seconds, peak host RSS above the phase's start (VmHWM, reset before the phase), peak GPU
memory, bytes written; export_new and export_old must give byte-identical files (`same_files`). The model is
a random Qwen2 of the shape (qwen7b-char: scale.py's 7B runs, 6.5B parameters, the char tokenizer's
vocabulary) built on the meta device and allocated shard by shard (no rank ever holds it
whole), with one AdamW step taken so the optimizer state exists. Files go to --dir (default a new folder in
the system temp dir; needs ~16 bytes per parameter free, ~105 GB at 6.5B; files are deleted as soon as
no later phase reads them), never to $OUT. Results: <out>/save_time_<paths>.json (<out> = --out, else $OUT, else bench/results), rewritten
after every phase, so a timeout keeps what ran; --time-budget stops the ranks (and says so) if exceeded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000),
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936),
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064),
}  # fmt: skip
SHAPES["qwen7b-char"] = {k: v for k, v in SHAPES["qwen7b"].items() if k != "vocab_size"}  # 6.5B: scale.py's
PARAMS = {"tiny": 1e6, "small": 1.6e8, "qwen1.5b": 1.8e9, "qwen7b": 7.6e9, "qwen7b-char": 6.5e9}
PLANS = {
    "new": ["export_new", "checkpoint", "manifest_new"],
    "old": ["export_old", "checkpoint_old", "manifest_old"],
    "new,old": ["export_new", "checkpoint", "manifest_new", "manifest_old", "export_old", "checkpoint_old"],
    "ckpt": ["checkpoint", "checkpoint_torch", "checkpoint_nosync", "checkpoint_again"],
}
"""--paths -> phases in order. The export first (the old one is the largest cost: a --time-budget cut or a
kill keeps its number), then the checkpoint and its manifest; with both paths the new ones first, the
manifests of one checkpoint side by side. ckpt: the checkpoint writers alone, the new one first (the first
phase pays for whatever host memory the machine still has to hand out and for first calls, so the new writer
is not favoured), then again last, warm, if --time-budget allows.
A checkpoint phase's row holds per rank the new writer's counters (`writer`: files, bytes, seconds copying,
serialising and in fsync summed over its threads, peak staged bytes) and, on GPUs, the caching host
allocator's pinned bytes (`pinned`)."""
WRITES = {
    "checkpoint": "ckpt",
    "checkpoint_old": "ckpt",
    "checkpoint_torch": "ckpt",
    "checkpoint_nosync": "ckpt",
    "checkpoint_again": "ckpt",
    "export_new": "export_new",
    "export_old": "export_old",
}
"""The folder each writing phase fills (under the work folder)."""


def _reset_peak_rss() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def _serial_manifest(folder: Path) -> dict[str, dict[str, int]]:
    """The manifest as the code before relayrl.training.crc wrote it: one thread, 16 MiB reads."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            crc = 0
            with p.open("rb") as f:
                while chunk := f.read(1 << 24):
                    crc = zlib.crc32(chunk, crc)
            out[str(p.relative_to(folder))] = {"size": p.stat().st_size, "crc32": crc}
    return out


def _build(shape: str, device: torch.device):
    """A random Qwen2 of `shape`, sharded over the group (allocated shard by shard), its TrainStep with one
    AdamW step taken, and the char tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.config.components import OptimConfig
    from relayrl.distributed.fsdp import ShardSpec, shard_model
    from relayrl.models.tiny import build_tiny_tokenizer
    from relayrl.training.setup import build_train_step

    tok = build_tiny_tokenizer()
    dims = {"vocab_size": len(tok), **SHAPES[shape]}  # the *-char shapes: the char tokenizer's vocabulary
    config = Qwen2Config(max_position_embeddings=4096, tie_word_embeddings=False, **dims)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    bf16 = torch.bfloat16 if device.type == "cuda" else None
    shard_model(model, ShardSpec(device=device, compute_dtype=bf16))
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(1 + torch.distributed.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(0.0, 0.02, generator=gen)
        for b in model.buffers():
            b.zero_()
    train = build_train_step(model, OptimConfig(), 10, precision="auto", device=device, sharded=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    train.optimizer.step()
    train.optimizer.zero_grad(set_to_none=True)
    return model, train, tok


def _rank_main(rank: int, world: int, args: argparse.Namespace, store: str, work: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from relayrl.distributed.checkpoint import export_full, save_tensors
    from relayrl.distributed.dcp_writer import BoundedWriter
    from relayrl.distributed.hf_export import streamable
    from relayrl.training.checkpoint import write_manifest
    from relayrl.workers.role_state import RoleState

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
        **({"device_id": device} if cuda else {}),
    )  # fmt: skip
    root = Path(work)
    report: dict = {"args": vars(args), "host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC")}
    if cuda:
        report["device"] = torch.cuda.get_device_name(0)
    try:
        t0 = time.perf_counter()
        model, train, tok = _build(args.shape, device)
        params = sum(p.numel() for p in model.parameters())
        report.update(params=params, build_s=round(time.perf_counter() - t0, 1), phases={})
        report["plan"] = PLANS[",".join(sorted(args.paths))]
        # None: export_new writes in place; else why it falls back to the old path (e.g. an old transformers)
        report["export_new_fallback"] = streamable(model, model.state_dict())
        state = RoleState(model, train, tok, full_weights=lambda p: {})
        small = dict(list(model.state_dict().items())[-3:])  # warm DCP's code paths up (not timed)
        save_tensors(root / "warmup", small)
        steps = {
            "checkpoint": lambda: state.save(root / "ckpt" / "policy", {}),
            "manifest_new": lambda: write_manifest(root / "ckpt") if rank == 0 else None,
            "manifest_old": lambda: _serial_manifest(root / "ckpt") if rank == 0 else None,
            "export_new": lambda: state.export(root / "export_new"),
            "checkpoint_old": lambda: _with_zip_crc(lambda: state.save(root / "ckpt" / "policy", {})),
            "export_old": lambda: export_full(model, lambda sd: state.save_hf(root / "export_old", sd)),
            "checkpoint_again": lambda: state.save(root / "ckpt" / "policy", {}),
            "checkpoint_torch": lambda: _with_writer(
                lambda f: FileSystemWriter(str(f)), lambda: state.save(root / "ckpt" / "policy", {})
            ),
            "checkpoint_nosync": lambda: _with_writer(
                lambda f: BoundedWriter(f, sync_files=False), lambda: state.save(root / "ckpt" / "policy", {})
            ),
        }
        if args.simulate_d2h:
            _simulate_d2h()
        wanted = report["plan"]
        for phase in wanted:
            if time.perf_counter() - t0 > args.time_budget:
                report["phases"][phase] = {"skipped": f"past --time-budget {args.time_budget} s"}
                continue
            report["phases"][phase] = _run_phase(phase, steps[phase], rank, world, root, device)
            _after_phase(phase, report, rank, root, out)
    except Exception:
        report["error"] = traceback.format_exc()
        if rank == 0:
            Path(out).write_text(json.dumps(report, indent=1) + "\n")
        raise
    finally:
        dist.destroy_process_group()


def _run_phase(phase: str, fn, rank: int, world: int, root: Path, device: torch.device) -> dict:
    import torch.distributed as dist

    from relayrl.distributed.dcp_writer import last_stats

    dist.barrier()
    base_rss = _rss_kb("VmRSS")
    _reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    stats_before = last_stats()
    t = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t
    dist.barrier()
    mine: dict = {
        "seconds": round(seconds, 2),
        "rss_start_gb": round(base_rss / 1e6, 2),
        "rss_peak_extra_gb": round((_rss_kb("VmHWM") - base_rss) / 1e6, 2),
    }
    stats = last_stats()
    if phase.startswith("checkpoint") and stats is not None and stats is not stats_before:
        mine["writer"] = {k: round(v, 2) if isinstance(v, float) else v for k, v in stats.as_dict().items()}
    if device.type == "cuda":
        mine["gpu_peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        mine["pinned"] = _pinned_stats()
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    row: dict = {"wall_s": max(r["seconds"] for r in ranks), "ranks": ranks}
    if phase.startswith("manifest") and rank == 0:
        files = (
            result if isinstance(result, dict) else json.loads((root / "ckpt" / "manifest.json").read_text())
        )
        (root / f"{phase}.json").write_text(json.dumps(files, sort_keys=True))
    return row


def _simulate_d2h() -> None:
    """CPU only (--simulate-d2h): every tensor DCP's planner hands a writer becomes a fresh host copy, as a GPU
    tensor's device-to-host copy is, so the writers' host memory on a CPU run shows what it is on GPUs (less
    the pinned allocator's rounding): torch's writer keeps each copy until its file closes, dcp_writer frees
    it after its record."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    real = DefaultSavePlanner.resolve_data

    def resolve_data(self, write_item):
        data = real(self, write_item)
        return data.detach().clone() if isinstance(data, torch.Tensor) else data

    DefaultSavePlanner.resolve_data = resolve_data


def _pinned_stats() -> dict:
    """The caching host allocator's byte counters (pinned memory), where this torch reports them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        raw = stats() if stats is not None else {}
    except RuntimeError as e:  # reported, not fatal: the timing stands without it
        return {"error": str(e)}
    return {k: round(v / 1e9, 2) for k, v in raw.items() if "bytes" in k and isinstance(v, int)}


def _with_writer(writer, fn):
    """Run `fn` with relayrl.distributed.checkpoint writing DCP through `writer(folder)`."""
    from unittest import mock

    with mock.patch("relayrl.distributed.checkpoint.storage_writer", writer):
        return fn()


def _with_zip_crc(fn):
    """Run `fn` with DCP writing torch.save's per-record CRC, as before relayrl.distributed.checkpoint
    turned it off."""
    from unittest import mock

    with mock.patch("relayrl.distributed.checkpoint.without_zip_crc", contextlib.nullcontext):
        return fn()


def _after_phase(phase: str, report: dict, rank: int, root: Path, out: str) -> None:
    """Bytes of what the phase wrote, checks, clean-up of files no later phase needs; the JSON (rank 0)."""
    import torch.distributed as dist

    row = report["phases"][phase]
    if rank == 0:
        if phase in WRITES:
            row["bytes"] = _folder_bytes(root / WRITES[phase])
            row["gb_per_s"] = round(row["bytes"] / 1e9 / max(row["wall_s"], 1e-9), 2)
        if phase == "manifest_old" and (root / "manifest_new.json").is_file():
            row["same_as_new"] = (root / "manifest_old.json").read_text() == (
                root / "manifest_new.json"
            ).read_text()
        if phase == "export_old" and (root / "export_new").exists():
            new, old = root / "export_new", root / "export_old"
            names = sorted(p.name for p in old.iterdir() if p.suffix in (".safetensors", ".json"))
            row["same_files"] = all(_same(new / n, old / n) for n in names)
        if phase.startswith("export"):
            report.setdefault("export_files", {})[phase] = sorted(p.name for p in (root / phase).iterdir())
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"[save_time] {phase}: {json.dumps(row)}", flush=True)
    dist.barrier()
    if rank == 0:  # what no later phase reads: the disk holds one checkpoint at a time
        later = report["plan"][report["plan"].index(phase) + 1 :]
        if not any(p.startswith("manifest") for p in later):
            shutil.rmtree(root / "ckpt", ignore_errors=True)
        if not any(p.startswith("export") for p in later):
            for name in ("export_new", "export_old"):
                shutil.rmtree(root / name, ignore_errors=True)


def _same(a: Path, b: Path) -> bool:
    from relayrl.training.crc import file_crc32

    return (
        a.is_file()
        and b.is_file()
        and a.stat().st_size == b.stat().st_size
        and file_crc32(a) == file_crc32(b)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen7b-char", choices=sorted(SHAPES))
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument(
        "--paths",
        default="old,new",
        help="new | old | old,new (either order) | ckpt: which path's phases to time (see PLANS)",
    )
    p.add_argument(
        "--simulate-d2h",
        action="store_true",
        help="CPU: DCP writes a fresh host copy of every tensor, as from a GPU (see _simulate_d2h)",
    )
    p.add_argument("--dir", default=None, help="folder for the checkpoint and exports (default: a temp dir)")
    p.add_argument("--out", default=None, help="results folder (default $OUT, else bench/results)")
    p.add_argument("--time-budget", type=float, default=170.0, help="seconds after which phases are skipped")
    args = p.parse_args()
    args.paths = sorted(args.paths.split(","))
    if ",".join(args.paths) not in PLANS:
        sys.exit(f"--paths must be one of {sorted(PLANS)}, got {','.join(args.paths)}")
    if args.simulate_d2h and args.device != "cpu":
        sys.exit("--simulate-d2h is for --device cpu (on GPUs the copies are real)")
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"--ranks {args.ranks} needs {args.ranks} GPUs, {torch.cuda.device_count()} visible")
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "bench" / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"save_time_{'_'.join(args.paths)}.json"
    work = Path(tempfile.mkdtemp(prefix="save_time_", dir=args.dir))
    need = 16 * PARAMS[args.shape]
    free = shutil.disk_usage(work).free
    print(f"[save_time] {args.shape} on {args.ranks} {args.device} ranks; files in {work} ({free / 1e9:.0f} GB "
          f"free, ~{need / 1e9:.0f} GB needed); results -> {out}", flush=True)  # fmt: skip
    if free < need:
        print(
            f"[save_time] warning: {free / 1e9:.0f} GB free may be too little; later phases may fail",
            flush=True,
        )
    import torch.multiprocessing as mp

    try:
        ctx = mp.start_processes(
            _rank_main, args=(args.ranks, args, str(work / "store"), str(work), str(out)), nprocs=args.ranks,
            join=False, start_method="spawn",
        )  # fmt: skip
        deadline = time.time() + args.time_budget + 60
        while not ctx.join(timeout=5):
            if time.time() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                sys.exit(f"[save_time] ranks still running {args.time_budget + 60:.0f} s in: killed")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(out.read_text())


if __name__ == "__main__":
    main()
