"""Reward shaping on scalar rewards [B] before the advantage estimator.

- `clip_rewards(r, low=, high=)`: r <- clamp(r, low, high).
- `overlong_penalty(lengths, max_len=, buffer_len=, factor=1.0)`: DAPO's soft overlong punishment
  (arXiv 2503.14476, eq. 13), to be ADDED to the reward:
      0                                       if L <= max_len - buffer_len
      factor * ((max_len - buffer_len) - L) / buffer_len   if max_len - buffer_len < L <= max_len
      -factor                                  if L > max_len
  i.e. linear from 0 to -factor within the last `buffer_len` tokens before `max_len`.
- `truncation_penalty(r, truncated, penalty=, replace=False)`: responses cut at the length limit get
  r - penalty (or exactly -penalty with replace=True).
- `RunningRewardNorm`: running mean/var over all rewards seen (Chan et al. parallel update), normalises
  r <- (r - mean) / (std + eps) (or r / (std + eps) with center=False; no division while std = 0);
  `state_dict` for exact resume.

All functions return `(rewards or penalty [B], metrics)`; fractions in the metrics divide by B. Non-finite
rewards raise a ValueError naming the rows (clipping must not hide a broken reward function).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

Metrics = dict[str, float]


def check_finite(rewards: Tensor, where: str) -> None:
    """Raise a ValueError naming the rows whose reward is NaN or +-inf."""
    rows = (~torch.isfinite(rewards.detach())).flatten().nonzero().flatten().tolist()
    if rows:
        raise ValueError(f"{where}: rewards are non-finite at rows {rows[:10]}; fix the reward source")


def clip_rewards(rewards: Tensor, *, low: float, high: float) -> tuple[Tensor, Metrics]:
    """clamp(r, low, high). Metric `reward_clip_frac`."""
    check_finite(rewards, "clip_rewards")
    if low > high:
        raise ValueError(f"reward clip range is empty: low={low} > high={high}")
    out = rewards.clamp(low, high)
    return out, {"reward_clip_frac": float((out != rewards).float().mean()) if rewards.numel() else 0.0}


def overlong_penalty(
    lengths: Tensor, *, max_len: int, buffer_len: int, factor: float = 1.0
) -> tuple[Tensor, Metrics]:
    """DAPO soft overlong penalty [B] (<= 0; add it to the reward). lengths = response (action) lengths."""
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"overlong penalty needs 0 < buffer_len <= max_len, got buffer_len={buffer_len}, max_len={max_len}"
        )
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"overlong penalty: response lengths must be >= 0, got min {int(lengths.min())}")
    start = max_len - buffer_len
    L = lengths.to(torch.float64)
    pen = ((start - L) / buffer_len).clamp(min=-1.0, max=0.0) * factor
    pen = torch.where(max_len < L, torch.full_like(pen, -factor), pen)
    return pen, {"overlong_frac": float((start < L).float().mean()) if L.numel() else 0.0}


def truncation_penalty(
    rewards: Tensor, truncated: Tensor, *, penalty: float, replace: bool = False
) -> tuple[Tensor, Metrics]:
    """Truncated responses get r - penalty (replace=False) or -penalty (replace=True). Metric `truncated_frac`."""
    check_finite(rewards, "truncation_penalty")
    if truncated.shape != rewards.shape:
        raise ValueError(
            f"truncation_penalty: truncated {tuple(truncated.shape)} must match rewards {tuple(rewards.shape)}"
        )
    t = truncated.bool()
    new = torch.full_like(rewards, -penalty) if replace else rewards - penalty
    return torch.where(t, new, rewards), {"truncated_frac": float(t.float().mean()) if t.numel() else 0.0}


class RunningRewardNorm:
    """Running reward normalisation; statistics accumulate over every batch passed to `__call__`."""

    def __init__(self, *, center: bool = True, eps: float = 1e-8) -> None:
        self.center, self.eps = center, eps
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    @property
    def std(self) -> float:
        """Population std of everything seen (0 before two rewards)."""
        return (self.m2 / self.count) ** 0.5 if self.count > 1 else 0.0

    def update(self, rewards: Tensor) -> None:
        """Merge a batch into the running statistics (Chan et al. parallel algorithm)."""
        check_finite(rewards, "RunningRewardNorm")
        x = rewards.detach().to(torch.float64).flatten()
        n = x.numel()
        if n == 0:
            return
        b_mean, b_m2 = float(x.mean()), float(((x - x.mean()) ** 2).sum())
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    def __call__(self, rewards: Tensor) -> tuple[Tensor, Metrics]:
        """Update with this batch, then normalise it."""
        self.update(rewards)
        shifted = rewards - self.mean if self.center else rewards
        # std 0 (one reward or all equal so far): no scaling, else r / eps would blow up (e.g. 1 -> 1e8)
        out = shifted / (self.std + self.eps) if self.std > 0 else shifted
        return out, {"reward_running_mean": self.mean, "reward_running_std": self.std}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "center": self.center, "eps": self.eps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
        self.center, self.eps = bool(state["center"]), float(state["eps"])


class FixedRewardNorm:
    """Normalisation with fixed statistics, (r - mean) / std: a reward model's own mean / std over its
    training pairs (written by `relayrl rm` into its config.json as reward_mean / reward_std, as OpenRLHF)."""

    def __init__(self, mean: float, std: float, *, eps: float = 1e-8) -> None:
        if not std > 0:
            raise ValueError(f"reward std must be > 0, got {std}")
        self.mean, self.std, self.eps = float(mean), float(std), eps

    def __call__(self, rewards: Tensor) -> tuple[Tensor, Metrics]:
        check_finite(rewards, "FixedRewardNorm")
        return (rewards - self.mean) / (self.std + self.eps), {}

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.std = float(state["mean"]), float(state["std"])
