"""Where each rank's time goes in one RL step and one SFT step, at 1, 2, 4 ... GPUs (bench/scale.py's runs,
profiled per rank by relayrl.distributed.launch.profile).

    python bench/profile_step.py rl  --shape qwen0.5b-char --gpus 1,2,4      # ~3 min on H100s
    python bench/profile_step.py sft --shape qwen0.5b --gpus 1,2,4           # ~2 min
    python bench/profile_step.py rl --gpus 1,2,4 --weak --replicate         # dist.replicate, batch per GPU fixed

Runs bench/scale.py's case (same entry points, same defaults: GRPO 64 x 8 x 256 new tokens / SFT 64 samples)
for 3 steps with RELAYRL_PROFILE_DIR set, and reads step 2 (after a warm-up) of every rank:

  generation       the rank's own rollout call (its engine's share of the prompts)
  wait_engines     the slowest rank's rollout minus this rank's (the driver waits for the slowest)
  transfer         fetching its experience rows from the driver (relayrl.distributed.launch.rows)
  logprobs         old-log-prob pass (skipped when the update is exactly on-policy)
  update           the training call's wall time (RL: policy.update; SFT: the step), split into:
  forward / backward / optimizer      GPU kernel seconds of the update (torch.profiler)
  ag_exposed / rs_exposed / ar_exposed  all-gather / reduce-scatter / all-reduce time with no compute
                   kernel running (what FSDP's overlap did not hide)
  update_gpu_idle  the update's wall time with no kernel running (host work, launch gaps, peers)
  refresh          the engine weight refresh (sync)
  idle             the driver's step time not spent in this rank's calls (reward scoring, the driver's own
                   work, waiting for the slowest engine or peer)

Prints the table and writes it as JSON to $OUT/profile_<kind>[_weak][_replicate].json (or bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch
from scale import SHAPES, build_model, run_rl_case, run_sft_case  # bench/ is on sys.path as a script

from relayrl.distributed.launch.profile import CALL_ENV, PROFILE_ENV

STEP = 2
"""The profiled step (its calls are number STEP of each method; step 1 is the warm-up)."""
COLUMNS = (
    "generation", "wait_engines", "transfer", "logprobs", "update", "forward", "backward", "optimizer",
    "ag_exposed", "rs_exposed", "ar_exposed", "update_gpu_idle", "refresh", "idle", "step",
)  # fmt: skip


def _calls(folder: Path, role: str) -> dict[int, dict[str, dict]]:
    """rank -> method -> the record of call number STEP."""
    out: dict[int, dict[str, dict]] = {}
    for f in sorted(folder.glob(f"{role}_rank*.jsonl")):
        rank = int(f.stem.split("rank")[1])
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r["call"] == STEP:
                out.setdefault(rank, {})[r["method"]] = r
    return out


def _train_parts(u: dict) -> dict[str, float]:
    parts = {
        "forward": u.get("forward_s", 0.0),
        "backward": u.get("backward_s", 0.0),
        "optimizer": u.get("optimizer_s", 0.0),
        "ag_exposed": u.get("all_gather_exposed_s", 0.0),
        "rs_exposed": u.get("reduce_scatter_exposed_s", 0.0),
        "ar_exposed": u.get("all_reduce_exposed_s", 0.0),
    }
    if "gpu_busy_s" in u:
        parts["update_gpu_idle"] = u["wall_s"] - u["gpu_busy_s"]
    return parts


def rl_table(folder: Path, step_s: float) -> list[dict[str, float]]:
    ranks = _calls(folder, "policy")
    slowest = max((c.get("rollout", {}).get("wall_s", 0.0) for c in ranks.values()), default=0.0)
    rows = []
    for rank, c in sorted(ranks.items()):
        wall = {m: r["wall_s"] for m, r in c.items()}
        gen = wall.get("rollout", 0.0)
        row = {
            "rank": rank,
            "generation": gen,
            "wait_engines": slowest - gen,
            "transfer": sum(r["transfer_s"] for r in c.values()),
            "logprobs": wall.get("logprobs", 0.0),
            "update": wall.get("update", 0.0),
            **_train_parts(c.get("update", {})),
            "refresh": wall.get("sync", 0.0),
            "step": step_s,
        }
        row["idle"] = step_s - sum(wall.values()) - row["wait_engines"]
        rows.append(row)
    return rows


def sft_table(folder: Path, step_s: float) -> list[dict[str, float]]:
    rows = []
    role = "policy" if any(folder.glob("policy_rank*.jsonl")) else "model"
    for rank, c in sorted(_calls(folder, role).items()):
        u = c.get("step", {})
        row = {"rank": rank, "update": u.get("wall_s", 0.0), **_train_parts(u), "step": step_s}
        row["idle"] = step_s - u.get("wall_s", 0.0)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["rl", "sft"])
    p.add_argument("--shape", default="qwen0.5b-char", choices=sorted(SHAPES))
    p.add_argument("--gpus", default="1,2,4")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="SFT samples per step")
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (no kernels)")
    p.add_argument("--weak", action="store_true", help="the batch per GPU fixed (scale.py --weak)")
    p.add_argument(
        "--replicate", action="store_true", help="several GPUs: dist.replicate (scale.py --replicate)"
    )
    args = p.parse_args()
    args.steps, args.offload = STEP + 1, False
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/profile_step.py needs CUDA GPUs (or --device cpu for a smoke run)")
    table: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.shape, Path(tmp) / "model")
        for g in [int(x) for x in args.gpus.split(",")]:
            folder = Path(tmp) / f"profile{g}"
            os.environ[PROFILE_ENV], os.environ[CALL_ENV] = str(folder), str(STEP)
            run = Path(tmp) / f"run{g}"
            if args.kind == "rl":
                case = run_rl_case(args, model, g, run)
                rows = rl_table(folder, case["step_s_by_step"][STEP - 1])
            else:
                case = run_sft_case(args, model, g, run)
                rows = sft_table(folder, case["step_s_by_step"][STEP - 1])
            table += [{"gpus": g, **r} for r in rows]
            del os.environ[PROFILE_ENV]
    card = (
        torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu ({platform.processor() or 'x86'})"
    )
    print(f"\n{args.kind} {args.shape}: seconds per rank in step {STEP}, {card}")
    cols = [c for c in COLUMNS if any(c in r for r in table)]
    print(f"{'gpus':>4} {'rank':>4} " + " ".join(f"{c:>12}" for c in cols))
    for r in table:
        print(f"{r['gpus']:>4} {r['rank']:>4} " + " ".join(f"{r.get(c, 0.0):>12.4f}" for c in cols))
    tag = args.kind + ("_weak" if args.weak else "") + ("_replicate" if args.replicate else "")
    out = Path(os.environ.get("OUT") or Path(__file__).parent / "results") / f"profile_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = {
        "card": card,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    variant = {"weak": args.weak, "replicate": args.replicate}
    out.write_text(
        json.dumps({"kind": args.kind, "shape": args.shape, **variant, **stamp, "rows": table}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
