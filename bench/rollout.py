"""Rollout throughput, engine against engine on the same requests, warmed and timed fairly.

    python bench/rollout.py --shapes 0.5b,7b --engines native,vllm-default,vllm-tuned --workloads w1,w2,w3
    python bench/rollout.py --shapes 32b --tp 4 --engines vllm-tuned                 # vLLM's 32B over 4 GPUs
    torchrun --standalone --nproc_per_node=4 bench/tp_decode.py --shape qwen2.5-32b --tp 2 4 --profile 4 --rounds 3
                                                                                     # the native engine's TP rows
    python bench/rollout.py --shapes 7b --profile                                    # where a decode step goes
    python bench/rollout.py --shapes tiny --device cpu --engines native,hf --rounds 2 \
        --prompts 16 --new-tokens 32 --n-prompts 4 --n 4 --n-new-tokens 32 --w3-prompts 16 --w3-max-new 32

Every engine runs every workload as: one full-size warm-up round (the timed workload's shape, so one-time
costs -- CUDA graph capture, torch.compile, allocator growth, cuBLAS heuristics -- are paid there), then
`--rounds` timed rounds (>= 3 for a reported number), each with fresh random prompts (seeded by workload and
round, the same for every engine, so no engine's prefix cache sees a repeated prompt), then one prefill-only
round (max_new_tokens=1) of the same shape. Reported: tokens/s median, min and max over the timed rounds;
decode ms per step = (median round - prefill round) / (longest completion - 1); and beside it the compute and
bandwidth floors of that step for the batch on this card (bench/rollout_profile.py). Sampling: temperature
1, top_p 1, top_k 0; EOS ignored by every engine (random weights would make EOS lengths a coin toss).

Workloads (prompts of --prompt-len 128 random tokens):
    w1  256 prompts -> exactly 256 new tokens each, no log-probs
    w2  64 prompts x n=8 -> exactly 512 new tokens each, log-probs (the GRPO shape: n samples, one prefill)
    w3  512 prompts -> request i stops after lengths[i] tokens, lengths drawn once from a fixed seed (16 + an
        exponential of mean 512/3, cut at 512: mean ~180, ~5% cut), log-probs: variable-length RL sampling,
        where slots free up at different steps. Chosen over EOS stopping so that every engine does exactly
        the same work; the native engine knows each sample's end in advance (it syncs with the host when
        one is due), which with EOS it would only see at its next sync (<= --sync-every steps later).

Engines (bench/rollout_engines.py): native, hf (transformers.generate, CPU reference), vllm-default (vLLM's
own `LLM(...)` defaults), vllm-tuned (settings from vLLM's tuning guide, listed there and in the JSON).
Shapes: Qwen2.5 0.5b, 7b, 32b (random bf16 weights on CUDA, fp32 on CPU) and tiny. `--tp N` passes N to
vLLM (tensor_parallel_size); the native engine's tensor parallelism is a group of ranks (TPNativeEngine under
torchrun), so its TP rows come from bench/tp_decode.py (the same warm-up, median rounds and floors; w1's
shape) and a native row here with --tp > 1 is skipped with that reason.
On CUDA each (shape, engine) runs in its own process (the card to itself; a crash or OOM is reported as an
error row); vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set). Prints a table and writes
JSON to --out (a folder: a file named after the shapes, engines and workloads; or a .json path).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from relayrl.rollout import build_engine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from rollout_engines import (  # noqa: E402  (the bench folder is put on the path first)
    ALIASES,
    SHAPES,
    VLLM_TUNED,
    Runner,
    build_model,
    mismatch,
    native_runner,
    param_counts,
    shape_config,
    time_rounds,
    vllm_folder,
    vllm_runner,
    workloads,
)
from rollout_profile import card_peaks, floors_ms, print_profile, profile_native  # noqa: E402

ENGINES = ("native", "hf", "vllm-default", "vllm-tuned")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = ap.add_argument
    add("--shapes", default="0.5b", help=f"comma list of {', '.join(SHAPES)}")
    add("--engines", default="native", help=f"comma list of {', '.join(ENGINES)}")
    add("--workloads", default="w1,w2,w3", help="comma list of w1, w2, w3")
    add("--rounds", type=int, default=3, help="timed rounds per workload (after one full warm-up round)")
    add("--tp", type=int, default=1, help="tensor-parallel size for the engines (native: tp_size)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    add("--prompts", type=int, default=256, help="w1 prompts")
    add("--prompt-len", type=int, default=128)
    add("--new-tokens", type=int, default=256, help="w1 new tokens")
    add("--n", type=int, default=8, help="w2 samples per prompt")
    add("--n-prompts", type=int, default=64, help="w2 prompts")
    add("--n-new-tokens", type=int, default=512, help="w2 new tokens")
    add("--w3-prompts", type=int, default=512)
    add("--w3-max-new", type=int, default=512, help="w3's longest completion (the length cap)")
    add("--layers", type=int, default=0, help="override the shape's layer count (smoke runs)")
    add("--decode-attention", default="auto", help="native: sdpa | math | auto")
    add("--sync-every", type=int, default=16, help="native: decode steps between host syncs")
    add("--no-graphs", action="store_true", help="native: decode eagerly (no CUDA graphs)")
    add(
        "--kv-bucket",
        type=int,
        default=0,
        help="native: attended-length granularity (default 256 with graphs)",
    )
    add("--vllm-default-args", default="{}", help="vllm-default: extra LLM(...) arguments, JSON")
    add("--vllm-tuned-args", default="{}", help="vllm-tuned: LLM(...) arguments overriding VLLM_TUNED, JSON")
    add("--vllm-real-weights", action="store_true", help="vLLM loads the bench's model, not dummy weights")
    add("--mismatch", type=int, default=0, help="native, w2: compare N samples' log-probs with the trainer's")
    add("--profile", action="store_true", help="profile the native engine's decode steps (torch.profiler)")
    add("--profile-steps", type=int, default=48, help="new tokens of the profiled round")
    add("--peak-tflops", type=float, default=0.0, help="override the card's bf16 dense TFLOP/s")
    add("--peak-tbs", type=float, default=0.0, help="override the card's HBM TB/s")
    add("--isolate", choices=("auto", "yes", "no"), default="auto",
        help="one process per (shape, engine); auto: yes on CUDA")  # fmt: skip
    add("--threads", type=int, default=1, help="torch threads on --device cpu")
    add("--out", default=str(ROOT / "bench" / "results"), help="a folder or a .json path")
    add("--child-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.shapes = [ALIASES.get(s, s) for s in args.shapes.split(",")]
    args.engines = args.engines.split(",")
    args.workloads = args.workloads.split(",")
    for what, got, known in (
        ("--shapes", args.shapes, SHAPES), ("--engines", args.engines, ENGINES), ("--workloads", args.workloads, ("w1", "w2", "w3"))
    ):  # fmt: skip
        bad = [g for g in got if g not in known]
        if bad:
            ap.error(f"{what}: unknown {bad}; choose from {', '.join(known)}")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1 (3 or more for a reported number)")
    if any(e.startswith("vllm") for e in args.engines) and importlib.util.find_spec("vllm") is None:
        ap.error("vllm-* engines need the vllm package importable (PYTHONPATH or pip install vllm)")
    return args


def dtype_of(args) -> torch.dtype:
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if args.device.startswith("cuda") else torch.float32


def make_runner(engine: str, shape: str, model, wls: list, args, folder: str | None = None) -> Runner:
    """The engine under test, sized for the workloads `wls` (NotImplementedError: this engine cannot)."""
    if engine == "native":
        opts = dict(decode_attention=args.decode_attention, sync_every=args.sync_every)
        if args.no_graphs:
            opts["cuda_graphs"] = False
        if args.kv_bucket:
            opts["kv_bucket"] = args.kv_bucket
        return native_runner(model, wls, tp=args.tp, opts=opts)
    if engine == "hf":
        hf = build_engine("hf", model, None, eos_token_id=[], max_batch=max(w.samples for w in wls))
        return Runner("hf", 0.0, {}, hf)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    folder = folder or vllm_folder(shape, args.layers)
    extra = json.loads(args.vllm_tuned_args if engine == "vllm-tuned" else args.vllm_default_args)
    return vllm_runner(
        engine, folder, dtype_of(args), wls, tp=args.tp, dummy=not args.vllm_real_weights, extra=extra
    )


def run_piece(shape: str, engine: str, args) -> list[dict]:
    """Every asked workload on one engine of one shape (in this process). The native and hf engines are built
    per workload, sized to it (max_slots = its batch, max_seq_len = prompt + its longest completion: what an
    RL run configures); vLLM once for all (its start-up is minutes; its paged KV makes the size moot)."""
    wls = [workloads(args)[w] for w in args.workloads]
    config = shape_config(shape, args.layers)
    base = dict(shape=shape, engine=engine, tp=args.tp)
    model = folder = None
    if engine in ("native", "hf") or args.vllm_real_weights:
        model = build_model(shape, args.device, dtype_of(args), args.layers)
    per_workload = engine in ("native", "hf")
    if not per_workload and model is not None:  # vLLM loads the saved model: free the card for it
        folder = vllm_folder(shape, args.layers, model)
        model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    try:
        shared = None if per_workload else make_runner(engine, shape, model, wls, args, folder)
    except NotImplementedError as e:
        return [dict(base, workload=w.name, skipped=str(e)) for w in wls]
    rows = []
    peaks = card_peaks(args.device, args.peak_tflops, args.peak_tbs)
    counts = param_counts(config)
    for wl in wls:
        try:
            runner = shared or make_runner(engine, shape, model, [wl], args)
        except NotImplementedError as e:
            rows.append(dict(base, workload=wl.name, skipped=str(e)))
            continue
        row, samples = time_rounds(runner, wl, config.vocab_size, args.rounds)
        mean_new = wl.tokens / wl.samples
        batch = wl.tokens / wl.longest  # w1, w2: every sample; w3: the mean live batch over the steps
        row.update(base, workload=wl.name, startup_s=runner.startup_s, settings=runner.settings,
                   batch=batch, context=wl.prompt_len + mean_new / 2)  # fmt: skip
        row.update(
            floors_ms(config, counts, peaks, batch=batch, ctx=wl.prompt_len + mean_new / 2, tp=args.tp)
        )
        if "floor_ms" in row:
            row["x_floor"] = row["decode_ms_per_step"] / row["floor_ms"]
        if args.mismatch and engine == "native" and wl.name == "w2":
            row["mismatch"] = mismatch(model, samples, 1.0, args.mismatch)
        rows.append(row)
        print(f"{shape} {wl.name} {engine:12s} {row['tok_s_median']:10.0f} tok/s (median of {args.rounds}; "
              f"{row['tok_s_min']:.0f}-{row['tok_s_max']:.0f})  warm-up round {row['warmup_s']:.2f} s", flush=True)  # fmt: skip
        if runner is not shared:
            runner.close()
    if args.profile and engine == "native" and rows and "skipped" not in rows[0]:
        runner = make_runner(engine, shape, model, wls[:1], args)
        prof = profile_native(runner, wls[0], config.vocab_size, args.profile_steps, args.device)
        print_profile(prof, f"{shape} native, batch {wls[0].samples}")
        rows.append(dict(base, workload=f"{wls[0].name}-profile", profile=prof))
        runner.close()
    if shared is not None:
        shared.close()
    return rows


def run_isolated(shape: str, engine: str, args, argv: list[str]) -> list[dict]:
    """run_piece in a child process; a failed child becomes an error row."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        keep = _strip(argv, {"--shapes", "--engines", "--out", "--isolate", "--child-out"})
        cmd = [sys.executable, __file__, *keep, "--shapes", shape, "--engines", engine, "--isolate", "no",
               "--child-out", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, stdout=None, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(proc.stderr[-4000:] if proc.returncode else "")
        if proc.returncode == 0 and out.is_file():
            return json.loads(out.read_text())
        tail = proc.stderr.strip().splitlines()[-3:]
        return [
            dict(shape=shape, engine=engine, tp=args.tp, workload=w, error=" | ".join(tail))
            for w in args.workloads
        ]


def _strip(argv: list[str], flags: set[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a.split("=", 1)[0] in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    isolate = args.isolate == "yes" or (args.isolate == "auto" and args.device.startswith("cuda"))
    rows: list[dict] = []
    for shape in args.shapes:
        for engine in args.engines:
            if isolate:
                rows += run_isolated(shape, engine, args, argv)
                continue
            try:
                rows += run_piece(shape, engine, args)
            except Exception as e:  # one engine's failure must not hide the others' numbers
                if args.child_out:
                    raise
                traceback.print_exc()
                rows += [
                    dict(shape=shape, engine=engine, tp=args.tp, workload=w, error=repr(e)[:300])
                    for w in args.workloads
                ]
    if args.child_out:
        Path(args.child_out).write_text(json.dumps(rows))
        return 0
    report(rows, args)
    return 0


def report(rows: list[dict], args) -> Path:
    peaks = card_peaks(args.device, args.peak_tflops, args.peak_tbs)
    print(
        f"\n{peaks['card']}  peaks: {peaks['tflops']} TFLOP/s bf16 dense, {peaks['tbs']} TB/s ({peaks['source']})"
    )
    print(f"{'shape':5s} {'wl':3s} {'engine':13s} {'tok/s median':>12s} {'min-max':>15s} {'vs tuned':>8s} "
          f"{'ms/step':>8s} {'floor c/bw':>13s} {'x floor':>7s} {'start s':>7s} {'warm s':>7s}")  # fmt: skip
    for r in rows:
        if "profile" in r:
            continue
        head = f"{r['shape']:5s} {r['workload']:3s} {r['engine']:13s}"
        if "tok_s_median" not in r:
            print(
                f"{head} {(r.get('skipped') and 'skipped: ' + r['skipped']) or 'error: ' + r.get('error', '?')}"
            )
            continue
        tuned = next((t for t in rows if t.get("engine") == "vllm-tuned" and t["shape"] == r["shape"]
                      and t["workload"] == r["workload"] and "tok_s_median" in t), None)  # fmt: skip
        vs = f"{r['tok_s_median'] / tuned['tok_s_median']:7.2f}x" if tuned else "       -"
        fl = f"{r['compute_floor_ms']:5.2f}/{r['bandwidth_floor_ms']:5.2f}" if "floor_ms" in r else "-"
        xf = f"{r['x_floor']:6.1f}x" if "x_floor" in r else "      -"
        print(f"{head} {r['tok_s_median']:12.0f} {r['tok_s_min']:7.0f}-{r['tok_s_max']:<7.0f} {vs} "
              f"{r['decode_ms_per_step']:8.2f} {fl:>13s} {xf} {r['startup_s']:7.1f} {r['warmup_s']:7.2f}")  # fmt: skip
    out = Path(args.out)
    if out.suffix != ".json":
        out = (
            out / f"rollout_{'-'.join(args.shapes)}_{'-'.join(args.engines)}_{'-'.join(args.workloads)}.json"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    wls = workloads(args)
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        peaks=peaks,
        torch=torch.__version__,
        rounds=args.rounds,
        tp=args.tp,
        workloads={w: vars(wls[w]) for w in args.workloads},
        vllm_tuned={k: dict(value=v, why=why) for k, (v, why) in VLLM_TUNED.items()},
        timing="1 full-size warm-up round, then --rounds timed rounds (fresh prompts each); median/min/max",
        sampling="temperature 1, top_p 1, top_k 0; EOS ignored; lengths fixed per request",
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2, default=str))
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
