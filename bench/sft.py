"""SFT throughput: packed vs unpadded-but-unpacked vs padded micro-batches (tokens/s).

Every layout trains on the SAME optimizer steps (same samples per step, variable lengths) through the shared
TrainEngine with the SFT loss, so the only difference is how a step is cut into forward passes:

    packed    micro-batches of <= --budget tokens (first-fit-decreasing), each packed into rows no longer
              than its longest sample; position ids restart per sample (block-causal attention)
    unpacked  one sample per forward pass: no padding, but many small passes
    padded    --micro-batch samples per pass, right-padded to the longest

tokens/s: the median over timed steps of real (non-padding) tokens / step time (after --warmup untimed
steps); layouts run each step in turn, so a shared machine's load hits them alike. Packed micro-batches are
rows no longer than their longest sample (see relayrl.data.packing.pack row_len).

    python bench/sft.py                           # CPU, tiny Qwen2 (hidden 64, 2 layers)
    python bench/sft.py --device cuda --hidden 1024 --layers 12 --heads 16 --kv-heads 4 --batch-size 64 \
        --min-len 64 --max-len 2048 --budget 16384 --micro-batch 8

Prints a table and writes bench/results/sft.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.trainers.core import TrainEngine, build_optimizer
from relayrl.trainers.sft import next_token_loss, sft_micro_batches


class Sample:
    def __init__(self, input_ids: list[int], loss_mask: list[bool]):
        self.input_ids, self.loss_mask = input_ids, loss_mask


def make_steps(args: argparse.Namespace, vocab: int) -> list[list[Sample]]:
    """Random token samples, lengths uniform in [min_len, max_len], loss on the second half."""
    g = torch.Generator().manual_seed(args.seed)
    steps = []
    for _ in range(args.warmup + args.steps):
        batch = []
        for _ in range(args.batch_size):
            n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
            ids = torch.randint(4, vocab, (n,), generator=g).tolist()
            batch.append(Sample(ids, [i >= n // 2 for i in range(n)]))
        steps.append(batch)
    return steps


LAYOUTS = ("packed", "unpacked", "padded")


def build_engine(args: argparse.Namespace, device: torch.device) -> TrainEngine:
    tok = build_tiny_tokenizer()
    spec = TinyModelSpec(
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        max_positions=max(512, args.max_len),
    )
    model = build_tiny_model(tok, spec).to(device)
    return TrainEngine(
        model=model,
        loss_fn=next_token_loss,
        optimizer=build_optimizer(model, lr=1e-4),
        grad_clip=1.0,
        device=device,
    )


def layout_kwargs(name: str, args: argparse.Namespace) -> dict:
    return {
        "packed": {"packing": True, "max_tokens_per_micro_batch": args.budget},
        "unpacked": {"packing": False, "micro_batch_size": 1},
        "padded": {"packing": False, "micro_batch_size": args.micro_batch},
    }[name]


def run_all(args: argparse.Namespace, steps: list[list[Sample]], device: torch.device) -> list[dict]:
    """Each step is run by every layout in turn (round robin), so load from other processes on a shared
    machine hits all layouts alike; each layout has its own identical model and optimizer."""
    engines = {name: build_engine(args, device) for name in LAYOUTS}
    acc = {
        name: {"seconds": 0.0, "tokens": 0, "slots": 0, "passes": 0, "losses": [], "rates": []}
        for name in LAYOUTS
    }
    for i, batch in enumerate(steps):
        for name in LAYOUTS:
            mbs = sft_micro_batches(batch, pad_id=0, **layout_kwargs(name, args))
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engines[name].step(mbs)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            a = acc[name]
            a["losses"].append(out.loss)
            if i >= args.warmup:
                a["seconds"] += dt
                a["rates"].append(out.tokens / dt)
                a["tokens"] += out.tokens
                a["slots"] += sum(mb.input_ids.numel() for mb in mbs)
                a["passes"] += len(mbs)
    return [
        {
            "layout": name,
            "tokens_per_s": statistics.median(a["rates"]),
            "mean_tokens_per_s": a["tokens"] / a["seconds"],
            "seconds": a["seconds"],
            "real_tokens": a["tokens"],
            "padding_fraction": 1 - a["tokens"] / a["slots"],
            "forward_passes_per_step": a["passes"] / args.steps,
            "first_loss": a["losses"][0],
            "last_loss": a["losses"][-1],
        }
        for name, a in acc.items()
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per layout")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=16, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per pass (padded layout)")
    p.add_argument("--budget", type=int, default=1024, help="tokens per packed micro-batch")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "sft.json"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    steps = make_steps(args, vocab=len(build_tiny_tokenizer()))
    rows = run_all(args, steps, device)
    base = rows[1]["tokens_per_s"]
    print(
        f"{'layout':<10} {'tokens/s':>10} {'vs unpacked':>12} {'padding':>8} {'passes/step':>12} {'loss':>14}"
    )
    for r in rows:
        print(
            f"{r['layout']:<10} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base:>11.2f}x "
            f"{r['padding_fraction']:>7.1%} {r['forward_passes_per_step']:>12.1f} "
            f"{r['first_loss']:>6.3f}->{r['last_loss']:.3f}"
        )
    device_name = (
        torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    )
    result = {
        "bench": "sft",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": str(device),
        "device_name": device_name,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "args": vars(args),
        "results": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
