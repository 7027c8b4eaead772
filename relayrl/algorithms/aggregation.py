"""Loss aggregation: per-token loss [B, T] -> the scalar to backprop, with explicit global denominators.

`AGGREGATIONS[name](loss, action_mask, *, num_tokens, num_seqs, norm_const=None) -> (scalar, metrics)`

The denominators describe the WHOLE optimizer step: all micro-batches of the step on all data-parallel
ranks (`step_denominators` counts them locally; all-reduce (sum) the two numbers across ranks). Each
micro-batch's returned scalar is its share of the step's loss, so

    sum over micro-batches and ranks of grad(aggregate(micro-batch)) == grad(aggregate(whole step))

exactly: accumulate gradients by summing (no extra division by the number of micro-batches), and sum
across ranks. DDP/FSDP *average* gradients over ranks, so under them multiply the loss by world_size.

| name                      | formula                                                  | paper             |
|---------------------------|----------------------------------------------------------|-------------------|
| `token_mean`              | sum_{i,t} m l / num_tokens                                | DAPO 2503.14476   |
| `seq_mean_token_mean`     | sum_i [ sum_t m l / sum_t m ] / num_seqs                  | GRPO 2402.03300   |
| `seq_mean_token_sum_norm` | sum_i [ sum_t m l / norm_const ] / num_seqs               | Dr.GRPO 2503.20783|

num_tokens = action tokens in the step; num_seqs = sequences with >= 1 action token in the step;
norm_const = a constant (Dr. GRPO: the max generation length), required by `seq_mean_token_sum_norm`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from torch import Tensor

Metrics = dict[str, float]


class Aggregation(Protocol):
    """`AGGREGATIONS[name]`."""

    def __call__(
        self,
        loss: Tensor,
        action_mask: Tensor,
        *,
        num_tokens: float,
        num_seqs: float,
        norm_const: float | None = None,
    ) -> tuple[Tensor, Metrics]: ...


def step_denominators(action_masks: Iterable[Tensor]) -> tuple[float, float]:
    """(num_tokens, num_seqs) of a step given its micro-batches' masks (this rank; all-reduce to globalise)."""
    tokens = seqs = 0.0
    for m in action_masks:
        tokens += float(m.sum())
        seqs += float((m.sum(dim=-1) > 0).sum())
    return tokens, seqs


def _check(name: str, value: float | None) -> float:
    if value is None or value <= 0:
        raise ValueError(f"aggregation needs {name} > 0 (the whole optimizer step's count), got {value}")
    return float(value)


def token_mean(
    loss: Tensor, action_mask: Tensor, *, num_tokens: float, num_seqs: float, norm_const: float | None = None
) -> tuple[Tensor, Metrics]:
    """sum_{i,t} mask * loss / num_tokens (every action token of the step weighs the same)."""
    out = (loss * action_mask.to(loss.dtype)).sum() / _check("num_tokens", num_tokens)
    return out, {"loss": float(out.detach())}


def seq_mean_token_mean(
    loss: Tensor, action_mask: Tensor, *, num_tokens: float, num_seqs: float, norm_const: float | None = None
) -> tuple[Tensor, Metrics]:
    """sum_i (sum_t mask * loss / sum_t mask) / num_seqs (every sequence weighs the same)."""
    m = action_mask.to(loss.dtype)
    per_seq = (loss * m).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)
    out = per_seq.sum() / _check("num_seqs", num_seqs)
    return out, {"loss": float(out.detach())}


def seq_mean_token_sum_norm(
    loss: Tensor, action_mask: Tensor, *, num_tokens: float, num_seqs: float, norm_const: float | None = None
) -> tuple[Tensor, Metrics]:
    """sum_i (sum_t mask * loss / norm_const) / num_seqs (Dr. GRPO: constant norm_const, e.g. max length)."""
    m = action_mask.to(loss.dtype)
    out = (loss * m).sum() / _check("norm_const", norm_const) / _check("num_seqs", num_seqs)
    return out, {"loss": float(out.detach())}


AGGREGATIONS: dict[str, Aggregation] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "seq_mean_token_sum_norm": seq_mean_token_sum_norm,
}
