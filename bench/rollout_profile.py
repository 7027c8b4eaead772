"""bench/rollout.py's pieces: the card's peaks, the decode floors, and `--profile` (where a decode step goes).

Peaks (NVIDIA data sheets, dense bf16 tensor-core FLOP/s without sparsity, HBM bandwidth), matched on
`torch.cuda.get_device_name()`; `--peak-tflops` / `--peak-tbs` override them:

    H100 SXM ("NVIDIA H100 80GB HBM3")   989 TFLOP/s   3.35 TB/s
    H100 NVL                             835           3.9
    H100 PCIe                            756           2.0
    H200 (SXM)                           989           4.8
    H200 NVL                             835           4.8
    A100 SXM 80GB                        312           2.039

Floors of one decode step of `batch` samples at mean context `ctx` (prompt + half the mean completion), per
GPU of a `tp`-way group (weights, KV and FLOPs split evenly, all-reduces not counted):

    compute   = 2 * matmul params * batch / peak FLOP/s          (attention FLOPs not counted)
    bandwidth = (matmul params * 2 bytes + batch * ctx * KV bytes per token) / peak bandwidth

Profile: torch.profiler over one round of `--profile-steps` new tokens (after a warm-up round of the same
size) of the native engine. On CUDA, every kernel inside the decode window (first to last kernel launched by a
CUDA-graph replay) is put in a category by its name; idle = window - time covered by some kernel (host work,
launch and sync gaps). On CPU, aten ops' self time by name, and idle = wall - all ops' self time.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

PEAKS = (  # (name part, bf16 dense TFLOP/s, HBM TB/s); the first match wins, so the specific names first
    ("H200 NVL", 835.0, 4.8),
    ("H200", 989.0, 4.8),
    ("H100 NVL", 835.0, 3.9),
    ("H100 PCIe", 756.0, 2.0),
    ("H100", 989.0, 3.35),
    ("A100-SXM4-80GB", 312.0, 2.039),
)


def card_peaks(device: str, tflops: float = 0.0, tbs: float = 0.0) -> dict:
    """{"card", "tflops", "tbs", "source"} for this device (None values off CUDA or for an unknown card)."""
    name = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else "cpu"
    hit = next((p for p in PEAKS if p[0] in name), None)
    peak_f, peak_b = (hit[1], hit[2]) if hit else (None, None)
    return dict(
        card=name,
        tflops=tflops or peak_f,
        tbs=tbs or peak_b,
        source="--peak-tflops/--peak-tbs" if (tflops or tbs) else (f"data sheet ({hit[0]})" if hit else None),
    )


def floors_ms(config, counts: dict, peaks: dict, *, batch: float, ctx: float, tp: int = 1) -> dict:
    """The compute and bandwidth floors (ms) of one decode step (see module doc); empty without peaks."""
    if not peaks["tflops"] or not peaks["tbs"]:
        return {}
    d = config.hidden_size // config.num_attention_heads
    kv_token = 2 * config.num_hidden_layers * config.num_key_value_heads * d * 2  # K and V, bf16
    compute = 2 * counts["matmul"] * batch / (peaks["tflops"] * 1e12) / tp * 1e3
    bandwidth = (counts["matmul"] * 2 + batch * ctx * kv_token) / (peaks["tbs"] * 1e12) / tp * 1e3
    return dict(compute_floor_ms=compute, bandwidth_floor_ms=bandwidth, floor_ms=max(compute, bandwidth))


# ---------------------------------------------------------------------------------------------- profile
CATEGORIES = ("matmul", "attention", "norm+elementwise", "sampling", "memcpy", "idle/launch gaps")


def category(name: str, cat: str = "") -> str:
    """The category of a CUDA kernel (or, on CPU, an aten op) by its name."""
    n = name.lower()
    if cat in ("gpu_memcpy", "gpu_memset") or "memcpy" in n or "memset" in n:
        return "memcpy"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "aten::bmm", "aten::baddbmm")) or (
        "softmax" in n and "log" not in n
    ):
        return "attention"  # the math path's softmax is attention's; sampling's is log_softmax
    if any(k in n for k in ("logsoftmax", "log_softmax", "cumsum", "scan", "argmax", "sort", "radix")):
        return "sampling"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm")):
        return "matmul"
    return "norm+elementwise"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize_cuda_trace(events: list[dict], steps: int) -> dict:
    """Category table of the decode window of a chrome trace (see module doc); times in ms per step."""
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    graph = {
        e.get("args", {}).get("correlation")
        for e in events
        if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")
    }
    replayed = [k for k in kernels if k.get("args", {}).get("correlation") in graph]
    anchor = replayed or kernels
    if not anchor:
        return {}
    lo = min(k["ts"] for k in anchor)
    hi = max(k["ts"] + k["dur"] for k in anchor)
    inside = [k for k in kernels if k["ts"] >= lo and k["ts"] + k["dur"] <= hi]
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    top: dict[str, float] = {}
    for k in inside:
        by_cat[category(k["name"], k["cat"])] += k["dur"]
        top[k["name"][:90]] = top.get(k["name"][:90], 0.0) + k["dur"]
    window = hi - lo
    by_cat["idle/launch gaps"] = window - _union([(k["ts"], k["ts"] + k["dur"]) for k in inside])
    return _table(by_cat, window, steps, top, graphs=bool(replayed))


def _table(by_cat: dict, window_us: float, steps: int, top: dict, graphs: bool) -> dict:
    steps = max(1, steps)
    return dict(
        window_ms=window_us / 1e3,
        steps=steps,
        ms_per_step=window_us / 1e3 / steps,
        cuda_graphs=graphs,
        categories={
            c: dict(ms_per_step=v / 1e3 / steps, percent=100.0 * v / window_us if window_us else 0.0)
            for c, v in by_cat.items()
        },
        top_kernels=[
            dict(name=n, ms_per_step=v / 1e3 / steps)
            for n, v in sorted(top.items(), key=lambda kv: -kv[1])[:15]
        ],
    )


def profile_native(runner, wl, vocab: int, steps: int, device: str) -> dict:
    """Profile one round of `wl` cut to `steps` new tokens on the native runner (after one warm-up round)."""
    from torch.profiler import ProfilerActivity, profile

    runner.generate(wl.requests(vocab, 98, max_new=steps))
    cuda = device.startswith("cuda")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    reqs = wl.requests(vocab, 99, max_new=steps)
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        runner.generate(reqs)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    decode_steps = runner.counters.get("decode_steps", steps - 1)
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            events = json.loads(path.read_text())["traceEvents"]
        out = summarize_cuda_trace(events, decode_steps)
    else:
        by_cat = dict.fromkeys(CATEGORIES, 0.0)
        top: dict[str, float] = {}
        for ev in prof.key_averages():
            by_cat[category(ev.key)] += ev.self_cpu_time_total
            top[ev.key] = top.get(ev.key, 0.0) + ev.self_cpu_time_total
        busy = sum(v for c, v in by_cat.items() if c != "idle/launch gaps")
        by_cat["idle/launch gaps"] = max(0.0, wall * 1e6 - busy)
        out = _table(by_cat, wall * 1e6, decode_steps, top, graphs=False)
    out.update(wall_s=wall, batch=wl.samples, prompt_len=wl.prompt_len, new_tokens=steps)
    return out


def print_profile(prof: dict, label: str) -> None:
    print(
        f"\nprofile: {label}  ({prof['steps']} decode steps, {prof['ms_per_step']:.3f} ms/step in the window)"
    )
    print(f"{'category':20s} {'ms/step':>9s} {'% of step':>10s}")
    for c, v in prof["categories"].items():
        print(f"{c:20s} {v['ms_per_step']:9.3f} {v['percent']:9.1f}%")
    print("top kernels / ops (ms per step):")
    for k in prof["top_kernels"][:8]:
        print(f"  {k['ms_per_step']:8.3f}  {k['name']}")
