"""How `bench/scale.py sft --weak` steps split over the ranks, before and after per-rank packing (CPU only,
seconds): the per-rank tokens and forward/backward passes of each step, from the product's own data builder,
sampler and planner on the same rows scale.py writes (the char tokenizer, 64-1000 characters a sample).

    python bench/sft_rank_plan.py --gpus 1,2,4 --batch 64 --budget 16384 --steps 3

before: the whole step packed first (first-fit-decreasing into <= budget packs), whole packs handed to the
ranks in contiguous token-balanced runs; a rank short of passes re-runs its last pack with weight 0 (FSDP
needs every rank in every collective). after: the step's samples split over the ranks by tokens
(relayrl.data.packing.balance_by_tokens), each rank's share packed on its own. "run" counts the padding
passes' tokens too: the step lasts as long as the rank with the most. Writes $OUT/sft_rank_plan.json if OUT is
set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from scale import _sft_data

from relayrl.config.components import TrainConfig
from relayrl.config.recipes import SFTConfig
from relayrl.data.build import build_sft_data
from relayrl.data.packing import make_collate
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.trainers.recipe import rank_loads
from relayrl.training.sampler import ResumableSampler


class _Pack(list):
    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self)


def plan(gpus: int, batch: int, budget: int, steps: int, folder: Path) -> dict:
    """Per-step rank loads (rank_loads' metrics) before and after, for one GPU count of the weak run."""
    rows = batch * gpus
    data = _sft_data(folder / f"sft{gpus}.jsonl", rows * (steps + 1), 64, 1000, 0)
    cfg = SFTConfig()
    train_samples, _, _ = build_sft_data(
        replace(cfg.data, datasets=[str(data)], max_len=1100, eval_split_ratio=0.0),
        build_tiny_tokenizer(),
        "response",
    )
    train = TrainConfig(batch_size=rows, micro_batch_size=1, packing=True, max_tokens_per_micro_batch=budget)
    sampler = ResumableSampler(len(train_samples), rows, seed=train.seed)
    out: dict = {"gpus": gpus, "steps": []}
    for _ in range(steps):
        idx = sampler.next_indices()
        row = {}
        for name, parts in (("before", 1), ("after", gpus)):
            mbs = make_collate(
                train_samples,
                train,
                "varlen",
                lambda g, _l: _Pack(g),
                size=lambda s: len(s.input_ids),
                parts=parts,
            )(idx)
            row[name] = rank_loads(mbs, gpus)
        row["tokens"] = sum(len(train_samples[i].input_ids) for i in idx)
        out["steps"].append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--gpus", default="1,2,4")
    p.add_argument("--batch", type=int, default=64, help="samples per GPU (weak scaling)")
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [plan(int(g), args.batch, args.budget, args.steps, Path(tmp)) for g in args.gpus.split(",")]
    print(
        "gpus step | tokens/rank mean | before: max / min real, passes, max run | after: max / min real, passes, max run"
    )
    for r in results:
        for i, s in enumerate(r["steps"]):
            b, a, mean = s["before"], s["after"], s["tokens"] / r["gpus"]
            print(
                f"{r['gpus']:>4} {i:>4} | {mean:>8.0f} | {b['perf/rank_tokens_max']:>6.0f} / {b['perf/rank_tokens_min']:>6.0f}, "
                f"{b['perf/rank_passes_max']:.0f}, {b['perf/rank_run_tokens_max']:>6.0f} ({b['perf/rank_run_tokens_max'] / mean:.2f}x) | "
                f"{a['perf/rank_tokens_max']:>6.0f} / {a['perf/rank_tokens_min']:>6.0f}, {a['perf/rank_passes_max']:.0f}, "
                f"{a['perf/rank_run_tokens_max']:>6.0f} ({a['perf/rank_run_tokens_max'] / mean:.2f}x)"
            )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "sft_rank_plan.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
