"""bench/moe.py's timing protocol: a full-size warm-up round, then fresh-prompt rounds, median tokens/s."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import moe  # noqa: E402


def test_timed_rounds_warms_at_full_size_and_reports_the_median_round():
    calls: list[tuple[int, int]] = []
    seconds = {1: 9.0, 2: 2.0, 3: 1.0, 4: 4.0}  # the warm-up (seed 1) is slow and must not count

    def run_round(new: int, seed: int) -> tuple[int, float]:
        calls.append((new, seed))
        return 64 * new, seconds[seed]

    r = moe.timed_rounds(run_round, argparse.Namespace(new_tokens=256, rounds=3))
    assert calls == [(256, 1), (256, 2), (256, 3), (256, 4)]  # full-size warm-up, then fresh prompts
    rates = sorted(64 * 256 / s for s in (2.0, 1.0, 4.0))
    assert r["tokens_per_s"] == rates[1] and r["seconds"] == 2.0
    assert (r["tokens_per_s_min"], r["tokens_per_s_max"]) == (rates[0], rates[-1])
    assert r["warmup_s"] == 9.0 and r["round_seconds"] == [2.0, 1.0, 4.0]
