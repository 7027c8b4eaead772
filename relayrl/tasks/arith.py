"""Arithmetic tasks with verifiable answers: `add2` (two-digit addition, the demo task) and `add3`.

Prompt "a+b=", answer the decimal sum. Reward 1.0 for an exact match of the stripped response, else 0.0.
Train and test prompts are disjoint: the (a, b) pairs are split by a hash (`is_held_out`) so that no test
pair is ever seen in training, whatever `n` is. Sized after ../shared/notes/demo-task-measurements.md: a ~1M-parameter
model reaches 0.1-0.6 exact match from a few hundred SFT examples, leaving room for RL to add 20-40 points.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from relayrl.tasks.base import is_held_out


@dataclass
class Addition:
    """a + b with `digits`-digit operands."""

    digits: int = 2
    name: str = "add2"

    def _pairs(self, split: str) -> list[tuple[int, int]]:
        lo, hi = 10 ** (self.digits - 1), 10**self.digits
        pairs = [(a, b) for a in range(lo, hi) for b in range(lo, hi)]
        # Deterministic split: about 20% of pairs are test-only, chosen by a hash of the pair.
        return [(a, b) for a, b in pairs if is_held_out(f"{self.name}:{a}+{b}") == (split == "test")]

    def make_rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pairs = self._pairs(split)
        if n > len(pairs):
            raise ValueError(f"{self.name}: asked for {n} {split} rows but only {len(pairs)} exist")
        rng = random.Random(seed)
        chosen = rng.sample(pairs, n)
        return [{"input": f"{a}+{b}=", "output": str(a + b), "label": str(a + b)} for a, b in chosen]

    def reward(self, response: str, label: Any) -> float:
        return 1.0 if response.strip() == str(label) else 0.0
