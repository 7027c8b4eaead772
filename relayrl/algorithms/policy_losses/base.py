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

Metrics (0-dim tensors on the inputs' device, so a micro-batch of the update reads nothing back to the host;
`float(m[name])` reads one; means divide by this micro-batch's action-token count, 0 / 1.0 when it has none):
`clip_frac` (tokens whose gradient is cut by the clip), `ratio_mean`, `ratio_min`, `ratio_max`, `approx_kl`
(k3 of pi_old -> pi: mean(r - 1 - log r)).

Numerics: float16 / bfloat16 inputs are computed (and the loss returned) in float32, float64 stays float64.
Non-finite values on action tokens raise a ValueError naming the field and rows when the inputs are host
tensors; on an accelerator the check would stall the device once per micro-batch, so there a non-finite value
reaches the loss and the train step's non-finite guard skips the update (relayrl/training/step.py; the policy
worker checks the experience's own tensors once per update, on the host). Masked positions (padding)
are replaced by 0 before any arithmetic, so garbage there reaches neither the loss nor its gradient. An empty
mask gives a zero loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

Metrics = dict[str, Tensor]

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


_FIELDS = ("logprobs", "old_logprobs", "advantages", "is_weight")


def check_inputs(inputs: PolicyLossInputs) -> None:
    """Shapes must agree and action tokens must carry finite values; errors name the field (and rows)."""
    shape = inputs.logprobs.shape
    for name in ("old_logprobs", "advantages", "action_mask", "is_weight"):
        x = getattr(inputs, name)
        if x is not None and x.shape != shape:
            raise ValueError(
                f"PolicyLossInputs.{name} has shape {tuple(x.shape)}, expected {tuple(shape)} (logprobs)"
            )
    if inputs.logprobs.device.type != "cpu":  # a host read per micro-batch: left to the step's guard
        return
    mask = inputs.action_mask.bool()
    bad = {n: ~torch.isfinite(x.detach()) & mask for n in _FIELDS if (x := getattr(inputs, n)) is not None}
    if bool(torch.stack([b.any() for b in bad.values()]).any()):
        name, b = next((n, b) for n, b in bad.items() if b.any())
        rows = b.any(dim=1).nonzero().flatten().tolist()
        raise ValueError(
            f"PolicyLossInputs.{name} has non-finite values on action tokens of rows {rows[:10]}; "
            "check the log-prob computation / advantage estimator that produced it"
        )


def check_eps(eps_low: float, eps_high: float) -> None:
    """The clip range [1 - eps_low, 1 + eps_high] needs eps_low, eps_high >= 0."""
    if eps_low < 0 or eps_high < 0:
        raise ValueError(
            f"policy-loss clip needs eps_low >= 0 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}"
        )


def wide(x: Tensor) -> Tensor:
    """float16 / bfloat16 -> float32 (differentiable); other dtypes unchanged."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x (widened) on action tokens, 0 elsewhere; the gradient at masked positions is exactly 0."""
    return torch.where(mask.bool(), wide(x), 0.0)


def clamped_log_ratio(inputs: PolicyLossInputs, clamp: float) -> Tensor:
    """log(pi / pi_old) on action tokens (0 elsewhere), clamped to [-clamp, clamp]. [B, T]."""
    m = inputs.action_mask
    return (masked(inputs.logprobs, m) - masked(inputs.old_logprobs.detach(), m)).clamp(-clamp, clamp)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def finish(
    loss: Tensor, inputs: PolicyLossInputs, log_ratio: Tensor, clipped: Tensor
) -> tuple[Tensor, Metrics]:
    """Apply the IS weight and the mask; compute the common metrics."""
    mask = inputs.action_mask.bool()
    if inputs.is_weight is not None:
        loss = loss * masked(inputs.is_weight.detach(), mask).to(loss.dtype)
    loss = torch.where(mask, loss, 0.0)
    with torch.no_grad():
        lr = log_ratio.detach()
        ratio = lr.exp()
        m = inputs.action_mask.bool()
        any_tok = m.any()
        one = ratio.new_ones(())  # min / max of an empty mask: 1.0, without reading the mask on the host
        metrics = {
            "clip_frac": masked_mean(clipped.to(lr.dtype), m),
            "ratio_mean": masked_mean(ratio, m),
            "ratio_min": torch.where(any_tok, ratio.masked_fill(~m, math.inf).amin(), one),
            "ratio_max": torch.where(any_tok, ratio.masked_fill(~m, -math.inf).amax(), one),
            "approx_kl": masked_mean(ratio - 1 - lr, m),
        }
    return loss, metrics
