"""Loss aggregation: per-token loss [B, T] -> a SUM and the COUNT it is a sum over.

`AGGREGATIONS[name](loss, action_mask, *, norm_const=None) -> (loss_sum, count, metrics)`

loss_sum is a differentiable 0-dim tensor, count a 0-dim float tensor without gradient (float32, float64
for float64 losses). Nothing is divided by a global denominator here: the training core sums loss_sum and
count over every micro-batch of the optimizer step on every rank and divides the summed gradients once by
the total count, so the step's objective is

    L = sum over micro-batches and ranks of loss_sum  /  sum over micro-batches and ranks of count

which equals the formula below over the whole step however it is split (tested), and needs no count
before the forward passes. A micro-batch without action tokens gives (0, 0).

| name                      | loss_sum                           | count (denominator)                 | paper              |
|---------------------------|------------------------------------|-------------------------------------|--------------------|
| `token_mean`              | sum_{i,t} m l                      | action tokens: sum_{i,t} m          | DAPO 2503.14476    |
| `seq_mean_token_mean`     | sum_i [sum_t m l / max(1, sum_t m)]| sequences with >= 1 action token    | GRPO 2402.03300    |
| `seq_mean_token_sum_norm` | sum_i [sum_t m l / norm_const]     | sequences with >= 1 action token    | Dr.GRPO 2503.20783 |

so the step's value is: token_mean = the mean over the step's action tokens; seq_mean_token_mean = the mean
over sequences of each sequence's token mean (GRPO's original per-sequence normalisation); Dr. GRPO = the
mean over sequences of each sequence's token SUM over a constant (Dr. GRPO's fix of the length bias:
norm_const = the generation budget, e.g. rollout.max_new_tokens; required, > 0).

m = action_mask (bool). Padding is removed with `torch.where(m, loss, 0)`, never `loss * m`, so NaN / inf at
masked positions reach neither the value nor the gradient (d loss_sum / d loss is exactly 0 there).
float16 / bfloat16 losses are summed in float32. Metrics: none (the value is the core's sum / sum; a float
here would synchronise the device on every micro-batch).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

Metrics = dict[str, float]

__all__ = [
    "Aggregation",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
    "token_mean",
]


class Aggregation(Protocol):
    """`AGGREGATIONS[name]`."""

    def __call__(
        self, loss: Tensor, action_mask: Tensor, *, norm_const: float | None = None
    ) -> tuple[Tensor, Tensor, Metrics]: ...


def _masked(loss: Tensor, action_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(loss with padding replaced by 0, in float32 or wider; the bool mask)."""
    if loss.shape != action_mask.shape or loss.dim() != 2:
        raise ValueError(
            f"aggregation: loss {tuple(loss.shape)} and action_mask {tuple(action_mask.shape)} must both be [B, T]"
        )
    if loss.dtype in (torch.float16, torch.bfloat16):
        loss = loss.float()
    mask = action_mask.bool()
    return torch.where(mask, loss, 0.0), mask


def _count(x: Tensor, like: Tensor) -> Tensor:
    return x.detach().to(torch.promote_types(like.dtype, torch.float32))


def token_mean(
    loss: Tensor, action_mask: Tensor, *, norm_const: float | None = None
) -> tuple[Tensor, Tensor, Metrics]:
    """loss_sum = sum_{i,t} m l; count = sum_{i,t} m (every action token of the step weighs the same)."""
    masked, mask = _masked(loss, action_mask)
    return masked.sum(), _count(mask.sum(), masked), {}


def seq_mean_token_mean(
    loss: Tensor, action_mask: Tensor, *, norm_const: float | None = None
) -> tuple[Tensor, Tensor, Metrics]:
    """loss_sum = sum_i (sum_t m l / max(1, sum_t m)); count = #{i : sum_t m >= 1} (every sequence weighs the
    same)."""
    masked, mask = _masked(loss, action_mask)
    tokens = mask.sum(dim=-1)
    per_seq = masked.sum(dim=-1) / tokens.clamp(min=1).to(masked.dtype)
    return per_seq.sum(), _count((tokens > 0).sum(), masked), {}


def seq_mean_token_sum_norm(
    loss: Tensor, action_mask: Tensor, *, norm_const: float | None = None
) -> tuple[Tensor, Tensor, Metrics]:
    """loss_sum = sum_i sum_t m l / norm_const; count = #{i : sum_t m >= 1} (Dr. GRPO: norm_const a constant,
    e.g. the max generation length; required, > 0)."""
    if norm_const is None or not (math.isfinite(norm_const) and norm_const > 0):
        raise ValueError(
            f"seq_mean_token_sum_norm needs norm_const > 0 (Dr. GRPO's constant, e.g. rollout.max_new_tokens), "
            f"got {norm_const}"
        )
    masked, mask = _masked(loss, action_mask)
    return masked.sum() / float(norm_const), _count((mask.sum(dim=-1) > 0).sum(), masked), {}
