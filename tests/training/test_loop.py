"""The shared fit-loop scaffolding (relayrl/training/loop.py, training/setup.py): the one cadence rule, the one
resume rule, and the loop over a step runner and model state that live elsewhere (a role's ranks)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from relayrl.training.checkpoint import CheckpointManager, LoadedCheckpoint, write_manifest
from relayrl.training.loop import LoopSettings, ModelParts, Trainer, due
from relayrl.training.sampler import ResumableSampler
from relayrl.training.setup import checkpoint_to_resume
from relayrl.training.step import StepOutput


def test_cadence_rule():
    assert [s for s in range(1, 10) if due(3, s)] == [3, 6, 9]
    assert not any(due(0, s) for s in range(1, 10))  # 0: never
    s = LoopSettings(total_steps=7, eval_every=3, save_every=0, log_every=2)
    assert [k for k in range(1, 8) if s.eval_due(k)] == [3, 6, 7]  # and after the last step
    assert [k for k in range(1, 8) if s.save_due(k)] == [7]  # save_every 0: only at the end
    assert [k for k in range(1, 8) if s.log_due(k)] == [2, 4, 6, 7]
    rl = LoopSettings(total_steps=7, eval_every=0, eval_final=False, save_every=2, save_final=False)
    assert not any(rl.eval_due(k) for k in range(1, 8))
    assert [k for k in range(1, 8) if rl.save_due(k)] == [2, 4, 6]


class FakeModel:
    """Stands for a role's model: the checkpoint writes whatever its workers save."""

    def __init__(self) -> None:
        self.saved: list[str] = []

    def save_pretrained(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "w.txt").write_text("w")
        self.saved.append(str(path))


class RemoteLike:
    """A step runner and model state that live outside this process (as trainers.recipe's role adapters)."""

    def __init__(self) -> None:
        self.nonfinite_total = 0
        self.steps: list[list[int]] = []
        self.loaded: list[Path] = []
        self.model = FakeModel()

    def step(self, micro_batches: list) -> StepOutput:
        self.steps.append(list(micro_batches))
        return StepOutput(loss=float(len(self.steps)), lr=0.1, grad_norm=1.0, count=1.0, tokens=4)

    def evaluate(self, batches) -> dict[str, float]:
        return {"eval/loss": 0.5}

    def full_precision(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def saved(self) -> ModelParts:
        return {"models": {"model": self.model}, "optimizers": {}, "schedulers": {}}

    def load(self, ckpt: CheckpointManager, path: Path) -> LoadedCheckpoint:
        loaded = ckpt.load(path, models={}, optimizers={}, schedulers={})
        self.loaded.append(loaded.path / "model")
        return loaded


def _trainer(tmp_path: Path, remote: RemoteLike, total: int) -> Trainer:
    return Trainer(
        train_step=remote,
        state=remote,
        sampler=ResumableSampler(6, 2, seed=0),
        collate=lambda idx: list(idx),
        settings=LoopSettings(total_steps=total, save_every=2),
        ckpt=CheckpointManager(tmp_path / "ckpt", keep_last=3),
    )


def test_loop_over_a_step_runner_and_state_elsewhere_resumes(tmp_path):
    first = RemoteLike()
    fit = _trainer(tmp_path, first, 4).fit()
    assert fit.step == 4 and [h["train/loss"] for h in fit.history] == [1.0, 2.0, 3.0, 4.0]
    assert len(first.model.saved) == 2  # the role's own save, into each checkpoint's model/ folder
    assert fit.last_checkpoint == tmp_path / "ckpt" / "step_4"
    assert (tmp_path / "ckpt" / "step_2" / "model" / "w.txt").is_file()
    again = RemoteLike()
    trainer = _trainer(tmp_path, again, 6)
    assert trainer.resume() and trainer.step == 4 and again.loaded == [tmp_path / "ckpt" / "step_4" / "model"]
    assert trainer.fit().step == 6
    whole = RemoteLike()
    _trainer(tmp_path / "whole", whole, 6).fit()
    assert again.steps == whole.steps[4:]  # the resumed run's steps 5-6 are the uninterrupted run's


def test_a_step_runner_other_than_a_train_step_needs_its_state(tmp_path):
    with pytest.raises(TypeError, match="needs its `state`"):
        Trainer(
            train_step=RemoteLike(),
            sampler=ResumableSampler(2, 1),
            collate=list,
            settings=LoopSettings(total_steps=1),
        )


def test_one_resume_rule(tmp_path):
    ckpt = CheckpointManager(tmp_path / "ckpt")
    assert checkpoint_to_resume("none", ckpt) is None
    assert checkpoint_to_resume("auto", ckpt) is None  # nothing saved yet: a fresh start
    ckpt.save(3, models={"model": FakeModel()}, trainer_state={})
    assert checkpoint_to_resume("auto", ckpt) == tmp_path / "ckpt" / "step_3"
    assert checkpoint_to_resume(str(tmp_path / "ckpt" / "step_3"), ckpt) == tmp_path / "ckpt" / "step_3"
    with pytest.raises(FileNotFoundError, match=r"ckpt.resume='.*nope' is not a checkpoint folder"):
        checkpoint_to_resume(str(tmp_path / "nope"), ckpt)


def test_a_resume_at_a_position_other_than_its_step_is_refused(tmp_path):
    """A checkpoint whose data position disagrees with its step (one batch per step), or a step_<N> folder that
    holds another step, stops the resume with an error instead of skipping or repeating batches."""
    _trainer(tmp_path, RemoteLike(), 4).fit()
    step_4 = tmp_path / "ckpt" / "step_4"
    extra = torch.load(step_4 / "extra.pt", weights_only=True)
    torch.save({"data": {**extra["data"], "position": 0}}, step_4 / "extra.pt")  # 3 batches in, not 4
    write_manifest(step_4)  # a consistent but wrong checkpoint (the checksums alone would not catch it)
    with pytest.raises(
        ValueError,
        match=r"step_4 recorded 4 batch\(es\) drawn but its data position .* is 3 batches in: resuming would repeat 1",
    ):
        _trainer(tmp_path, RemoteLike(), 6).resume()
    step_2 = tmp_path / "ckpt" / "step_2"
    step_2.rename(tmp_path / "ckpt" / "step_5")  # a copied / renamed folder
    with pytest.raises(
        ValueError, match=r"step_5 holds step 2 \(trainer_state.json\), not the step its name says"
    ):
        _trainer(tmp_path, RemoteLike(), 6).resume(tmp_path / "ckpt" / "step_5")
