"""Synthetic feedback data from the arithmetic tasks, for the reward-model, DPO, KTO and PRM recipes (tests,
docs examples, benchmarks): the right answer is preferred over a wrong one.

    pair_rows("add2", "train", n, seed)        {"input": "12+34=", "chosen": "46", "rejected": "47", "label": "46"}
    unpaired_rows("add2", "train", n, seed)    {"input": ..., "output": ..., "label": true|false}
    step_rows("train", n, seed)                {"input": "12+34=46;46+5=51;", "label": [true, false]} (PRM)

Wrong answers are the sum moved by a random non-zero offset in [-10, 10] (kept positive): near misses, so a
model must compute the sum to tell them apart. Prompts come from the task's own train / test split.
"""

from __future__ import annotations

import random
from typing import Any

from relayrl.tasks.registry import get_task

PLACEHOLDER = ";"
"""The step separator of `step_rows` (one token of the character-level tokenizer)."""


def _wrong(rng: random.Random, right: int) -> int:
    while True:
        w = right + rng.choice([d for d in range(-10, 11) if d])
        if w > 0:
            return w


def pair_rows(task: str, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """n preference rows: the task's answer (chosen) vs a near miss (rejected)."""
    rng = random.Random(seed + 1)
    rows = get_task(task).make_rows(split, n, seed)
    return [
        {
            "input": r["input"],
            "chosen": r["output"],
            "rejected": str(_wrong(rng, int(r["output"]))),
            "label": r["label"],
        }
        for r in rows
    ]


def unpaired_rows(task: str, split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """n rows with binary feedback: half right answers (label true), half near misses (label false)."""
    rng = random.Random(seed + 2)
    out = []
    for i, r in enumerate(get_task(task).make_rows(split, n, seed)):
        good = i % 2 == 0
        out.append(
            {
                "input": r["input"],
                "output": r["output"] if good else str(_wrong(rng, int(r["output"]))),
                "label": good,
            }
        )
    return out


def step_rows(split: str, n: int, seed: int) -> list[dict[str, Any]]:
    """n two-step sums "a+b=s1;s1+c=s2;" with one label per step (is that step's arithmetic right)."""
    rng = random.Random(seed + 3)
    rows = get_task("add2").make_rows(split, n, seed)
    out = []
    for r in rows:
        a, b = (int(x) for x in r["input"][:-1].split("+"))
        c = rng.randint(1, 9)
        s1 = a + b if rng.random() < 0.5 else _wrong(rng, a + b)
        s2 = s1 + c if rng.random() < 0.5 else _wrong(rng, s1 + c)
        text = f"{a}+{b}={s1}{PLACEHOLDER}{s1}+{c}={s2}{PLACEHOLDER}"
        out.append({"input": text, "label": [s1 == a + b, s2 == s1 + c]})
    return out
