"""Muon vs AdamW (relayrl.training.muon): training speed on a GPU, and loss at equal steps on the tiny task.

    python bench/muon.py --mode speed --device cuda --shape qwen0.5b     # tokens/s, optimizer time, memory
    python bench/muon.py --mode learn                                    # CPU: `relayrl sft` on addition rows

speed: one model per optimizer (Qwen2.5-0.5B shape, random init, bf16 compute over fp32 masters, the real
TrainStep and SFT loss of bench/sft.py); they take turns step by step on the same random-token batches, so a
shared machine's load hits them alike. tokens/s: median over timed steps after --warmup untimed ones.
learn: `relayrl sft` on the 28 addition rows of tests/helpers/dp_fixtures.py, --steps steps of 8 rows at each lr
of --lrs, one run per (optimizer, lr); the last train loss and the final eval loss per run.

Writes JSON to $OUT/muon_<mode>.json when $OUT is set, else bench/results/muon_<mode>.json; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests" / "helpers")]
from dp_fixtures import addition_rows  # noqa: E402
from sft import build_model, make_steps  # noqa: E402  (bench/sft.py)

from relayrl.cli import main as cli_main  # noqa: E402
from relayrl.config.components import OptimConfig  # noqa: E402
from relayrl.models.forward import choose_layout, prepare_model  # noqa: E402
from relayrl.trainers.sft import next_token_loss, sft_micro_batches  # noqa: E402
from relayrl.training.logging import read_jsonl  # noqa: E402
from relayrl.training.precision import resolve_precision  # noqa: E402
from relayrl.training.setup import build_train_step  # noqa: E402

OPTIMIZERS = ("adamw", "muon")
warnings.filterwarnings("ignore", message="Seems like `optimizer.step()` has been overridden")


def speed(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    precision = resolve_precision("auto", device)
    models = {o: build_model(args.shape, args.max_len, device) for o in OPTIMIZERS}
    layout = choose_layout(models["adamw"], device)
    for m in models.values():
        prepare_model(m, layout)
    steps = make_steps(args, vocab=models["adamw"].config.vocab_size)
    train = {
        o: build_train_step(
            m,
            OptimConfig(name=o, lr=args.lr, warmup_steps=0, scheduler="constant"),
            len(steps),
            precision=precision,
            device=device,
        )
        for o, m in models.items()
    }
    acc = {o: {"rates": [], "optim_s": [], "losses": [], "mem": 0.0} for o in OPTIMIZERS}
    for i, batch in enumerate(steps):
        for o in OPTIMIZERS:
            mbs = sft_micro_batches(
                batch, layout=layout, packing=True, max_tokens_per_micro_batch=args.budget
            )
            opt = train[o].optimizer
            orig = opt.step
            timer: list[float] = []

            def timed(*a, _orig=orig, _timer=timer, **k):  # the optimizer's own share of the step
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                r = _orig(*a, **k)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                _timer.append(time.perf_counter() - t)
                return r

            opt.step = timed  # pyright: ignore[reportAttributeAccessIssue]
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = train[o].step(mbs, next_token_loss)
            if device.type == "cuda":
                torch.cuda.synchronize()
                acc[o]["mem"] = max(acc[o]["mem"], torch.cuda.max_memory_allocated() / 2**30)
            dt = time.perf_counter() - t0
            opt.step = orig  # pyright: ignore[reportAttributeAccessIssue]
            acc[o]["losses"].append(out.loss)
            if i >= args.warmup:
                acc[o]["rates"].append(out.tokens / dt)
                acc[o]["optim_s"].append(sum(timer))
    return {
        o: {
            "tokens_per_s": statistics.median(a["rates"]),
            "optimizer_step_s": statistics.median(a["optim_s"]),
            "peak_mem_gib": a["mem"] or None,
            "first_loss": a["losses"][0],
            "last_loss": a["losses"][-1],
        }
        for o, a in acc.items()
    }


def learn(args: argparse.Namespace) -> dict:
    from relayrl.models.tiny import save_tiny

    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny(Path(tmp) / "model")
        data = addition_rows(Path(tmp) / "train.jsonl")
        for o in OPTIMIZERS:
            for lr in args.lrs:
                out = Path(tmp) / f"{o}_{lr}"
                argv = [
                    "sft", *("--model.name_or_path", str(model), "--data.datasets", str(data)),
                    *("--data.eval_split_ratio", "0.15", "--train.batch_size", "8", "--train.micro_batch_size", "8"),
                    *("--train.output_dir", str(out), "--optim.lr", str(lr), "--optim.name", o),
                    *("--optim.warmup_steps", "1", "--logger.progress_bar", "false", "--train.device", "cpu"),
                    *("--train.max_steps", str(args.steps), "--train.epochs", "100", "--ckpt.save_every", "0"),
                ]  # fmt: skip
                assert cli_main(argv) == 0
                m = read_jsonl(out / "metrics.jsonl")
                train = [r["train/loss"] for r in m if "train/loss" in r]
                evals = [r["eval/loss"] for r in m if "eval/loss" in r]
                rows[f"{o} lr={lr}"] = {"first_loss": train[0], "last_train_loss": train[-1],
                                        "eval_loss": evals[-1] if evals else None}  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="learn", choices=("speed", "learn"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--shape", default="qwen0.5b")
    p.add_argument("--steps", type=int, default=0, help="0: 12 timed (speed) / 40 (learn)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch (speed)")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-4, help="speed mode lr")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2], help="learn mode lrs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.steps = args.steps or (12 if args.mode == "speed" else 40)
    result = speed(args) if args.mode == "speed" else learn(args)
    card = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for k, v in result.items():
        print(
            f"{k:<16} "
            + "  ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in v.items())
        )
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "device": card, "torch": torch.__version__,
            "args": vars(args)}  # fmt: skip
    (out_dir / f"muon_{args.mode}.json").write_text(json.dumps({**meta, "results": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
