"""The native engine's fused decode kernels (relayrl/rollout/kernels.py), off against on, in one process.

    python bench/decode_kernels.py                          # one GPU, ~3 min: JSON to $OUT (or bench/results/)
    TRITON_INTERPRET=1 python bench/decode_kernels.py --device cpu --shapes tiny --prompts 4 --new-tokens 8 \
        --rounds 1 --check-prompts 2 --check-new 8 --micro-batch 4          # CPU smoke run (Triton interpreter)

Pieces, in this order, each written to the JSON as soon as it is done (a later failure keeps the earlier ones;
`--budget-s` skips what would start after it):
1. micro: each kernel against the torch code the engine runs without it, at the first shape's decode sizes
   (batch `--micro-batch`, positions drawn in [128, 256) and [256, 384) with the kv buckets 256 / 384 the
   engine's torch attention reads), every call inside a CUDA graph (so launch gaps count as in the engine),
   microseconds per call and the milliseconds a decode step would save (calls per step x difference); attention
   also at batch 16, where split-K matters.
2. per shape (trainable weights, as a colocated engine runs): w1 of bench/rollout.py (256 prompts x 128 ->
   256 tokens, no log-probs) with the kernels off and on: one full-size warm-up round, `--rounds` timed
   rounds (median, min-max), a prefill-only round; decode ms/step = (median - prefill) / 255, beside the floor.
3. correctness per shape: the same seeded requests (`--check-prompts` x n 4 -> `--check-new` tokens, log-probs)
   with the kernels off and on: samples identical, and |log-prob difference| over each sample's tokens up to
   its first differing token; each engine's log-probs against the trainer's forward (bench/rollout.py's
   --mismatch) on the same samples.
4. `--profile`: torch.profiler categories of the first shape's decode step with the kernels on (and off).
5. per shape, weights frozen (fused q/k/v and gate/up projections, native_fused.py): w1 off and on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rollout_engines import (  # noqa: E402  (the bench folder is put on the path first)
    Workload,
    build_model,
    mismatch,
    native_runner,
    param_counts,
    shape_config,
    time_rounds,
)
from rollout_profile import card_peaks, floors_ms, print_profile, profile_native  # noqa: E402

from relayrl.rollout import GenerationRequest, SamplingParams  # noqa: E402
from relayrl.rollout import kernels as K  # noqa: E402

T0 = time.perf_counter()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--shapes", default="0.5b,7b", help="comma list of bench/rollout_engines.py shapes (7b, 0.5b, tiny)")
    add("--micro-shape", default="7b", help="the shape whose decode sizes the micro-benchmarks use")
    add("--profile-shape", default="7b", help="the shape profiled with the kernels on and off")
    add("--device", default="cuda")
    add("--rounds", type=int, default=3)
    add("--prompts", type=int, default=256)
    add("--prompt-len", type=int, default=128)
    add("--new-tokens", type=int, default=256)
    add("--micro-batch", type=int, default=256)
    add("--check-prompts", type=int, default=16)
    add("--check-new", type=int, default=128)
    add("--no-frozen", action="store_true", help="skip piece 5 (fused projections)")
    add("--profile", action=argparse.BooleanOptionalAction, default=True)
    add("--profile-off", action="store_true", help="profile with the kernels off too (~10 s more at 7B)")
    add("--budget-s", type=float, default=200.0, help="start no piece after this many seconds")
    add("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_us(fn, device: str, reps: int = 20, iters: int = 10) -> float:
    """Microseconds per call of fn: `reps` calls captured in one CUDA graph, replayed `iters` times (CPU: a
    plain loop)."""
    fn()
    _sync(device)
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t0) / 3 * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * reps) * 1e3


def micro(shape: str, args) -> dict:
    """Kernel vs torch at `shape`'s decode sizes (module doc, piece 1)."""
    cfg = shape_config(shape)
    dev, dt, bs = (
        args.device,
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
        args.micro_batch,
    )
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d, max_len = hidden // heads, 384
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape_):
        return torch.randn(*shape_, generator=gen, device=dev, dtype=torch.float32).to(dt)

    x, r, w = rand(bs, hidden), rand(bs, hidden), 1 + 0.1 * rand(hidden)
    gu = rand(bs, 2 * inter)
    g_sep, u_sep = gu[:, :inter].contiguous(), gu[:, inter:].contiguous()
    qkv = rand(bs, (heads + 2 * kv) * d)
    q, k, v = (t.view(bs, -1, d) for t in qkv.split([heads * d, kv * d, kv * d], -1))
    cos, sin = rand(max_len, d), rand(max_len, d)
    k_cache, v_cache = rand(bs, kv, max_len, d), rand(bs, kv, max_len, d)
    rows = torch.arange(bs, device=dev)

    def rope_torch(pos):  # native_model.DecoderRunner.decode's lines
        dst = ((rows[:, None] * kv + torch.arange(kv, device=dev)) * max_len + pos[:, None]).view(-1)
        c, s = cos[pos][:, None], sin[pos][:, None]

        def run():
            qk = torch.cat((q, k), dim=1)
            qk = qk * c + qk.roll(d // 2, -1) * s
            k_cache.view(-1, d).index_copy_(0, dst, qk[:, heads:].reshape(-1, d))
            v_cache.view(-1, d).index_copy_(0, dst, v.reshape(-1, d))
            return qk[:, :heads]

        return run

    def sdpa_torch(qq, pos, kv_len, n):  # DecoderRunner._attend (sdpa) with its additive mask
        hide = torch.arange(kv_len, device=dev)[None, None, None, :] > pos[:, None, None, None]
        mask = torch.zeros(hide.shape, dtype=dt, device=dev).masked_fill_(hide, float("-inf"))
        ks, vs = k_cache[:n, :, :kv_len], v_cache[:n, :, :kv_len]
        q4 = qq.view(n, kv, heads // kv, d)
        return lambda: torch.nn.functional.scaled_dot_product_attention(
            q4, ks, vs, attn_mask=mask, scale=d**-0.5
        )

    out: dict = dict(shape=shape, batch=bs, dtype=str(dt), per_step_calls={})
    cases = {}
    cases["add+rms_norm"] = (
        2 * layers + 1,
        lambda: K.rms_norm_ref(x, w, 1e-6, r),
        lambda: K.rms_norm(x, w, 1e-6, r),
    )
    cases["silu_mul (gate_up slices)"] = (
        layers,
        lambda: K.silu_mul_ref(gu[:, :inter], gu[:, inter:]),
        lambda: K.silu_mul(gu[:, :inter], gu[:, inter:]),
    )
    cases["silu_mul (separate gate, up)"] = (
        layers,
        lambda: K.silu_mul_ref(g_sep, u_sep),
        lambda: K.silu_mul(g_sep, u_sep),
    )
    for lo, kv_len in ((128, 256), (256, 384)):
        pos = torch.randint(lo, kv_len, (bs,), generator=gen, device=dev)
        cases[f"rope+kv_write pos [{lo},{kv_len})"] = (
            layers,
            rope_torch(pos),
            lambda pos=pos: K.rope_kv_write(q, k, v, cos, sin, pos, k_cache, v_cache),
        )
        cases[f"attention pos [{lo},{kv_len}) bucket {kv_len}"] = (
            layers,
            sdpa_torch(q, pos, kv_len, bs),
            lambda pos=pos, kv_len=kv_len: K.decode_attention(q, k_cache, v_cache, pos, d**-0.5, kv_len),
        )
    small = min(16, bs)
    pos16 = torch.randint(256, 384, (small,), generator=gen, device=dev)
    q16 = q[:small].contiguous()
    cases[f"attention batch {small}, pos [256,384) bucket 384"] = (
        layers,
        sdpa_torch(q16, pos16, 384, small),
        lambda: K.decode_attention(q16, k_cache, v_cache, pos16, d**-0.5, 384),
    )
    for name, (calls, torch_fn, kernel_fn) in cases.items():
        ref, got = (_main_output(f()).float() for f in (torch_fn, kernel_fn))  # before timing: compiles
        diff = (ref.reshape(got.shape) - got).abs().max().item()
        t_torch, t_kernel = time_us(torch_fn, dev), time_us(kernel_fn, dev)
        out[name] = dict(max_abs_diff=diff, ref_max_abs=ref.abs().max().item(),
            torch_us=round(t_torch, 2), kernel_us=round(t_kernel, 2), speedup=round(t_torch / t_kernel, 2),
            calls_per_step=calls, step_ms_saved=round(calls * (t_torch - t_kernel) / 1e3, 3),
        )  # fmt: skip
        print(f"  {name:45s} torch {t_torch:8.1f} us  kernel {t_kernel:8.1f} us  x{t_torch / t_kernel:5.2f}"
              f"  ({calls}/step: {calls * (t_torch - t_kernel) / 1e3:+.3f} ms)  max diff {diff:.2e}", flush=True)  # fmt: skip
    out["attention splits at this batch / batch 16"] = [
        K.attention_splits(bs, kv, 384, torch.device(dev)),
        K.attention_splits(small, kv, 384, torch.device(dev)),
    ]
    return out


def _main_output(out) -> torch.Tensor:
    """The compared output of a case: rms_norm's normed tensor, the others' only one (flattened per row)."""
    t = out[0] if isinstance(out, tuple) else out
    return t.reshape(t.shape[0], -1)


def timed(shape: str, model, wl: Workload, label: str, kernels: bool, args) -> dict:
    """w1 on a fresh engine with the kernels off or on (module doc, piece 2)."""
    cfg = shape_config(shape)
    runner = native_runner(model, [wl], tp=1, opts={"fused_kernels": kernels})
    engine = runner.impl
    try:
        row, _ = time_rounds(runner, wl, cfg.vocab_size, args.rounds)
        graphs = engine.graphs.graphs if engine.graphs is not None else {}
        row["graphs_captured"] = sum(g is not None for g in graphs.values())
        row["graphs_eager"] = sum(g is None for g in graphs.values())  # a failed capture runs eagerly
    finally:
        runner.close()
    mean_new = wl.tokens / wl.samples
    peaks = card_peaks(args.device)
    row.update(
        shape=shape, config=label, kernels=engine.runner.kernels, fused_layers=engine.runner.fused_layers,
        startup_s=round(runner.startup_s, 3), batch=wl.samples,
        **floors_ms(cfg, param_counts(cfg), peaks, batch=wl.samples, ctx=wl.prompt_len + mean_new / 2),
    )  # fmt: skip
    if "floor_ms" in row:
        row["x_floor"] = row["decode_ms_per_step"] / row["floor_ms"]
    print(f"{shape} {label:16s} {row['tok_s_median']:9.0f} tok/s  decode {row['decode_ms_per_step']:6.2f} ms/step"
          f"  (rounds {row['seconds']}, start-up {row['startup_s']:.1f} s, kernels {row['kernels']})", flush=True)  # fmt: skip
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def check(shape: str, model, args) -> dict:
    """Seeded samples with the kernels off and on (module doc, piece 3)."""
    cfg = shape_config(shape)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, cfg.vocab_size, (args.check_prompts, args.prompt_len), generator=gen).tolist()
    reqs = [
        GenerationRequest(
            prompt_ids=p, params=SamplingParams(n=4, temperature=1.0, max_new_tokens=args.check_new, seed=i)
        )
        for i, p in enumerate(ids)
    ]
    wl = Workload("check", args.check_prompts, args.prompt_len, 4, args.check_new, True, 7)
    outs = {}
    for label, kernels in (("off", False), ("on", True)):
        runner = native_runner(model, [wl], tp=1, opts={"fused_kernels": kernels})
        try:
            outs[label] = runner.generate(reqs)
        finally:
            runner.close()
    same, total, diffs = 0, 0, []
    for (_, toks_a, lps_a), (_, toks_b, lps_b) in zip(outs["off"], outs["on"], strict=True):
        for ta, tb, la, lb in zip(toks_a, toks_b, lps_a, lps_b, strict=True):
            total += 1
            same += ta == tb
            # up to the first differing token (from there on the two samples condition on different prefixes)
            first = next((i for i, (a, b) in enumerate(zip(ta, tb, strict=True)) if a != b), len(ta))
            diffs += [abs(a - b) for a, b in zip(la[:first], lb[:first], strict=True)]
    dt = torch.tensor(diffs or [0.0])
    out = dict(
        samples=total, identical_samples=same, tokens_compared=len(diffs),
        tokens_compared_share=len(diffs) / max(1, total * args.check_new),
        logprob_abs_diff_mean=float(dt.mean()), logprob_abs_diff_p99=float(dt.quantile(0.99)),
        logprob_abs_diff_max=float(dt.max()),
    )  # fmt: skip
    for label in ("off", "on"):
        try:
            out[f"vs_trainer_{label}"] = mismatch(model, outs[label], 1.0, 64)
        except Exception as e:  # the comparison is extra: keep the rest
            out[f"vs_trainer_{label}"] = dict(error=f"{type(e).__name__}: {e}")
    print(f"{shape} check: {same}/{total} samples identical; |dlogprob| over {len(diffs)} shared tokens: mean "
          f"{out['logprob_abs_diff_mean']:.2e}, max {out['logprob_abs_diff_max']:.2e}", flush=True)  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "decode_kernels.json" if out_dir.suffix != ".json" else out_dir
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    result: dict = dict(
        meta=dict(
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), torch=torch.__version__,
            peaks=card_peaks(args.device), triton=K.triton.__version__ if K.triton is not None else None,
            args=vars(args), kernels_usable=K.usable(torch.device(args.device)),
        ),
        micro=None, rows=[], checks={}, profiles={}, errors=[],
    )  # fmt: skip

    def save() -> None:
        result["meta"]["elapsed_s"] = round(time.perf_counter() - T0, 1)
        path.write_text(json.dumps(result, indent=1))

    def piece(name: str, fn, *a):
        if time.perf_counter() - T0 > args.budget_s:
            result["errors"].append(f"{name}: skipped (past --budget-s {args.budget_s})")
            print(f"skip {name}: past the time budget", flush=True)
            save()
            return None
        try:
            return fn(*a)
        except Exception as e:  # one failed piece must not lose the others
            traceback.print_exc()
            result["errors"].append(f"{name}: {type(e).__name__}: {e}")
            return None
        finally:
            save()

    if not K.usable(torch.device(args.device)):
        result["errors"].append("kernels not usable here (triton missing, or CPU without TRITON_INTERPRET=1)")
        save()
        print(result["errors"][-1])
        return 1
    print(
        f"card: {result['meta']['peaks']['card']}; micro-benchmarks at the {args.micro_shape} shape:",
        flush=True,
    )
    result["micro"] = piece("micro", micro, args.micro_shape, args)
    wl = Workload("w1", args.prompts, args.prompt_len, 1, args.new_tokens, False, 1)
    for shape in shapes:
        model = build_model(shape, args.device, dtype)  # trainable, as the colocated engine's weights
        for label, kernels in (("off", False), ("on", True)):
            row = piece(f"{shape} {label}", timed, shape, model, wl, label, kernels, args)
            result["rows"].append(row or dict(shape=shape, config=label, error=True))
        _ratio(result, shape, "off", "on")
        result["checks"][shape] = piece(f"{shape} check", check, shape, model, args)
        if shape == args.profile_shape and args.device.startswith("cuda"):
            for label, kernels in (("on", True), ("off", False))[: 2 if args.profile_off else 1]:
                result["profiles"][f"{shape} {label}"] = piece(
                    f"{shape} profile {label}", profile, shape, model, wl, kernels, args
                )
        if not args.no_frozen:  # frozen weights: the engine fuses q/k/v and gate/up (native_fused.py)
            model.requires_grad_(False)
            for label, kernels in (("off+fused-proj", False), ("on+fused-proj", True)):
                row = piece(f"{shape} {label}", timed, shape, model, wl, label, kernels, args)
                result["rows"].append(row or dict(shape=shape, config=label, error=True))
            _ratio(result, shape, "off", "on+fused-proj")
        del model
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    save()
    print(f"wrote {path} ({time.perf_counter() - T0:.0f} s)")
    return 0


def profile(shape: str, model, wl: Workload, kernels: bool, args) -> dict:
    """Decode-step categories (bench/rollout_profile.py) of the engine with the kernels on or off."""
    runner = native_runner(model, [wl], tp=1, opts={"fused_kernels": kernels})
    try:
        prof = profile_native(runner, wl, shape_config(shape).vocab_size, 48, args.device)
    finally:
        runner.close()
    print_profile(prof, f"{shape} native, kernels {'on' if kernels else 'off'}, batch {wl.samples}")
    return prof


def _ratio(result: dict, shape: str, base: str, new: str) -> None:
    rows = {
        r.get("config"): r for r in result["rows"] if r.get("shape") == shape and "decode_ms_per_step" in r
    }
    if base in rows and new in rows:
        a, b = rows[base], rows[new]
        result.setdefault("speedups", {})[f"{shape} {new} / {base}"] = dict(
            tok_s=round(b["tok_s_median"] / a["tok_s_median"], 3),
            decode_ms_per_step=[round(a["decode_ms_per_step"], 3), round(b["decode_ms_per_step"], 3)],
            step_ratio=round(a["decode_ms_per_step"] / max(1e-9, b["decode_ms_per_step"]), 3),
        )
        print(f"{shape}: {new} / {base} = {b['tok_s_median'] / a['tok_s_median']:.3f}x tok/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
