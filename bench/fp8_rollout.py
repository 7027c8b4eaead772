"""FP8 rollout (rollout.quantization fp8) against bf16 on one GPU: decode tokens/s, the refresh cost, and the
log-prob mismatch each engine adds against the trainer's bf16 forward, on the same model and prompts.

    python bench/fp8_rollout.py                                  # Qwen2.5-7B shape, random bf16 weights, one GPU
    python bench/fp8_rollout.py --shape tiny --device cpu --prompts 8 --new-tokens 16 --rounds 1   # CPU smoke run
    python bench/fp8_rollout.py --gemm-check --profile            # + per-GEMM check at 7B widths, step profile
    python bench/fp8_rollout.py --profile --sampler new,old --sampler-bench   # the sampler's share (below)
    python bench/fp8_rollout.py --profile --phases 2 --phases-sync-every 64   # where a decode step's time goes

Setup (bench/rollout.py's shapes, model builder, workload, timing and mismatch code, bench/rollout_engines.py):
one random-weight bf16 model of the shape (seed 0), frozen (an engine's own copy: the bf16 engine runs its
fused q/k/v and gate/up GEMMs, its strongest layout). For each engine, bf16 then fp8 (the other one closed first):
  - build the native engine over the model (max_slots = prompts, max_seq_len = prompt + new tokens, CUDA
    graphs, the fused decode kernels where triton imports, --fused-kernels off for the plain ops; fp8: the
    projections quantised on the device, the per-token activation quantisers as Triton kernels, fast
    accumulation; engine "fp8-slowacc": the same with torch._scaled_mm's slow accumulation, "fp8-cublas":
    cuBLAS's per-tensor fp8 GEMM plus a rescaling kernel for every projection instead of fp8.GEMM's choice
    per projection (the row-wise kernel for gate/up, cuBLAS for q/k/v, o and down at decode sizes), "fp8-unfused":
    the per-projection quantisers (fp8.FUSED off) and CUTLASS everywhere, the engine before the fused decode);
  - workload: --prompts random prompts of --prompt-len tokens -> exactly --new-tokens new tokens each,
    temperature 1, log-probs; one warm-up round, --rounds timed rounds (fresh prompts each), one prefill-only
    round: tokens/s median and decode ms per step (bench/rollout.py's definitions);
  - refresh: engine.load_weights(None) timed (median of 3, synchronised): what every RL step pays on top of
    the trainer's own weight update (fp8: re-quantising every projection; bf16: nothing);
  - mismatch over the last timed round's samples: the engine's sampled-token log-probs against the trainer's
    bf16 forward (relayrl.models.forward.token_logprobs, the layout the trainer uses on this device) over the
    same tokens: mean / p99 / max |diff| and the share of sequences whose ratio is outside [0.5, 2].
Random weights make near-uniform next-token distributions, so the mismatch here is that of a random model;
the GPU learning check (bench/fp8_learn.py) measures it on a trained one.

--gemm-check (first, before the model is built; with the fused norm kernels' check) and --profile (per engine, after its rounds): bench/fp8_check.py
(the per-GEMM time and error at 7B widths, bf16 against fp8 fast / slow accumulation and the quantiser kernel
against the torch ops; the engine's CUDA graph captures, its largest decode step as graph replays and as one
eager step, torch.profiler's kernel table). One summary line per engine and per GEMM row goes to stdout.

--sampler new,old: each engine once per sampler (sampling.FAST: "new" the Triton kernel, sampling.py's CUDA
default; "old" the torch ops, sampling.sample_tokens_ref), rows "bf16", "fp8", "bf16/old-sampler", ...; each
row's `sampler_us` is the GPU time of the sampler its decode graphs captured (bench/sampler.py
engine_sampler_us, at the largest graph batch) and its profile's "sampler" category the sampler's own kernels
(the new kernel; the old path's scan / softmax / argmax kernels, its elementwise ones stay under "other").
--sampler-bench (first): bench/sampler.py's micro-benchmark of sample_tokens alone at [256, 151936], old vs
new, us per call and token agreement over 102,400 draws (~10 s).

--phases N (per engine, after its timed rounds): N more rounds under bench/decode_phases.PhaseProbe, which
splits each round on the GPU's clock: head, prefill, the in-round decode step (prefill end -> last step end, per
step: `decode_ms_per_step_inround`, no prefill-only round subtracted) = the mean replay of a step in the round
(per kv bucket) + GPU idle between queued steps + GPU idle across the host's syncs; the host's time per replay
launch, retire wait and work; the tail. Then each kv bucket's graph of the largest batch replayed alone (as
`graph_step_ms`) and 16 queued, and the SM clock / power sampled by nvidia-smi since before the timed rounds.
--phases-sync-every K: one more probed round with the engine syncing every K steps instead of 16.

Robustness: every finished piece is written to the JSON at once; --budget-s (default 225 s) stops the run with
the partial results written (exit 3) before the coordinator's 4-minute limit. Exit 2 when the device cannot run
fp8 (compute capability < 8.9). Writes $OUT/fp8_rollout.json (OUT unset: bench/results/fp8_rollout.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_phases import ClockSampler, phases_line, replay_table, run_probed  # noqa: E402
from fp8_check import fused_check, gemm_check, profile_decode, profile_line  # noqa: E402
from rollout_engines import Workload, build_model, mismatch, native_runner, shape_config, time_rounds  # noqa: E402
from sampler import engine_sampler_us, micro, micro_line  # noqa: E402

from relayrl.rollout import fp8, sampling  # noqa: E402
from relayrl.rollout.fp8 import FP8Runner, FP8Unsupported, check_device  # noqa: E402

DEFAULT_GEMM = dict(fp8.GEMM)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = ap.add_argument
    add("--shape", default="7b", help="tiny | 0.5b | 7b | 32b (bench/rollout_engines.py SHAPES)")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--engines", default="bf16,fp8", help="comma list of bf16, fp8, fp8-unfused, fp8-slowacc, fp8-cublas")
    add("--gemm-check", action="store_true", help="per-GEMM time and error at 7B widths first (GPU)")
    add("--profile", action="store_true", help="each engine's decode-step profile after its rounds (GPU)")
    add("--prompts", type=int, default=256)
    add("--prompt-len", type=int, default=128)
    add("--new-tokens", type=int, default=256)
    add("--rounds", type=int, default=2, help="timed rounds (after one warm-up round)")
    add("--mismatch-samples", type=int, default=256, help="samples compared with the trainer's forward")
    add("--layers", type=int, default=0, help="override the shape's layer count (smoke runs)")
    add("--fused-kernels", choices=("auto", "off"), default="auto",
        help="the native engine's fused decode kernels (rollout.fused_kernels) for both engines")  # fmt: skip
    add("--sampler", default="new", help="comma list of new (the Triton sampler), old (the torch ops)")
    add("--sampler-bench", action="store_true", help="bench/sampler.py's micro-benchmark first (GPU)")
    add("--phases", type=int, default=0,
        help="probed rounds per engine after the timed ones: the in-round decode step's parts (decode_phases.py)")  # fmt: skip
    add("--phases-sync-every", type=int, default=0,
        help="with --phases: one more probed round with the engine's sync_every set to this (default 16)")  # fmt: skip
    add("--budget-s", type=float, default=225.0, help="stop with partial results after this many seconds")
    add(
        "--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"), help="folder or .json path"
    )
    return ap.parse_args(argv)


class Report:
    """The JSON written after every piece (so a killed run leaves what it finished)."""

    def __init__(self, out: str) -> None:
        path = Path(out)
        self.path = path if path.suffix == ".json" else path / "fp8_rollout.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.data: dict = {}

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=2) + "\n")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def refresh_ms(engine, device: str, repeats: int = 3) -> float:
    """Median ms of engine.load_weights(None) (the end of every weight transport: fp8 re-quantises)."""
    times = []
    for v in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        engine.load_weights(None, version=v + 1)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_engine(name: str, model, wl: Workload, vocab: int, args, sampler: str = "new") -> dict:
    """Build, time, refresh and compare one engine (`sampler`: new / old, module doc); returns its row."""
    sampling.FAST = sampler == "new"  # read when the engine captures its decode graphs
    opts: dict = {"quantization": "fp8"} if name.startswith("fp8") else {}
    if args.fused_kernels == "off":
        opts["fused_kernels"] = False
    fp8.FAST_ACCUM = name != "fp8-slowacc"  # all three read when the engine's FP8Linears are built
    fp8.FUSED = name != "fp8-unfused"
    fp8.GEMM = dict(DEFAULT_GEMM)
    if name in ("fp8-cublas", "fp8-unfused"):
        fp8.GEMM = dict.fromkeys(DEFAULT_GEMM, "cublas" if name == "fp8-cublas" else "cutlass")
    runner = native_runner(model, [wl], tp=1, opts=opts)
    clocks = None
    try:
        engine = runner.impl
        row: dict = {"startup_s": round(runner.startup_s, 2), "sampler": sampler}
        row["fused_kernels"] = bool(getattr(engine.runner, "kernels", False))
        if isinstance(engine.runner, FP8Runner):
            r = engine.runner
            row.update(
                fp8_gemms=r.quantized, skipped=r.skipped, emulated=r.emulate, quant_kernels=r.quant_kernels,
                fast_accum=r.fast_accum, gemm=dict(fp8.GEMM), fused=r.fused,
            )  # fmt: skip
        clocks = ClockSampler().start() if args.phases and args.device.startswith("cuda") else None
        timing, samples = time_rounds(runner, wl, vocab, args.rounds)
        row.update(timing)
        if args.phases:
            try:  # a diagnostic, as the profile: its failure is recorded, the row stands
                probe_rounds(name, runner, wl, vocab, args, row, clocks)
            except Exception as e:
                row["phases"] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
                print(f"phases [{name}] ERROR {row['phases']['error']}", flush=True)
        row["refresh_ms"] = round(refresh_ms(engine, args.device), 3)
        if args.device.startswith("cuda"):
            try:
                row["sampler_us"] = engine_sampler_us(engine)
            except Exception as e:  # a diagnostic, as the profile
                row["sampler_us"] = f"{type(e).__name__}: {e}"
        if args.profile and args.device.startswith("cuda"):
            try:
                row["profile"] = profile_decode(engine)
                print(profile_line(name, row["profile"]), flush=True)
            except Exception as e:  # the profile is a diagnostic: its failure is recorded, the row stands
                row["profile"] = {"error": f"{type(e).__name__}: {e}"}
        row["mismatch"] = mismatch(model, samples, 1.0, args.mismatch_samples)
        if args.device.startswith("cuda"):
            row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        return row
    finally:
        sampling.FAST = True
        if clocks is not None:
            clocks.stop()  # a failed round leaves no nvidia-smi behind
        runner.close()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()


def probe_rounds(name: str, runner, wl: Workload, vocab: int, args, row: dict, clocks) -> None:
    """--phases more rounds under bench/decode_phases.PhaseProbe (row["phases"]["rounds"]: each round's split,
    with `old_formula_ms_per_step`, the round's (wall - the prefill-only round) / steps as time_rounds computes
    it), then with --phases-sync-every one round at that sync interval ("rounds_sync_every"), the graph
    replay table and the clocks sampled since before the timed rounds; row["decode_ms_per_step_inround"]:
    the median in-round decode step (prefill end -> last step end, per step; no prefill-only round in it)."""
    engine, reports, resync = runner.impl, [], []
    default_sync = engine.sync_every

    def probed(i: int) -> dict:
        reqs = wl.requests(vocab, 1000 + i)
        rep, _ = run_probed(engine, lambda: runner.generate(reqs))
        rep["old_formula_ms_per_step"] = round(
            max(0.0, rep["wall_ms"] - row["prefill_s"] * 1e3) / max(1, wl.longest - 1), 4
        )
        return rep

    try:
        reports = [probed(i) for i in range(args.phases)]
        if args.phases_sync_every:
            engine.sync_every = (
                args.phases_sync_every
            )  # read at every round (NativeEngine._steps_before_sync)
            resync = [dict(probed(args.phases), sync_every=args.phases_sync_every)]
        try:  # the rounds above stand if the table fails
            table = replay_table(engine) if engine.device.type == "cuda" else {}
        except Exception as e:
            table = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    finally:
        engine.sync_every = default_sync
        clk = clocks.stop() if clocks is not None else None
    row["phases"] = dict(rounds=reports, rounds_sync_every=resync, replay_table=table, clocks=clk)
    row["decode_ms_per_step_inround"] = round(statistics.median(r["decode_ms_per_step"] for r in reports), 4)
    print(phases_line(name, reports, table, clk), flush=True)
    print(f"phases [{name}] prefill in-round {reports[0]['prefill_ms']:.1f} ms vs the prefill-only round "
          f"{row['prefill_s'] * 1e3:.1f} ms; this round by time_rounds' formula {reports[0]['old_formula_ms_per_step']}"
          " ms/step", flush=True)  # fmt: skip
    if resync:
        print(phases_line(f"{name} sync_every={args.phases_sync_every}", resync), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    rep = Report(args.out)
    rep.data = dict(
        bench="fp8_rollout",
        argv=sys.argv[1:] if argv is None else argv,
        shape=args.shape,
        layers=args.layers or None,
        workload=dict(prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens),
        torch=torch.__version__,
        host=platform.node(),
        device=torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        engines={},
    )

    def out_of_time(signum, frame):
        raise TimeoutError(f"--budget-s {args.budget_s} reached")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(max(1, int(args.budget_s)))
    try:
        try:
            rep.data["real_fp8"] = check_device(torch.device(args.device))
        except FP8Unsupported as e:
            rep.data["error"] = str(e)
            rep.write()
            print(e, file=sys.stderr)
            return 2
        if args.device.startswith("cuda"):
            rep.data["capability"] = list(torch.cuda.get_device_capability())
        if args.gemm_check and args.device.startswith("cuda"):
            print(f"[fp8_rollout {time.perf_counter() - t0:.0f}s] per-GEMM check at 7B widths", flush=True)
            rep.data["gemm_check"] = gemm_check()
            rep.write()
            try:  # a diagnostic: its failure is recorded, the run goes on
                rep.data["fused_check"] = fused_check()
            except Exception as e:
                rep.data["fused_check"] = {"error": f"{type(e).__name__}: {e}"}
                print(f"fused norm+quant check ERROR {rep.data['fused_check']['error']}", flush=True)
            rep.write()
        if args.sampler_bench and args.device.startswith("cuda"):
            print(f"[fp8_rollout {time.perf_counter() - t0:.0f}s] sampler micro-benchmark", flush=True)
            try:  # a diagnostic: its failure is recorded, the run goes on
                rep.data["sampler_micro"] = micro()
                print(micro_line(rep.data["sampler_micro"]), flush=True)
            except Exception as e:
                rep.data["sampler_micro"] = {
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc(),
                }
                print(f"sampler micro-benchmark ERROR {rep.data['sampler_micro']['error']}", flush=True)
            rep.write()
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = build_model(args.shape, args.device, dtype, args.layers)
        model.requires_grad_(False)
        vocab = shape_config(args.shape, args.layers).vocab_size
        wl = Workload("w1", args.prompts, args.prompt_len, 1, args.new_tokens, True, 1)
        rep.data["model_build_s"] = round(time.perf_counter() - t0, 1)
        rep.write()
        samplers = args.sampler.split(",")
        if not set(samplers) <= {"new", "old"}:
            raise SystemExit(f"--sampler {args.sampler!r}: a comma list of new, old")
        runs = [(e, smp) for smp in samplers for e in args.engines.split(",")]
        for engine_name, smp in runs:
            name = engine_name if smp == "new" else f"{engine_name}/old-sampler"
            print(f"[fp8_rollout {time.perf_counter() - t0:.0f}s] {name} engine", flush=True)
            try:
                rep.data["engines"][name] = run_engine(engine_name, model, wl, vocab, args, smp)
            except TimeoutError:
                raise
            except Exception as e:  # one engine's failure is a row, the other still runs
                rep.data["engines"][name] = {
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc(),
                }
            rep.write()
            print(summary_line(name, rep.data["engines"][name]), flush=True)
        rows = rep.data["engines"]
        for base in ("bf16", "fp8"):  # the sampler's gain per engine
            new, old = rows.get(base, {}), rows.get(f"{base}/old-sampler", {})
            if new.get("decode_ms_per_step") and old.get("decode_ms_per_step"):
                gain = round(old["decode_ms_per_step"] / new["decode_ms_per_step"], 3)
                rep.data.setdefault("sampler_gain_decode_step", {})[base] = gain
                print(f"{base}: decode step old sampler {old['decode_ms_per_step']:.2f} ms -> new "
                      f"{new['decode_ms_per_step']:.2f} ms ({gain}x)", flush=True)  # fmt: skip
        old_b, old_f = rows.get("bf16/old-sampler", {}), rows.get("fp8/old-sampler", {})
        if old_b.get("decode_ms_per_step") and old_f.get("decode_ms_per_step"):
            rep.data["speedup_decode_step_old_sampler"] = round(
                old_b["decode_ms_per_step"] / old_f["decode_ms_per_step"], 3
            )
        bf16, fp8 = rows.get("bf16", {}), rows.get("fp8", {})
        if "tok_s_median" in bf16 and "tok_s_median" in fp8:
            rep.data["speedup_tok_s"] = round(fp8["tok_s_median"] / bf16["tok_s_median"], 3)
            rep.data["speedup_decode_step"] = (  # a tiny CPU run's decode time can round to 0
                round(bf16["decode_ms_per_step"] / fp8["decode_ms_per_step"], 3)
                if fp8["decode_ms_per_step"]
                else None
            )
            print(f"fp8 vs bf16: tok/s {rep.data['speedup_tok_s']}x, decode step {rep.data['speedup_decode_step']}x "
                  "(target >= 1.4x)", flush=True)  # fmt: skip
        if bf16.get("decode_ms_per_step_inround") and fp8.get("decode_ms_per_step_inround"):
            rep.data["speedup_decode_step_inround"] = round(
                bf16["decode_ms_per_step_inround"] / fp8["decode_ms_per_step_inround"], 3
            )
            print(f"fp8 vs bf16: in-round decode step {rep.data['speedup_decode_step_inround']}x", flush=True)
        for name, row in rep.data["engines"].items():  # the variants, against the same bf16 row
            if (
                name.startswith("fp8-")
                and "/" not in name
                and "tok_s_median" in row
                and "tok_s_median" in bf16
            ):
                ratio = round(row["tok_s_median"] / bf16["tok_s_median"], 3)
                rep.data.setdefault("speedup_tok_s_variants", {})[name] = ratio
                print(f"{name} vs bf16: tok/s {ratio}x", flush=True)
    except TimeoutError as e:
        rep.data["stopped"] = str(e)
        rep.write()
        print(f"stopped: {e}; partial results in {rep.path}", file=sys.stderr)
        return 3
    finally:
        signal.alarm(0)
    rep.data["seconds"] = round(time.perf_counter() - t0, 1)
    rep.write()
    keys = ("speedup_tok_s", "speedup_decode_step", "speedup_decode_step_inround", "speedup_decode_step_old_sampler",
            "sampler_gain_decode_step", "seconds")  # fmt: skip
    print(json.dumps({k: rep.data.get(k) for k in keys}))
    print(f"wrote {rep.path}")
    return 0 if all("error" not in r for r in rep.data["engines"].values()) else 1


def summary_line(name: str, row: dict) -> str:
    """One line per engine: speed, refresh, start-up, mismatch, what the fp8 path ran."""
    if "error" in row:
        return f"[{name}] ERROR {row['error']}"
    mm = row.get("mismatch", {})
    gemms = "/".join(f"{k}:{v}" for k, v in row.get("gemm", {}).items())
    fp8_bits = (
        f" | fp8 GEMMs {row['fp8_gemms']} ({gemms}) fused {row['fused']} quant_kernels {row['quant_kernels']} "
        f"fast_accum {row['fast_accum']} skipped {len(row['skipped'])}"
        if "fp8_gemms" in row
        else ""
    )
    prof = row.get("profile", {})
    last_kv = list(row.get("phases", {}).get("replay_table", {}).get("by_kv", {}).values())[-1:]
    queued = last_kv[0].get("queued_ms") if last_kv else None  # the same graph as graph_step_ms, 16 queued
    return (
        f"[{name}] tok/s {row['tok_s_median']:.0f} | decode {row['decode_ms_per_step']:.2f} ms/step (graph "
        f"replay {prof.get('graph_step_ms')}, queued {queued}, in-round {row.get('decode_ms_per_step_inround')})"
        f" | prefill {row['prefill_s']:.3f} s | refresh {row['refresh_ms']:.1f} ms"
        f" | start-up {row['startup_s']:.1f} s | sampler {row.get('sampler')} {row.get('sampler_us')} us/step"
        f" | mismatch mean {mm.get('logprob_absdiff_mean')} p99 "
        f"{mm.get('logprob_absdiff_p99')} max {mm.get('logprob_absdiff_max')} out-of-range "
        f"{mm.get('seq_ratio_out_frac')}{fp8_bits}"
    )


if __name__ == "__main__":
    sys.exit(main())
