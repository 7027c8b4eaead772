"""The shared training-loop core: SFT now, RM / DPO / KTO later, and pieces of RL.

A recipe supplies three things and gets the rest (optimizer step, accumulation, clipping, autocast, eval,
periodic checkpoints, logging, exact resume):

    loss_fn(model, micro_batch) -> LossOutput(loss_sum, count, metrics)     the pluggable loss (a Protocol)
    collate(indices) -> list[micro_batch]                                   one optimizer step's micro-batches
    eval_batches() -> Iterable[list[micro_batch]]                           optional

Normalisation (the denominator): one optimizer step's update is the gradient of

    L = sum over every micro-batch i of loss_sum_i  /  sum over i of count_i

i.e. the sum of per-unit losses (units = target tokens for SFT) over the WHOLE step divided by the step's total
units. The core back-propagates each raw `loss_sum_i` and divides the accumulated gradients by the global count
once at the end, so the update does not depend on how the step is split into micro-batches (tested) and no
count is needed before the forward passes. Under torch.distributed the count is all-reduced and the gradients
(averaged by DDP/FSDP) are multiplied by world_size / global count. A loss that is already normalised can
return count=1 per micro-batch and pre-divide by the number of micro-batches.

Pieces: `build_optimizer` (AdamW, no decay on biases / norms / 1-D params), `build_scheduler` (linear warmup then
cosine / linear / constant down to `min_lr_ratio`), `TrainEngine` (one optimizer step, eval), `ResumableSampler`
(epoch + position, seeded shuffle per epoch), `Trainer` (the loop: step, eval, log, checkpoint, resume).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Protocol

import torch

from relayrl.trainers.checkpoint import CheckpointManager
from relayrl.trainers.logging import MetricsLogger

SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "fp32", "bf16")


# ---------------------------------------------------------------------------------------------- optimizer
def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decay on matrices; no decay on biases, norm weights and any other 1-D parameter."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or name.endswith(".bias") or "norm" in name.lower():
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters of `model` (see `param_groups`); fused on CUDA."""
    groups = param_groups(model, weight_decay)
    if not groups:
        raise ValueError(
            "the model has no trainable parameters (all requires_grad=False): nothing to optimize"
        )
    on_cuda = all(p.is_cuda for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=on_cuda or None)


def lr_factor(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr at optimizer step `step` (0-based).

    Warmup: (step + 1) / warmup_steps for step < warmup_steps. Then with progress p = (step - warmup) /
    max(1, total - warmup) in [0, 1]: cosine m + (1 - m)(1 + cos(pi p)) / 2; linear m + (1 - m)(1 - p);
    constant 1; where m = min_lr_ratio.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    if schedule == "linear":
        return min_lr_ratio + (1 - min_lr_ratio) * (1 - p)
    if schedule == "constant":
        return 1.0
    raise ValueError(f"optim.scheduler must be one of {SCHEDULES}, got {schedule!r}")


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_ratio: float = 0.0,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR following `lr_factor`; warmup_steps wins over warmup_ratio * total_steps when > 0.

    Call `scheduler.step()` once per optimizer step (TrainEngine does).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.scheduler must be one of {SCHEDULES}, got {schedule!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    warmup = warmup_steps if warmup_steps > 0 else round(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        return lr_factor(
            step, total_steps=total_steps, warmup_steps=warmup, schedule=schedule, min_lr_ratio=min_lr_ratio
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------- engine
@dataclass(kw_only=True, slots=True)
class LossOutput:
    """What a loss function returns for one micro-batch."""

    loss_sum: torch.Tensor
    """Scalar, differentiable: the SUM of per-unit losses (units: target tokens for SFT, pairs for DPO)."""
    count: float
    """Number of units in this micro-batch (the denominator's share)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra per-micro-batch SUMS over units; the core divides them by the step's total count."""


class LossFn(Protocol):
    """The pluggable loss: a pure function of the model's outputs on one micro-batch."""

    def __call__(self, model: torch.nn.Module, batch: Any) -> LossOutput: ...


@dataclass(kw_only=True, slots=True)
class StepOutput:
    """Result of one optimizer step."""

    loss: float
    """sum(loss_sum) / sum(count) over the step."""
    count: float
    """Total units (target tokens) in the step."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate used for this step (first param group)."""
    tokens: int
    """Input tokens processed (non-padding), for tokens/s."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra loss metrics, normalised by `count`."""


def move_to(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (slotted) dataclass / dict / list / tensor to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if is_dataclass(batch) and not isinstance(batch, type):
        return replace(
            batch, **{f.name: move_to(getattr(batch, f.name), device) for f in fields(batch) if f.init}
        )
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def resolve_precision(precision: str, device: torch.device) -> str:
    """ "auto" -> "bf16" on a CUDA device that supports it, else "fp32"; bf16 on CPU is refused."""
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and device.type != "cuda":
        raise ValueError("train.precision=bf16 autocast needs a CUDA device; use fp32 (or auto) on CPU")
    return precision


class TrainEngine:
    """One optimizer step over a list of micro-batches, and the eval loop. See the module docstring."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        grad_clip: float = 1.0,
        precision: str = "auto",
        device: torch.device | str | None = None,
    ):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.precision = resolve_precision(precision, self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.precision == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self, micro_batches: Sequence[Any]) -> StepOutput:
        """Forward/backward every micro-batch, normalise by the global count, clip, step optimizer + scheduler."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total, count, tokens, sums = 0.0, 0.0, 0, {}
        for mb in micro_batches:
            tokens += int(getattr(mb, "num_tokens", 0))
            mb = move_to(mb, self.device)
            with self.autocast():
                out = self.loss_fn(self.model, mb)
            out.loss_sum.backward()
            loss_total += float(out.loss_sum.detach())
            count += float(out.count)
            for k, v in out.metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        global_count, scale = self._global_scale(count)
        params = self._params()
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = float(self.optimizer.param_groups[0]["lr"])
        if global_count > 0:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        denom = max(count, 1e-12)
        return StepOutput(
            loss=loss_total / denom if count > 0 else math.nan,
            count=count,
            grad_norm=grad_norm,
            lr=lr,
            tokens=tokens,
            metrics={k: v / denom for k, v in sums.items()},
        )

    def _global_scale(self, count: float) -> tuple[float, float]:
        """(global count, gradient multiplier): 1 / count locally; world / global count under DDP/FSDP."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([count], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            total = float(t.item())
            return total, dist.get_world_size() / max(total, 1e-12)
        return count, 1.0 / max(count, 1e-12)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Sequence[Any]], prefix: str = "eval") -> dict[str, float]:
        """Token-weighted eval loss (and metrics) over every micro-batch: {prefix/loss, prefix/count, ...}."""
        was_training = self.model.training
        self.model.eval()
        loss_total, count, sums = 0.0, 0.0, {}
        for step_batches in batches:
            for mb in step_batches:
                with self.autocast():
                    out = self.loss_fn(self.model, move_to(mb, self.device))
                loss_total += float(out.loss_sum)
                count += float(out.count)
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
        self.model.train(was_training)
        denom = max(count, 1e-12)
        result = {f"{prefix}/loss": loss_total / denom if count > 0 else math.nan, f"{prefix}/count": count}
        result.update({f"{prefix}/{k}": v / denom for k, v in sums.items()})
        return result


# ---------------------------------------------------------------------------------------------- data order
class ResumableSampler:
    """Endless, resumable stream of per-step index lists over `num_samples` items.

    Epoch e visits a permutation seeded by (seed, e) (or 0..n-1 when shuffle is off) in chunks of
    `batch_size`; a short tail is dropped (every step has the same number of samples). The state is just
    {"epoch", "position"}, so a resumed run sees exactly the batches the uninterrupted run would have.
    """

    def __init__(self, num_samples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if num_samples < batch_size:
            raise ValueError(
                f"train.batch_size={batch_size} is larger than the dataset ({num_samples} samples): "
                "lower train.batch_size or add data"
            )
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                self._order = list(range(self.num_samples))
        return self._order

    def next_indices(self) -> list[int]:
        """The sample indices of the next optimizer step."""
        if self.position + self.batch_size > self.num_samples:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        chunk = self._epoch_order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return chunk

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_indices()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


# ---------------------------------------------------------------------------------------------- the loop
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


class Trainer:
    """The loop: sample indices -> collate -> TrainEngine.step -> eval -> log -> checkpoint; exact resume.

    `collate(indices)` returns one optimizer step's micro-batches; `eval_batches()` yields lists of
    micro-batches. `models` are what is saved in each checkpoint ({"model": model} for SFT).
    """

    def __init__(
        self,
        *,
        engine: TrainEngine,
        sampler: ResumableSampler,
        collate: Callable[[list[int]], list[Any]],
        settings: LoopSettings,
        ckpt: CheckpointManager | None = None,
        logger: MetricsLogger | None = None,
        eval_batches: Callable[[], Iterable[Sequence[Any]]] | None = None,
        tokenizer: Any = None,
        models: dict[str, torch.nn.Module] | None = None,
    ):
        self.engine, self.sampler, self.collate, self.settings = engine, sampler, collate, settings
        self.ckpt, self.logger, self.eval_batches, self.tokenizer = ckpt, logger, eval_batches, tokenizer
        self.models = models if models is not None else {"model": engine.model}
        self.step = 0
        self.tokens_seen = 0

    def resume(self, path: Any = None) -> bool:
        """Restore from `path` or the checkpoint manager's latest; False when there is none."""
        if self.ckpt is None or (path is None and self.ckpt.latest() is None):
            return False
        loaded = self.ckpt.load(
            path,
            models=self.models,
            optimizers={"model": self.engine.optimizer},
            schedulers={"model": self.engine.scheduler} if self.engine.scheduler is not None else {},
        )
        self.sampler.load_state_dict(loaded.extra["data"])
        self.step = loaded.step
        self.tokens_seen = int(loaded.trainer_state.get("tokens_seen", 0))
        return True

    def save(self, metrics: dict[str, float]) -> Any:
        assert self.ckpt is not None
        return self.ckpt.save(
            self.step,
            models=self.models,
            tokenizer=self.tokenizer,
            optimizers={"model": self.engine.optimizer},
            schedulers={"model": self.engine.scheduler} if self.engine.scheduler is not None else {},
            trainer_state={"tokens_seen": self.tokens_seen, "epoch": self.sampler.epoch, "metrics": metrics},
            extra={"data": self.sampler.state_dict()},
            metric=metrics.get(self.settings.best_metric),
        )

    def fit(self) -> FitResult:
        """Run until `settings.total_steps` optimizer steps are done (continuing after `resume`)."""
        s = self.settings
        history: list[dict[str, float]] = []
        last_ckpt = None
        while self.step < s.total_steps:
            t0 = time.perf_counter()
            out = self.engine.step(self.collate(self.sampler.next_indices()))
            dt = time.perf_counter() - t0
            self.step += 1
            self.tokens_seen += out.tokens
            metrics = {
                "train/loss": out.loss,
                "train/lr": out.lr,
                "train/grad_norm": out.grad_norm,
                "train/target_tokens": out.count,
                "train/epoch": self.sampler.epoch,
                "perf/tokens_per_s": out.tokens / dt if dt > 0 else 0.0,
                "perf/step_s": dt,
                "perf/tokens_seen": self.tokens_seen,
                **{f"train/{k}": v for k, v in out.metrics.items()},
            }
            last = self.step == s.total_steps
            if self.eval_batches is not None and ((s.eval_every and self.step % s.eval_every == 0) or last):
                metrics.update(self.engine.evaluate(self.eval_batches()))
            if self.logger is not None and (self.step % s.log_every == 0 or last or "eval/loss" in metrics):
                self.logger.log(metrics, self.step)
            history.append({"step": self.step, **metrics})
            if self.ckpt is not None and (
                (s.save_every and self.step % s.save_every == 0) or (last and s.save_final)
            ):
                last_ckpt = self.save(metrics)
        return FitResult(step=self.step, history=history, last_checkpoint=last_ckpt)
