"""The train step: ONE implementation of "forward/backward every micro-batch, normalise, clip, update" for SFT,
the RL policy, the critic, and the RM / DPO / KTO losses to come.

    step = TrainStep(model=model, optimizer=opt, scheduler=sched, grad_clip=1.0, precision="auto")
    out = step.step(micro_batches, loss_fn)        -> StepOutput(loss, count, grad_norm, lr, tokens, metrics,
                                                                 skipped)
    evals = step.evaluate(batches, loss_fn)         -> {"eval/loss": ..., "eval/<metric>": ...}

The loss contract (`LossFn`): `loss_fn(model, micro_batch) -> LossOutput(loss_sum, count, metrics,
metric_counts)`: the SUM of per-unit losses of the micro-batch and the number of units in it (target tokens
for SFT, action tokens or sequences for RL aggregations, pairs for DPO). One optimizer step's update is the
gradient of

    L = sum over every micro-batch i (and every rank) of loss_sum_i  /  sum over i (and ranks) of count_i

The step back-propagates each raw `loss_sum_i`, then multiplies the accumulated gradients by 1 / global
count once: the update does not depend on how the step is split into micro-batches (tested), and no count
is needed before the forward passes. Under torch.distributed the count is all-reduced and the gradients
(averaged over ranks by FSDP) are multiplied by world_size / global count; with a replicated model
(dist.replicate) they are summed over ranks after the last micro-batch (relayrl/training/replicate.py) and
multiplied by 1 / global count. Metrics are sums too, each
divided by its own global denominator (`metric_counts[name]`, default the loss count), also over ranks; a
metric whose denominator is 0 over the whole step is left out of the row (no made-up 0).
Ranks run the same number of forward passes (FSDP gathers weights in each, a collective): a rank with fewer
micro-batches repeats its last one with weight 0 (no loss, no gradient, no metric). Under FSDP2 the units'
communication follows the micro-batches as relayrl/training/sharded.py says: gradients reduced after the last
one only, and with keep_gathered (dist.keep_gathered) weights gathered at the first forward only; the norm and
clipping run on the local shards.
Under sequence parallelism (relayrl.models.sequence_parallel) the W ranks of a group compute the same
micro-batch's loss, so the all-reduced sums count it W times and are divided by W: with FSDP's average over
all R ranks, R / count then sums the gradients inside each group and averages them over the R / W groups.

Precision (relayrl/training/precision.py): with precision "bf16" (the default on a CUDA card that supports it)
the module computes with bf16 weights (under bf16 autocast for any fp32 leftovers) while the optimizer holds
fp32 master weights (`MasterWeights`): each bf16 gradient is added into its master's fp32 gradient as it is
produced, AdamW updates the masters (fp32 states), and the new weights are cast back into the module after
every step. CPU trains in fp32 (no masters: the module's weights are the fp32 weights).

Non-finite guard: when the summed loss or the gradient norm is NaN / inf, the optimizer and the scheduler
do not step (the gradients are dropped), `StepOutput.skipped` is True and the step is counted; after
`max_nonfinite` consecutive skips a `NonFiniteError` says so (the caller keeps its last good checkpoint).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Protocol

import torch

from relayrl.models import sequence_parallel
from relayrl.models.forward import to_device
from relayrl.training.collectives import comm_device, grouped
from relayrl.training.precision import PRECISIONS, MasterWeights, autocast, resolve_precision
from relayrl.training.replicate import all_reduce_grads
from relayrl.training.sharded import Units, clip_, scale_, total_norm

__all__ = [
    "PRECISIONS",
    "LossFn",
    "LossOutput",
    "NonFiniteError",
    "StepOutput",
    "TrainStep",
    "autocast",
    "move_to",
    "resolve_precision",
]

MAX_NONFINITE = 3
"""Consecutive optimizer steps with a non-finite loss or gradient before `NonFiniteError`."""


@dataclass(kw_only=True, slots=True)
class LossOutput:
    """What a loss function returns for one micro-batch."""

    loss_sum: torch.Tensor
    """0-dim, differentiable: the SUM of per-unit losses in this micro-batch."""
    count: float | torch.Tensor
    """Number of units in this micro-batch (its share of the step's denominator); a float or 0-dim tensor."""
    metrics: dict[str, float | torch.Tensor] = field(default_factory=dict)
    """Per-micro-batch SUMS; each is divided by the step's total of its denominator (`metric_counts`)."""
    metric_counts: dict[str, float | torch.Tensor] = field(default_factory=dict)
    """Denominator share of a metric when it is not `count` (e.g. a token metric of a per-sequence loss)."""


class LossFn(Protocol):
    """The pluggable loss: a function of the model's outputs on one micro-batch."""

    def __call__(self, model: torch.nn.Module, batch: Any, /) -> LossOutput: ...


@dataclass(kw_only=True, slots=True)
class StepOutput:
    """Result of one optimizer step."""

    loss: float
    """sum(loss_sum) / sum(count) over the step (every micro-batch of every rank)."""
    count: float
    """Total units in the step (every rank)."""
    grad_norm: float
    """Global gradient norm before clipping (after normalisation)."""
    lr: float
    """Learning rate used for this step (first param group)."""
    tokens: int
    """Input tokens processed by this rank (from the micro-batches' `num_tokens`), for tokens/s."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Loss metrics, each divided by its step total denominator."""
    skipped: bool = False
    """True when the update was dropped because the loss or a gradient was not finite."""


class NonFiniteError(RuntimeError):
    """Raised after `max_nonfinite` consecutive optimizer steps with a non-finite loss or gradient."""


def move_to(batch: Any, device: torch.device | str) -> Any:
    """Move every tensor in a (slotted) dataclass / dict / list / tensor to `device`."""
    if isinstance(batch, torch.Tensor):
        return to_device(batch, torch.device(device))  # pinned + async: a pageable copy stalls the GPU
    if is_dataclass(batch) and not isinstance(batch, type):
        return replace(
            batch, **{f.name: move_to(getattr(batch, f.name), device) for f in fields(batch) if f.init}
        )
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


class _Sums:
    """Running sums of a step's loss, count and metrics, kept as tensors (one host sync at the end)."""

    def __init__(self) -> None:
        self.loss: Any = 0.0
        self.count: Any = 0.0
        self.metrics: dict[str, Any] = {}
        self.counts: dict[str, Any] = {}

    def add(self, out: LossOutput, weight: float = 1.0) -> None:
        """Add a micro-batch's sums (weight 0: a padding pass, which adds its metric names only)."""
        self.loss = self.loss + out.loss_sum.detach().double() * weight
        self.count = self.count + _f64(out.count) * weight
        for k, v in out.metrics.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + _f64(v) * weight
            self.counts[k] = self.counts.get(k, 0.0) + _f64(out.metric_counts.get(k, out.count)) * weight

    def result(self) -> tuple[float, float, dict[str, float]]:
        """(loss, count, metrics) over every micro-batch of every rank (one all-reduce under a group)."""
        keys = sorted(self.metrics)
        flat = _sum_over_ranks(
            [float(self.loss), float(self.count)]
            + [float(self.metrics[k]) for k in keys]
            + [float(self.counts[k]) for k in keys]
        )
        replicas = sequence_parallel.size()  # the W ranks of an SP group all hold the same micro-batch's sums
        loss_sum, count = flat[0] / replicas, flat[1] / replicas
        loss = loss_sum / count if count > 0 else math.nan
        m, c = flat[2 : 2 + len(keys)], flat[2 + len(keys) :]
        # a metric none of whose units occurred this step (KTO's reward_undesirable in a step without an
        # undesirable sample) is left out, never reported as a made-up 0
        metrics = {k: v / n for k, v, n in zip(keys, m, c, strict=True) if n > 0}
        return loss, count, metrics


def _sum_over_ranks(values: list[float]) -> list[float]:
    if not grouped():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=comm_device())
    torch.distributed.all_reduce(t)
    return t.tolist()


def _max_over_ranks(n: int) -> int:
    if not grouped():
        return n
    t = torch.tensor([n], dtype=torch.int64, device=comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def padded_passes(micro_batches: Sequence[Any], num_real: int | None) -> list[tuple[Any, float]]:
    """(micro-batch, weight) for every pass: the same number of passes on every rank (FSDP gathers weights
    in each forward, a collective, so ranks must run equally many); extra passes repeat the last micro-batch
    with weight 0. `num_real`: the first num_real micro-batches count (default all)."""
    real = len(micro_batches) if num_real is None else num_real
    passes = _max_over_ranks(len(micro_batches))
    if passes and not micro_batches:
        raise ValueError(
            "this rank has no micro-batch while others have some: pass a padding micro-batch with num_real=0"
        )
    return [(micro_batches[min(i, len(micro_batches) - 1)], 1.0 if i < real else 0.0) for i in range(passes)]


def _f64(x: float | torch.Tensor) -> Any:
    return x.detach().double() if isinstance(x, torch.Tensor) else float(x)


class TrainStep:
    """One optimizer step over a list of micro-batches, and the eval loop. See the module docstring."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        loss_fn: LossFn | None = None,
        grad_clip: float = 1.0,
        precision: str = "auto",
        device: torch.device | str | None = None,
        max_nonfinite: int = MAX_NONFINITE,
        master: MasterWeights | None = None,
        defer_grad_sync: bool = False,
        keep_gathered: bool = False,
        reshard_after_forward: bool = True,
        replicate_grads: bool = False,
    ):
        self.model = model
        self.replicate_grads = replicate_grads
        """dist.replicate: the model is whole on every rank; the gradients are summed over the ranks after the
        last micro-batch (relayrl.training.replicate)."""
        self.units = Units(
            model,
            defer_grad_sync=defer_grad_sync,
            keep_gathered=keep_gathered,
            reshard_after_forward=reshard_after_forward,
        )
        """FSDP2: when the units gather, reshard and reduce across the micro-batches (training/sharded.py)."""
        self.master = master
        self.last_refresh_s = 0.0
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_fn = loss_fn
        self.grad_clip = grad_clip
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.precision = resolve_precision(precision, self.device)
        self.max_nonfinite = max_nonfinite
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision, self.device)

    def optimizer_params(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (the fp32 masters under bf16), in its order."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(
        self, micro_batches: Sequence[Any], loss_fn: LossFn | None = None, *, num_real: int | None = None
    ) -> StepOutput:
        """Forward/backward every micro-batch, normalise by the global count, clip, step optimizer + schedule.

        Under a process group every rank calls this together; the ranks' micro-batch lists may differ in
        length (padding passes even them out) and `num_real` < len marks trailing padding micro-batches
        (a rank whose share of the step is empty passes one, with num_real=0)."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("TrainStep.step needs a loss_fn (given here or to the constructor)")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums, tokens = _Sums(), 0
        passes = padded_passes(micro_batches, num_real)
        with self.units.step():
            for i, (mb, weight) in enumerate(passes):
                tokens += int(getattr(mb, "num_tokens", 0)) if weight else 0
                self.units.before(i, len(passes))
                with self.autocast():
                    out = loss_fn(self.model, move_to(mb, self.device))
                (out.loss_sum if weight else out.loss_sum * 0.0).backward()
                sums.add(out, weight)
        if self.replicate_grads:
            all_reduce_grads(self.optimizer_params())  # summed: the scale below is 1 / count
        loss, count, metrics = sums.result()
        averaged_over = torch.distributed.get_world_size() if grouped() and not self.replicate_grads else 1.0
        scale = averaged_over / max(count, 1e-12)
        grads = [p.grad for p in self.optimizer_params() if p.grad is not None]
        scale_(grads, scale)
        grad_norm = self._clip(grads)
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = not (math.isfinite(grad_norm) and (count == 0 or math.isfinite(loss)))
        if skipped:
            self._count_nonfinite(loss, grad_norm)
        else:
            self.nonfinite_in_a_row = 0
            if count > 0:
                self.optimizer.step()
                self._refresh()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepOutput(
            loss=loss,
            count=count,
            grad_norm=grad_norm,
            lr=lr,
            tokens=tokens,
            metrics=metrics,
            skipped=skipped,
        )

    def _clip(self, grads: list[torch.Tensor]) -> float:
        """Clip `grads` to grad_clip (<= 0: no clipping); returns the global norm before clipping (FSDP: over
        every shard of every rank)."""
        if not grads:
            return 0.0
        norm = total_norm(grads)  # FSDP2: over the local shards, one all-reduce (training/sharded.py)
        if self.grad_clip > 0:
            clip_(grads, self.grad_clip, norm)
        return float(norm)

    def _refresh(self) -> None:
        """Cast the updated fp32 masters into the module's compute weights (timed, device-synchronised)."""
        if self.master is None:
            return
        t0 = time.perf_counter()
        self.master.refresh()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.last_refresh_s = time.perf_counter() - t0

    def full_precision(self) -> contextlib.AbstractContextManager:
        """A block in which the module holds the exact fp32 weights (save / load checkpoints inside it)."""
        return self.master.full_precision() if self.master is not None else contextlib.nullcontext()

    def _count_nonfinite(self, loss: float, grad_norm: float) -> None:
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        if self.nonfinite_in_a_row >= self.max_nonfinite:
            raise NonFiniteError(
                f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss ({loss}) or gradient "
                f"norm ({grad_norm}); their updates were skipped. Lower optim.lr, check the data / rewards for "
                "NaN, or resume from the last checkpoint"
            )

    @torch.no_grad()
    def evaluate(
        self,
        batches: Iterable[Sequence[Any]],
        loss_fn: LossFn | None = None,
        prefix: str = "eval",
        *,
        num_real: int | None = None,
    ) -> dict[str, float]:
        """Unit-weighted eval loss (and metrics) over every micro-batch (of every rank): {prefix/loss,
        prefix/count, ...}. `num_real`: as in `step`, over the flattened micro-batches."""
        loss_fn = loss_fn or self.loss_fn
        if loss_fn is None:
            raise ValueError("TrainStep.evaluate needs a loss_fn (given here or to the constructor)")
        was_training = self.model.training
        self.model.eval()
        sums = _Sums()
        flat = [mb for step_batches in batches for mb in step_batches]
        for mb, weight in padded_passes(flat, num_real):
            with self.autocast():
                sums.add(loss_fn(self.model, move_to(mb, self.device)), weight)
        self.model.train(was_training)
        loss, count, metrics = sums.result()
        return {
            f"{prefix}/loss": loss,
            f"{prefix}/count": count,
            **{f"{prefix}/{k}": v for k, v in metrics.items()},
        }
