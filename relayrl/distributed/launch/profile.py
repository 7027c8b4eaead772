"""Per-rank profile of role calls, for bench/scale.py --profile (off unless RELAYRL_PROFILE_DIR is set).

    RELAYRL_PROFILE_DIR=/tmp/prof relayrl rl ...      every rank appends one JSON line per method call to
                                                      <dir>/<role>_rank<r>.jsonl: wall seconds, the seconds
                                                      spent fetching experience rows from the driver
                                                      (relayrl.distributed.launch.rows), and, for the
                                                      training call (update / step) number RELAYRL_PROFILE_CALL
                                                      (default 2: after a warm-up) on a GPU, a torch.profiler
                                                      breakdown of its kernels

The breakdown (`kernel_breakdown`, from the profiler's Chrome trace): compute kernels launched from the
autograd engine's threads are backward, those launched inside `Optimizer.step` are the optimizer, the other
compute kernels are forward (the loss and log-prob passes included); NCCL kernels are all-gather /
reduce-scatter / all-reduce, and their *exposed* seconds are the part of their time during which no compute
kernel runs (what overlap did not hide); `gpu_idle` is the call's wall time with no kernel at all (launch
gaps, host work, waiting for peers). Kernel seconds are GPU time, so forward + backward + optimizer + exposed
communication + gpu_idle = wall (up to overlaps between compute streams).

Both launchers call `profiled` around every method call (the Ray rank host and the local role), so 1 GPU
(local) and N GPUs (ray) are measured the same way.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from relayrl.distributed.launch.rows import FETCH

PROFILE_ENV = "RELAYRL_PROFILE_DIR"
CALL_ENV = "RELAYRL_PROFILE_CALL"
TRACED = ("update", "step")
"""The training calls traced by torch.profiler (the policy's / critic's update, a one-model recipe's step)."""

R = TypeVar("R")
_calls: dict[tuple[str, str], int] = {}


def profiled(role: str, rank: int, method: str, fn: Callable[[], R]) -> R:
    """fn(), timed (and traced, see module doc) when RELAYRL_PROFILE_DIR is set; else just fn()."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        return fn()
    n = _calls[(role, method)] = _calls.get((role, method), 0) + 1
    trace = method in TRACED and n == int(os.environ.get(CALL_ENV, "2")) and torch.cuda.is_available()
    fetched = FETCH["seconds"]
    start = time.time()
    t0 = time.perf_counter()
    parts: dict[str, float] = {}
    if trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = fn()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            parts = kernel_breakdown(json.loads(path.read_text()))
    else:
        out = fn()
        if method in TRACED and torch.cuda.is_available():
            torch.cuda.synchronize()
    record = {
        "role": role,
        "rank": rank,
        "method": method,
        "call": n,
        "start": start,
        "wall_s": time.perf_counter() - t0,
        "transfer_s": FETCH["seconds"] - fetched,
        **parts,
    }
    Path(folder).mkdir(parents=True, exist_ok=True)
    with (Path(folder) / f"{role}_rank{rank}.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of union(xs) not covered by union(ys)."""
    covered = 0.0
    ys = _union(ys)
    for a, b in _union(xs):
        for c, d in ys:
            covered += max(0.0, min(b, d) - max(a, c))
    return _length(_union(xs)) - covered


def kernel_breakdown(trace: dict[str, Any]) -> dict[str, float]:
    """Seconds of forward / backward / optimizer compute, exposed all-gather / reduce-scatter / all-reduce,
    and GPU idle time, from a torch.profiler Chrome trace (see module doc)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launch: dict[Any, tuple[Any, float]] = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launch[e["args"]["correlation"]] = (e["tid"], e["ts"])
    autograd = {
        e["tid"]
        for e in events
        if e.get("cat") == "cpu_op" and e["name"].startswith("autograd::engine::evaluate_function")
    }
    optim = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("Optimizer.step")
    ]
    sums = {"forward_s": 0.0, "backward_s": 0.0, "optimizer_s": 0.0}
    compute: list[tuple[float, float]] = []
    comm: dict[str, list[tuple[float, float]]] = {"all_gather": [], "reduce_scatter": [], "all_reduce": []}
    everything: list[tuple[float, float]] = []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        everything.append(iv)
        name = e["name"]
        if "nccl" in name.lower():
            kind = (
                "all_gather"
                if "AllGather" in name
                else "reduce_scatter"
                if "ReduceScatter" in name
                else "all_reduce"
            )
            comm[kind].append(iv)
            continue
        compute.append(iv)
        tid, ts = launch.get(e.get("args", {}).get("correlation"), (None, 0.0))
        if tid in autograd:
            sums["backward_s"] += iv[1] - iv[0]
        elif any(a <= ts <= b for a, b in optim):
            sums["optimizer_s"] += iv[1] - iv[0]
        else:
            sums["forward_s"] += iv[1] - iv[0]
    out = {k: v / 1e6 for k, v in sums.items()}  # the trace is in microseconds
    for kind, ivs in comm.items():
        out[f"{kind}_s"] = _length(_union(ivs)) / 1e6
        out[f"{kind}_exposed_s"] = _minus(ivs, compute) / 1e6
    if everything:
        span = max(b for _, b in everything) - min(a for a, _ in everything)
        out["gpu_busy_s"] = _length(_union(everything)) / 1e6
        out["gpu_span_s"] = span / 1e6
    return out
