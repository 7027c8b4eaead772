"""Helpers shared by the preference-recipe tests (rm, dpo, kto, kd, prm): data files and CLI arguments.

Not a conftest (conftest helpers cannot be imported under --import-mode=importlib, and there is no tests
package): each test module loads this file by path, once per session (its `_fixtures()`):

    pf = _fixtures()
    files = pf.small_data(tmp_path)      # {"pairs", "unpaired", "steps", "sft"} jsonl files of 24 rows each
    argv = pf.cli_args(model, files["pairs"], out, "--train.max_steps", "2")
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from relayrl.tasks.preference import pair_rows, step_rows, unpaired_rows


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> Path:
    """Write `rows` one JSON object a line; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def small_data(folder: Path, n: int = 24, seed: int = 0) -> dict[str, Path]:
    """n rows of each format from the add2 task's synthetic feedback (relayrl.tasks.preference): pair rows
    (rm, dpo), unpaired rows (kto), step rows (prm) and the pairs' chosen side as SFT rows (kd)."""
    pairs = pair_rows("add2", "train", n, seed)
    return {
        "pairs": write_jsonl(folder / "pairs.jsonl", pairs),
        "unpaired": write_jsonl(folder / "unpaired.jsonl", unpaired_rows("add2", "train", n, seed)),
        "steps": write_jsonl(folder / "steps.jsonl", step_rows("train", n, seed)),
        "sft": write_jsonl(
            folder / "sft.jsonl", ({"input": r["input"], "output": r["chosen"]} for r in pairs)
        ),
    }


def cli_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """Flags of a tiny CPU run of any one-model recipe: 4 rows a step in micro-batches of 2, a quarter of
    the rows held out for eval, constant lr 1e-3 (big enough that 2 steps move the weights visibly)."""
    return [
        *("--model.name_or_path", str(model), "--data.datasets", str(data)),
        *("--data.eval_split_ratio", "0.25", "--train.batch_size", "4", "--train.micro_batch_size", "2"),
        *("--optim.lr", "1e-3", "--optim.scheduler", "constant", "--optim.warmup_steps", "0"),
        *("--train.device", "cpu", "--logger.progress_bar", "false", "--train.output_dir", str(out)),
        *extra,
    ]


def far_wrong(rng: random.Random, right: int) -> int:
    """A wrong answer 20-60 away from `right` (kept positive): its tens digit or length is off."""
    d = rng.randint(20, 60)
    return right - d if right - d > 0 and rng.random() < 0.5 else right + d


def near_wrong(rng: random.Random, right: int) -> int:
    """A near miss: `right` moved by a non-zero offset in [-10, 10], kept positive (as pair_rows does)."""
    while True:
        w = right + rng.choice([d for d in range(-10, 11) if d])
        if w > 0:
            return w
