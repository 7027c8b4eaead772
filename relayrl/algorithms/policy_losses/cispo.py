"""`cispo`: Clipped IS-weight Policy Optimization (MiniMax-M1).

Paper: MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
arXiv 2506.13585, eq. 4-5.

    r_t    = exp(clamp(log pi - log pi_old, -20, 20))
    loss_t = -sg[ clip(r_t, 1 - eps_low, 1 + eps_high) ] * A_t * log pi(a_t)

Unlike PPO no token's gradient is dropped: the IS weight is clipped and stop-gradiented, the gradient is
always weight * A * grad log pi. Defaults eps_low = 1.0 (no lower bound, as the paper), eps_high = 0.28.
`clip_frac` counts tokens whose weight was clipped. `dual_clip` is not used.
"""

from __future__ import annotations

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
)


def cispo(
    inputs: PolicyLossInputs,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Tensor, Metrics]:
    """CISPO loss. -> (loss [B, T], metrics)."""
    check_inputs(inputs)
    lo = 1.0 if eps_low is None else eps_low
    hi = 0.28 if eps_high is None else eps_high
    check_eps(lo, hi)
    log_ratio = clamped_log_ratio(inputs, log_ratio_clamp)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1 - lo, 1 + hi)
    mask = inputs.action_mask
    loss = -weight * masked(inputs.advantages.detach(), mask) * masked(inputs.logprobs, mask)
    clipped = weight != ratio
    return finish(loss, inputs, log_ratio, clipped)
