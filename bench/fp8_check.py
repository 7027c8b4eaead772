"""bench/fp8_rollout.py's GPU diagnostics: the per-GEMM check at 7B widths (--gemm-check) and the decode-step
profile of an engine (--profile). Both return small JSON-able dicts and print one line per row.

gemm_check(): for each projection of a Qwen2.5-7B layer (q/k/v 4608 x 3584 with bias, o 3584 x 3584, gate/up
37888 x 3584, down 3584 x 18944) and batch rows M (decode batches 1 / 32 / 256, a prefill chunk 4096), random
bf16 weights (std 0.02, as the bench model) and activations (unit-RMS rows, as after an RMSNorm; the down
projection's input is silu(gate) * up of such rows):
  - time (us per call, a CUDA graph of 20 calls replayed, so launch overhead is out): the bf16 GEMM
    (F.linear), the fp8 GEMM (torch._scaled_mm row-wise, fast and slow accumulation, operands quantised
    beforehand; and fp8.GEMM "cublas": cuBLAS's per-tensor fp8 GEMM, fp32 out, then fp8_kernels.rescale), the
    activation quantiser (fp8_kernels.py's Triton kernel and the torch ops it replaces);
  - error (relative Frobenius against an fp32 GEMM with TF32 off): `bf16` the bf16 GEMM against the exact
    product of the bf16 operands; `fp8_fast` / `fp8_slow` the fp8 GEMM against the same exact product (what
    the engine adds: the e4m3 roundings, ~0.038 expected, 13x bf16's ~0.003); `acc_fast` / `acc_slow` the fp8
    GEMM against an fp32 GEMM of its own dequantised operands (only accumulation and the bf16 output: ~0.003;
    fast accumulation's cost shows here; `acc_cublas` likewise for the cuBLAS backend);
  - `quant_equal`: the share of fp8 bytes the Triton quantiser writes equal to fp8.quantize_rows /
    fp8.silu_mul_quantize on the same input (1.0 expected; silu's exp may move a rounding: >= 0.999).

profile_decode(engine): the engine's CUDA graphs (captured / failed keys: a failed capture runs that decode
shape eagerly), the largest decode step (batch max_slots, the longest KV bucket) timed as graph replays and as
one eager step (wall clock: the host's launch cost), and torch.profiler's kernel table of both (top kernels by
GPU time per step, and the time per category: GEMM, fp8 quantiser, the fused norm + quantiser, the "cublas"
GEMM's rescale, attention, norm, other).

fused_check(): the fused decode's norm kernels against the kernels they replace at M = 256, K = 3584.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from relayrl.rollout import fp8, fp8_kernels
from relayrl.rollout.kernels import rms_norm

GEMMS_7B = {"qkv": (4608, 3584, True), "o": (3584, 3584, False), "gate_up": (37888, 3584, False),
            "down": (3584, 18944, False)}  # fmt: skip
"""name -> (N out, K in, bias) of a Qwen2.5-7B layer's projections (q/k/v and gate/up fused)."""
ROWS = (1, 32, 256, 4096)


def graph_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Microseconds per fn() call: a CUDA graph of `reps` calls, replayed 5 times, the median (eager timing
    with events where capture fails; wall clock on a CPU, for smoke runs)."""
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return round((time.perf_counter() - t0) / 3 * 1e6, 2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def eager() -> None:
        for _ in range(reps):
            fn()

    run: Callable[[], object] = eager
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        run = graph.replay
    except Exception:  # a capture that fails: time eager calls (launch cost included)
        pass
    run()
    times = []
    for _ in range(5):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return round(statistics.median(times), 2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm()), 5)


def _same(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.view(torch.uint8) == b.view(torch.uint8)).float().mean()), 6)


def gemm_row(name: str, n: int, k: int, bias: bool, m: int, gen: torch.Generator) -> dict:
    """One (projection, M) row of the GEMM check (module doc), on `gen`'s device."""
    dev = gen.device
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    b = (torch.randn(n, device=dev, generator=gen) * 0.02).to(torch.bfloat16) if bias else None
    if name == "down":  # silu(gate) * up of unit-RMS rows through a gate/up-like GEMM
        gu = (torch.randn(m, 2 * k, device=dev, generator=gen) * 0.02 * 3584**0.5).to(torch.bfloat16)
        x = F.silu(gu[:, :k]) * gu[:, k:]
        quant_in, triton_q, torch_q = gu, fp8_kernels.silu_mul_quantize, fp8.silu_mul_quantize
    else:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        quant_in, triton_q, torch_q = x, fp8_kernels.quantize_rows, fp8.quantize_rows
    wq = torch.empty(n, k, dtype=fp8.FP8, device=dev)
    ws = torch.empty(n, dtype=torch.float32, device=dev)
    fp8_kernels.quantize_rows_into(w, wq, ws)
    xq, xs = triton_q(quant_in)
    tq, ts = torch_q(quant_in)
    row: dict = dict(
        gemm=name, m=m, n=n, k=k, quant_equal=_same(xq, tq), scale_equal=bool(torch.equal(xs, ts))
    )

    def mm(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
            xq, wq.t(), scale_a=xs, scale_b=ws[None, :], bias=b, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    one = torch.ones((), device=dev)

    def cublas() -> (
        torch.Tensor
    ):  # fp8.GEMM "cublas": per-tensor cuBLAS GEMM, fp32 out, then the rescale kernel
        acc = torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
            xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True
        )
        return fp8_kernels.rescale(acc, xs, ws, b, torch.bfloat16)

    row["bf16_us"] = graph_us(lambda: F.linear(x, w, b))
    row["fp8_fast_us"] = graph_us(lambda: mm(True))
    row["fp8_slow_us"] = graph_us(lambda: mm(False))
    try:  # the alternative backend: a failure is recorded, the row stands
        row["fp8_cublas_us"] = graph_us(cublas)
    except Exception as e:
        row["fp8_cublas_us"] = f"{type(e).__name__}: {e}"[:200]
    row["quant_triton_us"] = graph_us(lambda: triton_q(quant_in))
    row["quant_torch_us"] = graph_us(lambda: torch_q(quant_in))
    tf32 = torch.backends.cuda.matmul.allow_tf32  # fp32 reference GEMMs in full fp32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        exact = F.linear(x.float(), w.float(), None if b is None else b.float())
        deq = F.linear(xq.float() * xs, wq.float() * ws[:, None], None if b is None else b.float())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    fast, slow = mm(True), mm(False)
    row.update(
        err_bf16=_rel(F.linear(x, w, b), exact), err_fp8_fast=_rel(fast, exact), err_fp8_slow=_rel(slow, exact),
        acc_fast=_rel(fast, deq), acc_slow=_rel(slow, deq),
    )  # fmt: skip
    if isinstance(row["fp8_cublas_us"], float):
        row["acc_cublas"] = _rel(cublas(), deq)
    return row


def gemm_check(
    rows: tuple[int, ...] = ROWS, seed: int = 0, device: str = "cuda", gemms: dict | None = None
) -> list[dict]:
    """Every (projection, M) row (module doc); a row that fails is recorded with its error."""
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for name, (n, k, bias) in (gemms or GEMMS_7B).items():
        for m in rows:
            try:
                row = gemm_row(name, n, k, bias, m, gen)
            except Exception as e:  # one shape's failure is a row, the others still run
                row = dict(gemm=name, m=m, error=f"{type(e).__name__}: {e}")
            out.append(row)
            print(gemm_line(row), flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def gemm_line(r: dict) -> str:
    if "error" in r:
        return f"gemm {r['gemm']:7s} M={r['m']:<5d} ERROR {r['error']}"
    return (
        f"gemm {r['gemm']:7s} M={r['m']:<5d} bf16 {r['bf16_us']:8.1f}us  fp8 fast {r['fp8_fast_us']:8.1f}us "
        f"slow {r['fp8_slow_us']:8.1f}us cublas {r.get('fp8_cublas_us')}us"
        f"  quant triton {r['quant_triton_us']:6.1f}us torch {r['quant_torch_us']:6.1f}us"
        f"  | err bf16 {r['err_bf16']:.4f} fp8 {r['err_fp8_fast']:.4f}/{r['err_fp8_slow']:.4f} (fast/slow)"
        f"  acc {r['acc_fast']:.4f}/{r['acc_slow']:.4f}/{r.get('acc_cublas')} (fast/slow/cublas)"
        f"  quant_equal {r['quant_equal']}"
    )


def fused_check(m: int = 256, k: int = 3584, device: str = "cuda") -> dict:
    """The fused decode's norm kernels at 7B width (us per call, `graph_us`): residual + RMSNorm then the
    quantiser (two kernels, the per-projection path) against fp8_kernels.rms_norm_quantize (one), and with the
    "cublas" GEMM's rescale in front (three against one); `equal`: the fused bytes equal the unfused ones."""
    gen = torch.Generator(device=device).manual_seed(1)
    dt = torch.bfloat16 if device.startswith("cuda") else torch.float32
    w = (torch.rand(k, device=device, generator=gen) + 0.5).to(dt)
    x, res = (torch.randn(m, k, device=device, generator=gen).to(dt) for _ in range(2))
    acc = torch.randn(m, k, device=device, generator=gen) * 100
    xs, ws = (
        torch.rand(m, 1, device=device, generator=gen) * 1e-2,
        torch.rand(k, device=device, generator=gen),
    )

    def unfused(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_kernels.quantize_rows(rms_norm(d, w, 1e-6, res)[0])

    q, _, _ = fp8_kernels.rms_norm_quantize(acc, w, 1e-6, res, scales=(xs, ws, None))
    want, _ = unfused(fp8_kernels.rescale(acc, xs, ws, None, dt))
    row = dict(
        m=m, k=k, equal=_same(q, want),
        norm_then_quant_us=graph_us(lambda: unfused(x)),
        norm_quant_us=graph_us(lambda: fp8_kernels.rms_norm_quantize(x, w, 1e-6, res)),
        rescale_norm_then_quant_us=graph_us(lambda: unfused(fp8_kernels.rescale(acc, xs, ws, None, dt))),
        rescale_norm_quant_us=graph_us(lambda: fp8_kernels.rms_norm_quantize(acc, w, 1e-6, res, (xs, ws, None))),
    )  # fmt: skip
    print(
        f"fused norm+quant M={m} K={k}: norm then quant {row['norm_then_quant_us']}us -> fused "
        f"{row['norm_quant_us']}us; rescale+norm+quant {row['rescale_norm_then_quant_us']}us -> fused "
        f"{row['rescale_norm_quant_us']}us; bytes equal {row['equal']}",
        flush=True,
    )
    return row


# ------------------------------------------------------------------------------------------ engine profile
CATEGORIES = (
    ("norm+quant", r"norm_quant"),
    ("quant", r"quantize|amax"),
    ("rescale", r"rescale"),
    ("gemm", r"gemm|cutlass|sm90|sm80|xmma|nvjet|cublas|matmul|scaled_mm|Kernel2"),
    ("attention", r"attention|flash|fmha|sdpa"),
    ("sampler", r"_sample_kernel|scan|softmax|argmax"),  # the old sampler's elementwise kernels stay "other"
    ("norm", r"rms_norm|norm"),
)


def _category(name: str) -> str:
    return next((c for c, pat in CATEGORIES if re.search(pat, name, re.IGNORECASE)), "other")


def kernel_table(prof, steps: int, top: int = 12) -> dict:
    """GPU time per step by kernel (top `top`) and by category, in microseconds (host time per op on a CPU)."""
    rows = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0)
        if us and us > 0:
            rows.append((evt.key, us / steps, evt.count / steps))
    if not rows:  # a CPU run (smoke test): host time by op instead
        rows = [(e.key, e.self_cpu_time_total / steps, e.count / steps) for e in prof.key_averages()]
    rows.sort(key=lambda r: -r[1])
    cats: dict[str, float] = {}
    for name, us, _ in rows:
        cats[_category(name)] = cats.get(_category(name), 0.0) + us
    return dict(
        total_us=round(sum(r[1] for r in rows), 1),
        by_category={k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        top=[[name[:90], round(us, 1), round(calls, 1)] for name, us, calls in rows[:top]],
    )


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _profile(fn: Callable[[], object], steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    with profile(activities=[ProfilerActivity.CPU, *gpu]) as prof:
        for _ in range(steps):
            fn()
        _sync()
    return kernel_table(prof, steps)


def profile_decode(engine, steps: int = 5) -> dict:
    """The decode-step profile of a NativeEngine after its rounds (module doc); slots are all done by then, so
    the steps rewrite cache positions nothing reads."""
    out: dict = {}
    bs, kv_len = max(engine.graph_batch_sizes), engine.kv_buckets[-1]
    key = (bs, kv_len, "sample")
    out["step"] = dict(batch=bs, kv_len=kv_len)
    graphs = engine.graphs
    with torch.no_grad():
        if graphs is not None:
            graphs.ensure(key)
            out["graphs"] = dict(
                captured=sum(g is not None for g in graphs.graphs.values()),
                failed=[list(k) for k, g in graphs.graphs.items() if g is None],
            )
            if graphs.graphs.get(key) is not None:
                out["graph_step_ms"] = round(graph_step_ms(lambda: graphs.run(key)), 3)
                out["graph_profile"] = _profile(lambda: graphs.run(key), steps)

        def eager() -> None:
            engine._decode_step(*key)

        for _ in range(2):
            eager()
        _sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            eager()
        host_ms = (time.perf_counter() - t0) / steps * 1e3  # launch-bound if >> the GPU time
        _sync()
        out["eager_step_wall_ms"] = round((time.perf_counter() - t0) / steps * 1e3, 3)
        out["eager_step_host_ms"] = round(host_ms, 3)
        out["eager_profile"] = _profile(eager, 2)
    return out


def graph_step_ms(run: Callable[[], object], reps: int = 10) -> float:
    """GPU milliseconds per call of `run` (a graph replay), median of `reps` after 3 warm-up calls."""
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def profile_line(name: str, p: dict) -> str:
    g = p.get("graphs", {})
    gp, ep = p.get("graph_profile", {}), p.get("eager_profile", {})
    return (
        f"profile [{name}] step bs={p['step']['batch']} kv={p['step']['kv_len']}: graphs {g.get('captured')} "
        f"captured, {len(g.get('failed', []))} failed {g.get('failed', [])[:4]}; graph replay "
        f"{p.get('graph_step_ms')} ms; eager {p.get('eager_step_wall_ms')} ms wall ({p.get('eager_step_host_ms')} "
        f"ms host); GPU us/step by category graph {gp.get('by_category')} eager {ep.get('by_category')}"
    )
