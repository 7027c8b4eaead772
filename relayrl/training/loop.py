"""The fit loop scaffolding every trainer shares: cadence, resume, checkpoints, and the one-model fit loop.

    settings = LoopSettings(total_steps=..., eval_every=..., save_every=..., log_every=...)
    settings.eval_due(step) / save_due(step) / log_due(step)    THE cadence rule (`due`), RL's loop too
    trainer = Trainer(train_step=TrainStep(...) | a remote step, sampler=ResumableSampler(...), collate=fn,
                      settings=settings, ckpt=CheckpointManager(...), logger=MetricsLogger(...),
                      eval_batches=fn, tokenizer=tok, state=ModelState | None)
    trainer.resume(path)      # from a checkpoint (None: the checkpoint manager's newest complete one)
    result = trainer.fit()    # -> FitResult(step, history, last_checkpoint, stopped_by)

A recipe supplies `collate(indices) -> list[micro_batch]` (one optimizer step) and `eval_batches() ->
Iterable[list[micro_batch]]`; the loss lives in the step runner. Two seams keep the loop free of where the
model lives (composition, no subclass):
    StepRunner   step / evaluate / full_precision / nonfinite_total: a TrainStep in this process, or a role's
                 ranks (relayrl.trainers.recipe.RemoteStep)
    ModelState   what a checkpoint writes of the model and how it is restored: InProcessState (the modules,
                 optimizer and scheduler here, restored in place by the CheckpointManager) or a role that
                 saves and loads itself (relayrl.trainers.recipe.RoleModelState)
The RL controller (relayrl/trainers/rl/loop.py) runs its own step (rollout, experience, update, sync) on the
same cadence rule, resume path (relayrl.training.setup.checkpoint_to_resume), checkpoint manager and logger.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict

import torch

from relayrl.training.checkpoint import CheckpointManager, LoadedCheckpoint
from relayrl.training.logging import MetricsLogger
from relayrl.training.sampler import ResumableSampler
from relayrl.training.signals import SignalFlag
from relayrl.training.step import StepOutput, TrainStep


def due(every: int, step: int) -> bool:
    """THE cadence rule: something done every `every` steps (0: never) is due at `step`."""
    return every > 0 and step % every == 0


@dataclass(kw_only=True, slots=True)
class LoopSettings:
    """How often things happen in a fit loop (filled from the command's config by the trainer)."""

    total_steps: int
    """Steps to run in total (a resumed run continues to the same total)."""
    eval_every: int = 0
    """Evaluate every k steps (0: only at the end when `eval_final`)."""
    eval_final: bool = True
    """Also evaluate after the last step."""
    save_every: int = 0
    """Checkpoint every k steps (0: only at the end when `save_final`)."""
    save_final: bool = True
    """Checkpoint after the last step."""
    best_metric: str = "eval/loss"
    """Metric passed to the checkpoint manager for keep-best (missing -> None)."""
    log_every: int = 1
    """Log train metrics every k steps (eval steps are always logged)."""

    def eval_due(self, step: int) -> bool:
        return due(self.eval_every, step) or (self.eval_final and step == self.total_steps)

    def save_due(self, step: int) -> bool:
        return due(self.save_every, step) or (self.save_final and step == self.total_steps)

    def log_due(self, step: int) -> bool:
        return due(self.log_every, step) or step == self.total_steps


@dataclass(kw_only=True, slots=True)
class FitResult:
    """What `Trainer.fit` returns."""

    step: int
    """Optimizer steps completed."""
    history: list[dict[str, float]]
    """Every logged metrics row of this process (with "step")."""
    last_checkpoint: Path | None = None
    """Path of the last checkpoint written (None if none)."""
    stopped_by: int | None = None
    """The signal that stopped the loop early (after a checkpoint), None when it ran to the end."""


class StepRunner(Protocol):
    """One optimizer step over a step's micro-batches, and eval (a TrainStep, or a role's ranks)."""

    nonfinite_total: int
    """Steps skipped for a non-finite gradient so far."""

    def step(self, micro_batches: list[Any]) -> StepOutput: ...

    def evaluate(self, batches: Iterable[Sequence[Any]]) -> dict[str, float]: ...

    def full_precision(self) -> contextlib.AbstractContextManager[Any]: ...


class ModelParts(TypedDict):
    """CheckpointManager.save's and load's model arguments."""

    models: Mapping[str, Any]
    """Sub-folder name -> an object with `save_pretrained` (an HF / peft module, or a role's WorkerFolder)."""
    optimizers: Mapping[str, torch.optim.Optimizer]
    """Optimizers saved into optim.pt ({} when a role saves its own)."""
    schedulers: Mapping[str, Any]
    """Schedulers saved into optim.pt."""


class ModelState(Protocol):
    """What a checkpoint holds of the trained model: CheckpointManager.save's models / optimizers / schedulers,
    and how a checkpoint is restored."""

    def saved(self) -> ModelParts:
        """CheckpointManager.save's `models`, `optimizers` and `schedulers` arguments."""
        ...

    def load(self, ckpt: CheckpointManager, path: Path) -> LoadedCheckpoint:
        """Restore the checkpoint at `path`; returns the loop's state from it."""
        ...


class InProcessState:
    """The model, optimizer and scheduler of a TrainStep in this process: restored in place."""

    def __init__(self, train_step: TrainStep, models: Mapping[str, torch.nn.Module] | None = None) -> None:
        self.train_step = train_step
        self.models = models if models is not None else {"model": train_step.model}

    def saved(self) -> ModelParts:
        s = self.train_step
        return {
            "models": self.models,
            "optimizers": {"model": s.optimizer},
            "schedulers": {"model": s.scheduler} if s.scheduler is not None else {},
        }

    def load(self, ckpt: CheckpointManager, path: Path) -> LoadedCheckpoint:
        with self.train_step.full_precision():  # weights load into the fp32 masters
            return ckpt.load(path, **self.saved())


class Trainer:
    """The loop: sample indices -> collate -> step -> eval -> log -> checkpoint; exact resume.

    `state` is what each checkpoint holds of the model (default: InProcessState over `train_step`, which
    must then be a TrainStep, saving `models`, {"model": its model} by default).
    """

    def __init__(
        self,
        *,
        train_step: StepRunner,
        sampler: ResumableSampler,
        collate: Callable[[list[int]], list[Any]],
        settings: LoopSettings,
        ckpt: CheckpointManager | None = None,
        logger: MetricsLogger | None = None,
        eval_batches: Callable[[], Iterable[Sequence[Any]]] | None = None,
        tokenizer: Any = None,
        models: Mapping[str, torch.nn.Module] | None = None,
        state: ModelState | None = None,
    ):
        self.train_step, self.sampler, self.collate, self.settings = train_step, sampler, collate, settings
        self.ckpt, self.logger, self.eval_batches, self.tokenizer = ckpt, logger, eval_batches, tokenizer
        if state is None:
            if not isinstance(train_step, TrainStep):
                raise TypeError("Trainer: a step runner other than a TrainStep needs its `state`")
            state = InProcessState(train_step, models)
        self.state = state
        self.step = 0
        self.tokens_seen = 0

    def resume(self, path: Path | None = None) -> bool:
        """Restore from `path` (None: the checkpoint manager's newest complete one); False when there is none."""
        if self.ckpt is None:
            return False
        path = path if path is not None else self.ckpt.resumable()
        if path is None:
            return False
        loaded = self.state.load(self.ckpt, path)
        # one batch per step: the data position must be the step's (never skip or repeat a batch)
        self.sampler.load_state_dict(loaded.extra["data"], expect_batches=loaded.step, where=str(path))
        self.step = loaded.step
        self.tokens_seen = int(loaded.trainer_state.get("tokens_seen", 0))
        self.train_step.nonfinite_total = int(loaded.trainer_state.get("nonfinite_skips", 0))
        return True

    def save(self, metrics: dict[str, float]) -> Path:
        assert self.ckpt is not None
        state = {
            "tokens_seen": self.tokens_seen,
            "total_steps": self.settings.total_steps,  # a continued run with another total says how its lr changes
            "epoch": self.sampler.epoch,
            "nonfinite_skips": self.train_step.nonfinite_total,
            "metrics": metrics,
        }
        with self.train_step.full_precision():  # checkpoints hold the exact fp32 weights
            return self.ckpt.save(
                self.step,
                tokenizer=self.tokenizer,
                trainer_state=state,
                extra={"data": self.sampler.state_dict()},
                metric=metrics.get(self.settings.best_metric),
                **self.state.saved(),
            )

    def fit(self, stop: SignalFlag | None = None) -> FitResult:
        """Run until `settings.total_steps` optimizer steps are done (continuing after `resume`). `stop`: its
        `signum` becomes non-None on SIGINT / SIGTERM (relayrl.training.signals.SignalFlag): the loop then
        finishes the step, writes a checkpoint and returns with `stopped_by` set."""
        s = self.settings
        history: list[dict[str, float]] = []
        last_ckpt = None
        while self.step < s.total_steps:
            if stop is not None and stop.signum is not None:
                if self.ckpt is not None and history:
                    last_ckpt = self.save(history[-1])
                return FitResult(
                    step=self.step, history=history, last_checkpoint=last_ckpt, stopped_by=stop.signum
                )
            metrics = self._step()
            if self.eval_batches is not None and s.eval_due(self.step):
                metrics.update(self.train_step.evaluate(self.eval_batches()))
            if self.logger is not None and (s.log_due(self.step) or "eval/loss" in metrics):
                self.logger.log(metrics, self.step)
            history.append({"step": self.step, **metrics})
            if self.ckpt is not None and s.save_due(self.step):
                last_ckpt = self.save(metrics)
        return FitResult(step=self.step, history=history, last_checkpoint=last_ckpt)

    def _step(self) -> dict[str, float]:
        """One optimizer step on the sampler's next batch; its train/* and perf/* metrics (a step's own metrics
        are train/<name>, except those it names timing/* or perf/* itself)."""
        t0 = time.perf_counter()
        out = self.train_step.step(self.collate(self.sampler.next_indices()))
        dt = time.perf_counter() - t0
        self.step += 1
        self.tokens_seen += out.tokens
        return {
            "train/loss": out.loss,
            "train/lr": out.lr,
            "train/grad_norm": out.grad_norm,
            "train/target_tokens": out.count,
            "train/epoch": self.sampler.epoch,
            "train/nonfinite_skips": float(self.train_step.nonfinite_total),
            "perf/tokens_per_s": out.tokens / dt if dt > 0 else 0.0,
            "perf/step_s": dt,
            "perf/tokens_seen": self.tokens_seen,
            **{k if k.startswith(("timing/", "perf/")) else f"train/{k}": v for k, v in out.metrics.items()},
        }
