"""The policy-loss seam: `POLICY_LOSSES[name](inputs, **params) -> (loss [B, T], metrics)`.

A policy loss returns the *per-token* loss (0 off the action mask); turning it into the scalar to backprop
is the separate aggregation step (`relayrl.algorithms.aggregation`), so the denominator is chosen once for
the whole optimizer step. All variants take the same keyword arguments:

- `eps_low`, `eps_high`: clip range [1 - eps_low, 1 + eps_high]; None = the variant's default
  (`eps_high` None = `eps_low` for PPO: symmetric clipping; a larger eps_high is DAPO's clip-higher).
- `dual_clip`: c > 1 caps the loss of negative-advantage tokens at -c * A (Ye et al., arXiv 1912.09729);
  None = off. Only PPO-style token losses use it.
- `log_ratio_clamp`: log(pi / pi_old) is clamped to [-clamp, +clamp] (default 20, i.e. ratios in
  [2e-9, 4.9e8]) before exp, so a stale or broken token cannot produce inf/nan. Gradients through clamped
  positions are 0.

Metrics (floats over this micro-batch's action tokens): `clip_frac` (tokens whose gradient is cut by the
clip), `ratio_mean`, `ratio_min`, `ratio_max`, `approx_kl` (k3 of pi_old -> pi: mean(r - 1 - log r)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

Metrics = dict[str, float]

LOG_RATIO_CLAMP = 20.0


@dataclass(kw_only=True, slots=True)
class PolicyLossInputs:
    """Per-token tensors for one micro-batch; every field is [B, T]."""

    logprobs: Tensor
    """float, requires grad: log pi_theta(a_t | s_t) of the current policy (temperature-scaled)."""
    old_logprobs: Tensor
    """float: log pi_old(a_t | s_t) from the policy that produced the experience (detached)."""
    advantages: Tensor
    """float: A_t (detached), 0 off the action mask."""
    action_mask: Tensor
    """bool/float: 1 on action tokens that get a loss (may already include an off-policy keep-mask)."""
    is_weight: Tensor | None = None
    """float or None: off-policy correction weight per token (TIS / ICEPOP / seq-mask-TIS, detached);
    multiplies the per-token loss."""


class PolicyLoss(Protocol):
    """`POLICY_LOSSES[name]`."""

    def __call__(
        self,
        inputs: PolicyLossInputs,
        *,
        eps_low: float | None = None,
        eps_high: float | None = None,
        dual_clip: float | None = None,
        log_ratio_clamp: float = LOG_RATIO_CLAMP,
    ) -> tuple[Tensor, Metrics]: ...


def check_inputs(inputs: PolicyLossInputs) -> None:
    """Shapes must agree; errors name the field."""
    shape = inputs.logprobs.shape
    for name in ("old_logprobs", "advantages", "action_mask", "is_weight"):
        x = getattr(inputs, name)
        if x is not None and x.shape != shape:
            raise ValueError(
                f"PolicyLossInputs.{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (logprobs)"
            )


def clamped_log_ratio(inputs: PolicyLossInputs, clamp: float) -> Tensor:
    """log(pi / pi_old) clamped to [-clamp, clamp]. [B, T]."""
    return (inputs.logprobs - inputs.old_logprobs.detach()).clamp(-clamp, clamp)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def finish(
    loss: Tensor, inputs: PolicyLossInputs, log_ratio: Tensor, clipped: Tensor
) -> tuple[Tensor, Metrics]:
    """Apply the IS weight and the mask; compute the common metrics."""
    mask = inputs.action_mask.to(loss.dtype)
    if inputs.is_weight is not None:
        loss = loss * inputs.is_weight.detach().to(loss.dtype)
    loss = loss * mask
    with torch.no_grad():
        lr = log_ratio.detach()
        ratio = lr.exp()
        m = inputs.action_mask.bool()
        any_tok = bool(m.any())
        metrics = {
            "clip_frac": float(masked_mean(clipped.to(lr.dtype), m)),
            "ratio_mean": float(masked_mean(ratio, m)),
            "ratio_min": float(ratio[m].min()) if any_tok else 1.0,
            "ratio_max": float(ratio[m].max()) if any_tok else 1.0,
            "approx_kl": float(masked_mean(ratio - 1 - lr, m)),
        }
    return loss, metrics
