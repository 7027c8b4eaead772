"""relayrl.training.setup.freeze_heap / thaw_heap and where runs call them.

- freeze_heap collects first (a reference cycle dropped before it is freed, not frozen), then freezes what is
  alive (gc.get_freeze_count() grows; the objects leave what a collection visits); garbage made afterwards is
  still collected. thaw_heap hands them back: a frozen cycle dropped since is then freed.
- an RL run (local mode: driver and every role in this process) is frozen while it steps, and an SFT run while
  its loop runs; each thaws at its end, so a finished run's workers (which hold reference cycles) are freed
  and a second run in the same process does not keep the first one's model.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace
from pathlib import Path

from dp_fixtures import addition_rows, run_sft

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.training.setup import freeze_heap, thaw_heap
from relayrl.workers import trained

DIGITS = str(Path(__file__).parents[1] / "trainers" / "data" / "digit_reward.py")


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> tuple[_Node, weakref.ref]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def _visited() -> set[int]:
    """ids of the objects a collection visits now (frozen ones are not listed)."""
    return {id(o) for o in gc.get_objects()}


def test_freeze_collects_then_freezes_what_lives_and_thaw_frees_dropped_cycles():
    assert gc.get_freeze_count() == 0
    dead = _cycle()[1]  # only reachable from itself
    held, held_ref = _cycle()
    freeze_heap()
    assert dead() is None  # collected before the freeze, not frozen
    assert gc.get_freeze_count() > 0 and id(held) not in _visited()
    later = _cycle()[1]
    gc.collect()
    assert later() is None  # garbage made after the freeze is still collected
    del held
    gc.collect()
    assert held_ref() is not None  # a frozen cycle waits for the thaw
    thaw_heap()
    assert held_ref() is None and gc.get_freeze_count() == 0


def test_rl_run_is_frozen_while_it_steps_and_frees_its_workers_after(tiny_model_path, tmp_path):
    seen: list[int] = []
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "rl"), steps=1, reward=DIGITS)
    trainer = RLTrainer(replace(cfg, ckpt=replace(cfg.ckpt, save_final=False)), banner=False)
    policy = weakref.ref(trainer.roles.policy.instance)  # pyright: ignore[reportAttributeAccessIssue]
    result = trainer.fit(on_step=lambda step, metrics: seen.append(gc.get_freeze_count()))
    assert result.exit_code == 0 and len(seen) == 1 and seen[0] > 1000, seen
    assert gc.get_freeze_count() == 0  # thawed when the roles closed
    del trainer, result
    gc.collect()
    assert policy() is None  # the worker's cycles were not kept frozen


def test_sft_runs_are_frozen_while_they_run_and_free_their_worker_after(
    tiny_model_path, tmp_path, monkeypatch
):
    workers: list[weakref.ref] = []
    frozen: list[int] = []
    real_init, real_step = trained.ModelWorker.__init__, trained.ModelWorker.step

    def init(self, *args, **kwargs) -> None:
        real_init(self, *args, **kwargs)
        workers.append(weakref.ref(self))

    def step(self, *args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(trained.ModelWorker, "__init__", init)
    monkeypatch.setattr(trained.ModelWorker, "step", step)
    data = addition_rows(tmp_path / "train.jsonl")
    for run in ("a", "b"):
        run_sft(tiny_model_path, data, tmp_path / run, batch_size=4)
    assert len(workers) == 2 and frozen and min(frozen) > 1000
    gc.collect()
    assert gc.get_freeze_count() == 0 and all(w() is None for w in workers)
