"""Dynamic sampling (DAPO, arXiv 2503.14476, section 3.2): drop prompt groups that carry no learning signal.

A group = the n contiguous samples of one prompt (scores [B], B = G * n). A group is dropped when

- its scores have zero variance (max - min <= atol; any constant score, not only all-0 / all-1), or
- its mean score falls outside [mean_low, mean_high] (when a range is given; bounds inclusive).

Non-finite scores raise a ValueError naming the rows (a NaN group would otherwise look "varied" or not
depending on where the NaN sits). Fractions in the metrics divide by the number of groups.

`dynamic_filter(scores, group_size=, mean_range=None, atol=0.0) -> (kept_groups [G_k] long,
dropped_groups [G_d] long, metrics)`: group indices, so the loop can refill (generate more prompts until it
has enough kept groups). `group_rows(groups, group_size)` expands group indices to row indices.
"""

from __future__ import annotations

import torch
from torch import Tensor

Metrics = dict[str, float]


def dynamic_filter(
    scores: Tensor, *, group_size: int, mean_range: tuple[float, float] | None = None, atol: float = 0.0
) -> tuple[Tensor, Tensor, Metrics]:
    """Keep groups with score spread > atol and mean in mean_range. Metrics: kept/dropped counts, fractions."""
    if group_size < 2:
        raise ValueError(f"dynamic filtering needs group_size >= 2 samples per prompt, got {group_size}")
    if scores.dim() != 1 or scores.numel() % group_size:
        raise ValueError(
            f"scores must be [G * n] with n = group_size = {group_size}, got shape {tuple(scores.shape)}"
        )
    rows = (~torch.isfinite(scores.detach())).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"dynamic filtering: scores are non-finite at rows {rows[:10]}; fix the reward source"
        )
    if atol < 0:
        raise ValueError(f"dynamic filtering: atol must be >= 0, got {atol}")
    if mean_range is not None and mean_range[0] > mean_range[1]:
        raise ValueError(f"dynamic filtering: mean_range (low, high) is empty: {mean_range}")
    g = scores.detach().to(torch.float64).reshape(-1, group_size)
    zero_var = (g.amax(dim=1) - g.amin(dim=1)) <= atol
    out_of_range = torch.zeros_like(zero_var)
    if mean_range is not None:
        lo, hi = mean_range
        mean = g.mean(dim=1)
        out_of_range = (mean < lo) | (mean > hi)
    drop = zero_var | out_of_range
    idx = torch.arange(g.shape[0])
    n = max(g.shape[0], 1)
    metrics = {
        "groups_kept": float((~drop).sum()),
        "groups_dropped": float(drop.sum()),
        "groups_zero_var": float(zero_var.sum()),
        "groups_out_of_range": float((out_of_range & ~zero_var).sum()),
        "zero_var_frac": float(zero_var.sum()) / n,
        "out_of_range_frac": float((out_of_range & ~zero_var).sum()) / n,
    }
    return idx[~drop], idx[drop], metrics


def group_rows(groups: Tensor, group_size: int) -> Tensor:
    """Group indices [G] -> row indices [G * n] (rows g*n .. g*n+n-1, in order)."""
    return (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)
