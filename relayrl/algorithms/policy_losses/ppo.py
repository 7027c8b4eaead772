"""`ppo` / `dual_clip`: the PPO clipped surrogate, per token.

Papers: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv 1707.06347 (clip);
DAPO, arXiv 2503.14476 (clip-higher: eps_high > eps_low); Ye et al., "Mastering Complex Control in MOBA
Games with Deep RL", arXiv 1912.09729 (dual-clip).

    r_t    = exp(clamp(log pi - log pi_old, -20, 20))
    loss_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)
    dual:  loss_t = min(loss_t, -c A_t)  where A_t < 0       (c > 1; i.e. -max(min(...), c A_t))

Defaults: eps_low = 0.2, eps_high = eps_low (symmetric); `dual_clip` registry entry: c = 3.0.
Per-token loss; the normalising denominator is chosen by the aggregation step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.policy_losses.base import (
    LOG_RATIO_CLAMP,
    Metrics,
    PolicyLossInputs,
    check_eps,
    check_inputs,
    clamped_log_ratio,
    finish,
    masked,
    masked_mean,
)


def ppo_clip(
    inputs: PolicyLossInputs,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Tensor, Metrics]:
    """PPO clipped surrogate (optionally clip-higher and dual-clip). -> (loss [B, T], metrics)."""
    check_inputs(inputs)
    lo = 0.2 if eps_low is None else eps_low
    hi = lo if eps_high is None else eps_high
    check_eps(lo, hi)
    adv = masked(inputs.advantages.detach(), inputs.action_mask)
    log_ratio = clamped_log_ratio(inputs, log_ratio_clamp)
    ratio = log_ratio.exp()
    surr1 = ratio * adv
    surr2 = ratio.clamp(1 - lo, 1 + hi) * adv
    loss = -torch.min(surr1, surr2)
    clipped = surr2 < surr1
    dual_frac = None
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); use None to turn it off")
        capped = (adv < 0) & (loss > -dual_clip * adv)
        loss = torch.where(capped, -dual_clip * adv, loss)
        clipped = clipped | capped
        dual_frac = masked_mean(capped.to(ratio.dtype), inputs.action_mask.bool())
    loss, metrics = finish(loss, inputs, log_ratio, clipped)
    if dual_frac is not None:
        metrics["dual_clip_frac"] = dual_frac
    return loss, metrics


def dual_clip_ppo(
    inputs: PolicyLossInputs,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Tensor, Metrics]:
    """PPO with dual-clip on (c defaults to 3.0). -> (loss [B, T], metrics)."""
    c = 3.0 if dual_clip is None else dual_clip
    return ppo_clip(inputs, eps_low=eps_low, eps_high=eps_high, dual_clip=c, log_ratio_clamp=log_ratio_clamp)
