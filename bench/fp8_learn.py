"""Does RL still learn with an fp8 rollout engine? GRPO on the built-in add2 task from one SFT'd tiny model, once
with the bf16 engine and once with rollout.quantization fp8 (TIS on by default), same seed, same prompts.

    python bench/fp8_learn.py                              # one GPU (cc >= 8.9), ~3 min
    python bench/fp8_learn.py --device cpu --rl-steps 4 --hidden 64 --sft-target 0.0 --eval-rows 16   # smoke

The model and data are `relayrl demo`'s (relayrl/apps/demo.py, as bench/gpu_quickstart.sh builds its model): a
tiny Qwen2 (--hidden, 4 layers, 4 heads; every projection size a multiple of 16, as fp8 GEMMs need), SFT'd on
add2 until its dev accuracy reaches --sft-target, then the demo's RL recipe (32 prompts x 8 samples, group_norm,
PPO clip, lr 2e-4 constant) for --rl-steps steps per engine, evaluated (greedy exact match on --eval-rows held-out
prompts) before the first step and every --rl-steps / 4 steps. Reported per engine: eval pass@1 before / after
and its curve, the train-side mismatch metrics (train/logprob_diff, TIS's is_weight_mean and kl_rollout_train)
averaged over the steps, reward mean first / last 10 steps, seconds. `learns`: pass@1 rose by >= 0.05.
Writes $OUT/fp8_learn.json after every piece (OUT unset: bench/results/fp8_learn.json); --budget-s (default
230) stops with partial results (exit 3).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relayrl.apps.demo import build_base_model, make_demo_data, rl_config, sft_until_target  # noqa: E402
from relayrl.config.apps import DemoConfig  # noqa: E402
from relayrl.trainers.rl.loop import RLTrainer  # noqa: E402

TRAIN_KEYS = ("train/logprob_diff", "train/is_weight_mean", "train/kl_rollout_train")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add = ap.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--hidden", type=int, default=256)
    add("--sft-target", type=float, default=0.3)
    add("--rl-steps", type=int, default=60)
    add("--eval-rows", type=int, default=200)
    add("--engines", default="none,fp8", help="rollout.quantization values, in order")
    add("--seed", type=int, default=0)
    add("--budget-s", type=float, default=230.0)
    add("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    return ap.parse_args(argv)


def summarize(result, seconds: float) -> dict:
    hist = result.history
    rewards = [h["rollout/reward_mean"] for h in hist if "rollout/reward_mean" in h]
    lines = (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()
    curve = [(r["step"], r["eval/pass@1"]) for r in map(json.loads, lines) if "eval/pass@1" in r]
    before, after = result.first_eval.get("eval/pass@1"), result.eval.get("eval/pass@1")
    row = dict(
        exit_code=result.exit_code,
        steps=result.steps,
        seconds=round(seconds, 1),
        eval_before=before,
        eval_after=after,
        eval_curve=curve,
        reward_first10=statistics.fmean(rewards[:10]) if rewards else None,
        reward_last10=statistics.fmean(rewards[-10:]) if rewards else None,
        learns=before is not None and after is not None and after - before >= 0.05,
    )
    for k in TRAIN_KEYS:
        vals = [h[k] for h in hist if k in h]
        row[k.removeprefix("train/") + "_mean"] = statistics.fmean(vals) if vals else None
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    t0 = time.perf_counter()
    out = Path(args.out)
    path = out if out.suffix == ".json" else out / "fp8_learn.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    work = path.parent / "fp8_learn_work"
    data: dict = dict(bench="fp8_learn", argv=sys.argv[1:] if argv is None else argv, torch=torch.__version__)
    if args.device.startswith("cuda"):
        data["device"] = torch.cuda.get_device_name()

    def write() -> None:
        path.write_text(json.dumps(data, indent=2) + "\n")

    def out_of_time(signum, frame):
        raise TimeoutError(f"--budget-s {args.budget_s} reached")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(max(1, int(args.budget_s)))
    try:
        cfg = DemoConfig(
            output_dir=str(work), device=args.device, hidden=args.hidden, sft_target=args.sft_target,
            eval_rows=args.eval_rows, rl_steps=args.rl_steps, seed=args.seed,
        )  # fmt: skip
        base = build_base_model(cfg, work / "base")
        demo_data = make_demo_data(cfg, work / "data")
        sft_model, sft_steps, dev_acc = sft_until_target(cfg, base, demo_data, work / "sft")
        data["sft"] = dict(steps=sft_steps, dev_accuracy=dev_acc, seconds=round(time.perf_counter() - t0, 1))
        write()
        data["engines"] = {}
        last = 0.0  # seconds the previous engine's run took: the next one is expected to take as long
        for q in args.engines.split(","):
            if time.perf_counter() - t0 + last > args.budget_s:
                data["engines"][q] = {
                    "skipped": f"not enough of --budget-s {args.budget_s} left",
                    "exit_code": 0,
                }
                write()
                continue
            print(f"[fp8_learn {time.perf_counter() - t0:.0f}s] RL with rollout.quantization {q}", flush=True)
            rl = rl_config(cfg, sft_model, demo_data, work / f"rl_{q}", args.rl_steps)
            rl = replace(
                rl,
                rollout=replace(rl.rollout, quantization=q),
                eval=replace(rl.eval, every=max(1, args.rl_steps // 4)),
                logger=replace(rl.logger, progress_bar=False),
            )
            t1 = time.perf_counter()
            data["engines"][q] = summarize(RLTrainer(rl).fit(), time.perf_counter() - t1)
            last = time.perf_counter() - t1
            write()
            print(json.dumps({q: data["engines"][q]}), flush=True)
    except TimeoutError as e:
        data["stopped"] = str(e)
        write()
        print(f"stopped: {e}; partial results in {path}", file=sys.stderr)
        return 3
    finally:
        signal.alarm(0)
    data["seconds"] = round(time.perf_counter() - t0, 1)
    write()
    print(f"wrote {path}")
    return 0 if all(r["exit_code"] == 0 for r in data["engines"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
