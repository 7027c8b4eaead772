"""The fit loop of the supervised-style recipes (SFT now; RM / DPO / KTO next): sample indices -> collate ->
TrainStep.step -> eval -> log -> checkpoint, with exact resume.

    trainer = Trainer(train_step=TrainStep(...), sampler=ResumableSampler(...), collate=fn, settings=LoopSettings(...),
                      ckpt=CheckpointManager(...), logger=MetricsLogger(...), eval_batches=fn, tokenizer=tok)
    trainer.resume()          # from the checkpoint manager's latest (or a path)
    result = trainer.fit()    # -> FitResult(step, history, last_checkpoint)

A recipe supplies `collate(indices) -> list[micro_batch]` (one optimizer step) and `eval_batches() ->
Iterable[list[micro_batch]]`; the loss lives in the TrainStep. The RL controller has its own loop
(relayrl/trainers/rl/loop.py) but its workers run the same TrainStep.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.training.checkpoint import CheckpointManager
from relayrl.training.logging import MetricsLogger
from relayrl.training.sampler import ResumableSampler
from relayrl.training.step import TrainStep


@dataclass(kw_only=True, slots=True)
class LoopSettings:
    """How often things happen in `Trainer.fit` (filled from TrainConfig / CkptConfig by the recipe)."""

    total_steps: int
    """Optimizer steps to run in total (a resumed run continues to the same total)."""
    eval_every: int = 0
    """Evaluate every k steps (0: only at the end, when eval batches exist)."""
    save_every: int = 0
    """Checkpoint every k steps (0: only at the end)."""
    save_final: bool = True
    """Checkpoint after the last step."""
    best_metric: str = "eval/loss"
    """Metric passed to the checkpoint manager for keep-best (missing -> None)."""
    log_every: int = 1
    """Log train metrics every k steps (eval steps are always logged)."""


@dataclass(kw_only=True, slots=True)
class FitResult:
    """What `Trainer.fit` returns."""

    step: int
    """Optimizer steps completed."""
    history: list[dict[str, float]]
    """Every logged metrics row of this process (with "step")."""
    last_checkpoint: Any = None
    """Path of the last checkpoint written (None if none)."""
    stopped_by: int | None = None
    """The signal that stopped the loop early (after a checkpoint), None when it ran to the end."""


class Trainer:
    """The loop: sample indices -> collate -> TrainStep.step -> eval -> log -> checkpoint; exact resume.

    `models` are what is saved in each checkpoint ({"model": model} by default).
    """

    def __init__(
        self,
        *,
        train_step: TrainStep,
        sampler: ResumableSampler,
        collate: Callable[[list[int]], list[Any]],
        settings: LoopSettings,
        ckpt: CheckpointManager | None = None,
        logger: MetricsLogger | None = None,
        eval_batches: Callable[[], Iterable[Sequence[Any]]] | None = None,
        tokenizer: Any = None,
        models: dict[str, torch.nn.Module] | None = None,
    ):
        self.train_step, self.sampler, self.collate, self.settings = train_step, sampler, collate, settings
        self.ckpt, self.logger, self.eval_batches, self.tokenizer = ckpt, logger, eval_batches, tokenizer
        self.models = models if models is not None else {"model": train_step.model}
        self.step = 0
        self.tokens_seen = 0

    def _optim_state(self) -> dict[str, Any]:
        s = self.train_step
        return {
            "optimizers": {"model": s.optimizer},
            "schedulers": {"model": s.scheduler} if s.scheduler is not None else {},
        }

    def resume(self, path: Any = None) -> bool:
        """Restore from `path` or the checkpoint manager's latest; False when there is none."""
        if self.ckpt is None or (path is None and self.ckpt.latest() is None):
            return False
        with self.train_step.full_precision():  # weights load into the fp32 masters
            loaded = self.ckpt.load(path, models=self._loaded_models(), **self._optim_state())
        self._after_load(loaded.path)
        self.sampler.load_state_dict(loaded.extra["data"])
        self.step = loaded.step
        self.tokens_seen = int(loaded.trainer_state.get("tokens_seen", 0))
        self.train_step.nonfinite_total = int(loaded.trainer_state.get("nonfinite_skips", 0))
        return True

    def _loaded_models(self) -> dict[str, Any]:
        """The models `CheckpointManager.load` restores in place (a remote loop loads them itself)."""
        return self.models

    def _after_load(self, path: Any) -> None:
        """Hook after the checkpoint at `path` was loaded (a remote loop loads its workers here)."""

    def save(self, metrics: dict[str, float]) -> Any:
        assert self.ckpt is not None
        state = {
            "tokens_seen": self.tokens_seen,
            "total_steps": self.settings.total_steps,  # a continued run with another total says how its lr changes
            "epoch": self.sampler.epoch,
            "nonfinite_skips": self.train_step.nonfinite_total,
            "metrics": metrics,
        }
        with self.train_step.full_precision():  # checkpoints hold the exact fp32 weights
            return self._save(state, metrics)

    def _save(self, state: dict[str, Any], metrics: dict[str, float]) -> Any:
        assert self.ckpt is not None
        return self.ckpt.save(
            self.step,
            models=self.models,
            tokenizer=self.tokenizer,
            trainer_state=state,
            extra={"data": self.sampler.state_dict()},
            metric=metrics.get(self.settings.best_metric),
            **self._optim_state(),
        )

    def fit(self, stop: Any = None) -> FitResult:
        """Run until `settings.total_steps` optimizer steps are done (continuing after `resume`). `stop`: an
        object whose `signum` becomes non-None on SIGINT / SIGTERM (relayrl.training.signals.SignalFlag):
        the loop then finishes the step, writes a checkpoint and returns with `stopped_by` set."""
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
            t0 = time.perf_counter()
            out = self.train_step.step(self.collate(self.sampler.next_indices()))
            dt = time.perf_counter() - t0
            self.step += 1
            self.tokens_seen += out.tokens
            metrics = {
                "train/loss": out.loss,
                "train/lr": out.lr,
                "train/grad_norm": out.grad_norm,
                "train/target_tokens": out.count,
                "train/epoch": self.sampler.epoch,
                "train/nonfinite_skips": float(self.train_step.nonfinite_total),
                "perf/tokens_per_s": out.tokens / dt if dt > 0 else 0.0,
                "perf/step_s": dt,
                "perf/tokens_seen": self.tokens_seen,
                **{f"train/{k}": v for k, v in out.metrics.items()},
            }
            last = self.step == s.total_steps
            if self.eval_batches is not None and ((s.eval_every and self.step % s.eval_every == 0) or last):
                metrics.update(self.train_step.evaluate(self.eval_batches()))
            if self.logger is not None and (self.step % s.log_every == 0 or last or "eval/loss" in metrics):
                self.logger.log(metrics, self.step)
            history.append({"step": self.step, **metrics})
            if self.ckpt is not None and (
                (s.save_every and self.step % s.save_every == 0) or (last and s.save_final)
            ):
                last_ckpt = self.save(metrics)
        return FitResult(step=self.step, history=history, last_checkpoint=last_ckpt)
