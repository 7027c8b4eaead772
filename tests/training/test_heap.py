"""relayrl.training.setup.freeze_heap and where runs call it.

- freeze_heap collects first (a reference cycle dropped before it is freed, not frozen), then freezes what is
  alive (gc.get_freeze_count() grows; a full collection no longer visits it); garbage made afterwards is
  still collected.
- an RL run (local mode: driver and every role in this process) and an SFT run freeze the heap once their
  start-up is built (the conftest fixture unfreezes after each test, so each test starts at 0).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from pathlib import Path

from dp_fixtures import addition_rows, run_sft

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.training.setup import freeze_heap

DIGITS = str(Path(__file__).parents[1] / "trainers" / "data" / "digit_reward.py")


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _dropped_cycle() -> weakref.ref:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)  # a and b are now only reachable from each other


def test_freeze_heap_collects_then_freezes_what_lives():
    assert gc.get_freeze_count() == 0
    dead = _dropped_cycle()
    alive = [_Node() for _ in range(100)]
    freeze_heap()
    assert dead() is None  # collected, not frozen
    assert gc.get_freeze_count() >= len(alive)
    assert all(gc.is_tracked(n) for n in alive)
    later = _dropped_cycle()
    gc.collect()
    assert later() is None  # new garbage is still collected


def test_rl_and_sft_runs_freeze_their_start_up(tiny_model_path, tmp_path):
    assert gc.get_freeze_count() == 0
    seen: list[int] = []
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "rl"), steps=1, reward=DIGITS)
    cfg = replace(cfg, ckpt=replace(cfg.ckpt, save_final=False))
    result = RLTrainer(cfg, banner=False).fit(
        on_step=lambda step, metrics: seen.append(gc.get_freeze_count())
    )
    assert result.exit_code == 0 and len(seen) == 1 and seen[0] > 1000, seen
    gc.unfreeze()
    run_sft(tiny_model_path, addition_rows(tmp_path / "train.jsonl"), tmp_path / "sft", batch_size=4)
    assert gc.get_freeze_count() > 1000
