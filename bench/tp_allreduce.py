"""The tensor-parallel decode step's all-reduce alone: NCCL vs the native engine's symmetric-memory paths
(relayrl/rollout/tp_allreduce.py), per call, eagerly and replayed from a CUDA graph, at the decode step's shape.

    torchrun --standalone --nproc_per_node=2 bench/tp_allreduce.py                 # [256, 3584] bf16, TP 2
    torchrun --standalone --nproc_per_node=4 bench/tp_allreduce.py --tp 2 4
    torchrun --standalone --nproc_per_node=2 bench/tp_decode.py --allreduce-only   # the same, from tp_decode

For each TP size: NCCL (dist.all_reduce, what the engine ran before) and each of one_shot, two_shot and auto
(each set up as the engine sets it up: symmetric buffer, rendezvous, self-test, every rank agreeing, so an
unavailable one is recorded as such, never a hang in setup), and for comparison NCCL's own symmetric kernels
("nccl_symm": a buffer in an NCCL-allocator MemPool registered as a symmetric window; not used by the
engine): microseconds per call of `calls` back-to-back
calls (2 a layer: 56 at 7B), eager ("eager_us": host launch costs included) and as one CUDA graph
("graph_us": what the engine's decode replays); whether its sum of random data is bit-equal to NCCL's (TP 2:
it must be); and graph_ms_saved_per_step = (NCCL - it) x calls. Every rank joins every collective in the same
order; a graph captured on one rank but not another is replayed on none. Writes $OUT/tp_allreduce.json
(bench/results/ without $OUT) after each stage; a watchdog (--time-limit) writes what was measured and exits
124, the JSON's "stage" saying where it stopped. Multicast (NVLink SHARP) is never used.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # P2P all-reduces only: never NVLink multicast
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse
import datetime
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.rollout.tp_allreduce import setup_fast_all_reduce


def _agreed(ok: bool, group) -> bool:
    """True if `ok` on every rank of `group` (so no rank replays a graph its peers failed to capture)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=torch.cuda.current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def _per_call_us(fn, device: torch.device, group, calls: int, iters: int) -> dict:
    """Microseconds per call of `fn`: `calls` calls back to back, eagerly and replayed as one CUDA graph
    (captured on every rank or replayed on none)."""
    out: dict = {}
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    dist.barrier(group)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters * calls):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    out["eager_us"] = 1000 * start.elapsed_time(end) / (iters * calls)
    graph = torch.cuda.CUDAGraph()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception as err:  # recorded: a capture that fails is itself the result
        out["graph_error"] = repr(err)[:300]
    if not _agreed("graph_error" not in out, group):
        out.setdefault("graph_error", "the capture failed on another rank")
        return out
    dist.barrier(group)
    graph.replay()  # once untimed
    torch.cuda.synchronize(device)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    out["graph_us"] = 1000 * start.elapsed_time(end) / (iters * calls)
    dist.barrier(group)
    return out


def nccl_window_bench(
    group, device: torch.device, dtype: torch.dtype, x, want, calls: int, iters: int
) -> dict:
    """For comparison (the engine does not use it): NCCL's own symmetric kernels (NCCL >= 2.27), reached by an
    in-place dist.all_reduce of a buffer in a torch.cuda.MemPool over NCCL's allocator registered as a symmetric
    window (ProcessGroupNCCL.register_mem_pool(pool, symm=True) -> ncclCommWindowRegister). Every step agreed;
    an error is recorded, not raised."""
    out: dict = {}
    state: dict = {}

    def step(name: str, fn) -> bool:
        try:
            fn()
        except Exception as err:  # recorded: this torch / NCCL may not have it
            out.setdefault("error", f"{name}: {err!r}"[:300])
        return _agreed("error" not in out, group)

    def alloc() -> None:
        backend = group._get_backend(device)
        pool = torch.cuda.MemPool(backend.mem_allocator)
        with torch.cuda.use_mem_pool(pool):
            state["buf"] = torch.empty_like(x)
        state["backend"], state["pool"] = backend, pool

    if not step("alloc", alloc) or not step(
        "register", lambda: state["backend"].register_mem_pool(state["pool"], symm=True)
    ):
        out.setdefault("error", "failed on another rank")
        return out
    buf = state["buf"]
    buf.copy_(x)
    dist.all_reduce(buf, group=group)
    out["bit_equal_to_nccl"] = bool(torch.equal(buf, want))
    out.update(_per_call_us(lambda: dist.all_reduce(buf, group=group), device, group, calls, iters))
    torch.cuda.synchronize(device)
    step("deregister", lambda: state["backend"].deregister_mem_pool(state["pool"]))
    return out


def allreduce_bench(
    tp: int,
    rows: int,
    cols: int,
    calls: int,
    device: torch.device,
    dtype: torch.dtype,
    mark: Callable[[str], None],
    iters: int = 20,
) -> dict | None:
    """The decode step's all-reduce alone ([batch, hidden] bf16, 2 a layer): NCCL (dist.all_reduce) vs the
    engine's symmetric-memory paths (rollout/tp_allreduce.py: one-shot, two-shot, auto, each set up with its
    self-test and agreed fallback), per call, eager and inside a CUDA graph, and whether each one's sum of
    random data equals NCCL's bit for bit. `mark(stage)` records progress (a timed-out run shows where)."""
    rank = dist.get_rank()
    group = dist.new_group(list(range(tp)))
    out = None
    if rank < tp:
        res: dict = {"tp": tp, "shape": [rows, cols], "dtype": str(dtype), "calls_per_step": calls}
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        x = torch.randn(rows, cols, generator=gen, device=device).to(dtype)
        want = x.clone()
        dist.all_reduce(want, group=group)
        y = x.clone()
        mark(f"tp{tp} nccl")
        res["nccl"] = _per_call_us(lambda: dist.all_reduce(y, group=group), device, group, calls, iters)
        for impl in ("one_shot", "two_shot", "auto"):
            mark(f"tp{tp} {impl}: setup")
            fast = setup_fast_all_reduce(group, device, dtype, rows, cols, impl)
            if fast is None:
                res[impl] = {"error": "unavailable here (fell back to NCCL; see the log)"}
                continue
            view = fast.slot(rows, cols)
            view.copy_(x)
            got = fast.reduce(view)
            entry: dict = {"name": fast.name, "bit_equal_to_nccl": bool(torch.equal(got, want)),
                           "max_abs_diff": float((got.float() - want.float()).abs().max())}  # fmt: skip
            mark(f"tp{tp} {impl}: timing")
            entry.update(_per_call_us(lambda f=fast, v=view: f.reduce(v), device, group, calls, iters))
            res[impl] = entry
            del fast, view, got
        mark(f"tp{tp} nccl_symm")
        res["nccl_symm"] = nccl_window_bench(group, device, dtype, x, want, calls, iters)
        for impl in ("one_shot", "two_shot", "auto", "nccl_symm"):
            if "graph_us" in res[impl] and "graph_us" in res["nccl"]:
                saved = (res["nccl"]["graph_us"] - res[impl]["graph_us"]) * calls / 1000
                res[impl]["graph_ms_saved_per_step"] = saved
        out = res
    dist.barrier()
    return out if rank == 0 else None


def _write(result: dict) -> None:
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tp_allreduce.json").write_text(json.dumps(result, indent=2, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=None, help="TP sizes (default 2, 4, 8 <= world)")
    ap.add_argument("--rows", type=int, default=256, help="tokens (the decode batch)")
    ap.add_argument("--cols", type=int, default=3584, help="hidden size (Qwen2.5-7B: 3584)")
    ap.add_argument("--calls", type=int, default=56, help="all-reduces a step (2 a layer)")
    ap.add_argument("--iters", type=int, default=20, help="timed repetitions of the calls")
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds before partial results + exit")
    args = ap.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "args": vars(args),
        "allreduce": [],
    }

    def fire() -> None:
        result["timed_out_after_s"] = args.time_limit
        _write(json.loads(json.dumps(result, default=str)))
        os._exit(124)

    timer = threading.Timer(args.time_limit, fire)
    timer.daemon = True
    timer.start()

    def mark(stage: str) -> None:
        result["stage"] = stage
        _write(result)

    for tp in args.tp or [t for t in (2, 4, 8) if t <= world]:
        res = allreduce_bench(tp, args.rows, args.cols, args.calls, device, torch.bfloat16, mark, args.iters)
        result["allreduce"].append(res)
        mark(f"tp{tp} done")
    result["stage"] = "done"
    _write(result)
    if dist.get_rank() == 0:
        print(json.dumps(result["allreduce"], indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
