"""Critic loss with value clipping (PPO).

Papers: Schulman et al. PPO arXiv 1707.06347 (value clipping as in the OpenAI baselines / OpenRLHF PPO).

    v_clip = old_v + clamp(v - old_v, -clip_eps, clip_eps)
    loss_t = 0.5 * max((v - G)^2, (v_clip - G)^2)        (clip_eps = None: 0.5 * (v - G)^2)

Per-token loss [B, T] (0 off the mask); aggregate with `relayrl.algorithms.aggregation` (token_mean is the
usual choice). Default clip_eps = 0.2. Metrics (denominator: this micro-batch's action-token count):
`value_clip_frac` (tokens where the clipped term is the max and differs), `value_error` (mean of (v - G)^2),
0-dim tensors on the inputs' device (no host read per micro-batch).
float16 / bfloat16 inputs are computed in float32; masked positions are never read.
"""

from __future__ import annotations

import torch
from torch import Tensor

Metrics = dict[str, Tensor]


def wide(x: Tensor) -> Tensor:
    """float16 / bfloat16 -> float32 (differentiable); other dtypes unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor, *, clip_eps: float | None = 0.2
) -> tuple[Tensor, Metrics]:
    """Clipped value loss. values requires grad; old_values, returns detached. -> (loss [B, T], metrics)."""
    if not values.shape == old_values.shape == returns.shape == action_mask.shape:
        raise ValueError(
            f"value_loss: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)} and action_mask {tuple(action_mask.shape)} must all be [B, T]"
        )
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"value_loss clip_eps must be > 0, or None for no clipping; got {clip_eps}")
    mask = action_mask.bool()
    values = torch.where(mask, wide(values), 0.0)  # padding is never read (no NaN from it in the gradient)
    ret = torch.where(mask, wide(returns.detach()), 0.0)
    m = mask.to(values.dtype)
    err = (values - ret) ** 2
    clipped = torch.zeros_like(err, dtype=torch.bool)
    if clip_eps is not None:
        old = torch.where(mask, wide(old_values.detach()), 0.0)
        v_clip = old + (values - old).clamp(-clip_eps, clip_eps)
        err_clip = (v_clip - ret) ** 2
        clipped = err_clip > err
        err = torch.maximum(err, err_clip)
    loss = 0.5 * err * m
    n = m.sum().clamp(min=1)
    with torch.no_grad():
        metrics = {
            "value_clip_frac": (clipped.to(m.dtype) * m).sum() / n,
            "value_error": (((values - ret) ** 2) * m).sum() / n,
        }
    return loss, metrics
