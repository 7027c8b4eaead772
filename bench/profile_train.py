"""Profile one training step of the shared core on a GPU: step time and the top CUDA kernels.

    python bench/profile_train.py --shape qwen0.5b --samples 32 --min-len 64 --max-len 1024

The same TrainStep + SFT loss as bench/sft.py ("auto" layout); prints the step time (mean of timed steps) and
torch.profiler's kernel table for one step, sorted by CUDA time. A tool for finding where a step's time
goes, not a benchmark of record.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sft import SHAPES, Sample, build_model  # bench/ is on sys.path when run as a script

from relayrl.config.components import OptimConfig
from relayrl.models.forward import choose_layout, prepare_model
from relayrl.trainers.sft import next_token_loss, sft_micro_batches
from relayrl.training.setup import build_train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen0.5b", choices=sorted(SHAPES))
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30, help="kernel table rows")
    args = p.parse_args()
    device = torch.device("cuda")
    model = build_model(args.shape, args.max_len, device)
    layout = choose_layout(model, device)
    prepare_model(model, layout)
    step = build_train_step(
        model, OptimConfig(lr=1e-5, warmup_steps=0, scheduler="constant"), 10, device=device
    )
    g = torch.Generator().manual_seed(0)
    batch = []
    for _ in range(args.samples):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        batch.append(
            Sample(torch.randint(4, model.config.vocab_size, (n,), generator=g).tolist(), [True] * n)
        )
    mbs = sft_micro_batches(batch, layout=layout, packing=True, max_tokens_per_micro_batch=args.budget)
    tokens = sum(len(s.input_ids) for s in batch)
    times = []
    for i in range(args.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step.step(mbs, next_token_loss)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    dt = statistics.mean(times)
    print(
        f"{args.shape} {layout} {tokens} tokens in {len(mbs)} micro-batches: {dt:.3f} s/step, {tokens / dt:.0f} tok/s"
    )
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        step.step(mbs, next_token_loss)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60
        )
    )


if __name__ == "__main__":
    main()
