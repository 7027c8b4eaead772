"""`gae`: Generalized Advantage Estimation with a critic (PPO).

Paper: Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
arXiv 1506.02438; used by PPO (arXiv 1707.06347) and OpenRLHF's PPO.

    R_t     = -beta * kl_t + [t = last action token] * r + d_t      (d: dense rewards, when given)
    delta_t = R_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    returns = A + V

over action tokens only: "t+1" is the next action token of the row (environment-feedback tokens of a
multi-turn trajectory are skipped), V after the last action token is 0 (terminal). Defaults gamma = 1
(undiscounted, as in LLM RLHF: the reward is a single terminal score) and lam = 0.95 (OpenRLHF's default;
lam < 1 trades a little bias for a large variance cut when the critic is imperfect). No whitening unless
`whiten=True` (then over all action tokens of the batch; denominator = action-token count).
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.algorithms.advantages.base import (
    AdvantageInputs,
    Metrics,
    batch_whiten,
    check_inputs,
    compute_dtype,
    masked_backward_scan,
    next_action_values,
    summarize,
    token_rewards,
)


def gae(
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
    whiten: bool | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """GAE advantages and returns. Uses gamma, lam; eps only when whiten=True. -> (A [B,T], returns [B,T], metrics)."""
    check_inputs(inputs, need_values=True)
    assert inputs.values is not None
    mask = inputs.action_mask.bool()
    values = inputs.values.detach()
    values = torch.where(mask, values.to(compute_dtype(values)), 0.0)  # padding values are never read
    r = token_rewards(
        inputs.rewards.detach().to(values.dtype), mask, inputs.kl, inputs.kl_coef, inputs.dense_rewards
    )
    delta = (r + gamma * next_action_values(values, mask) - values) * mask
    adv = masked_backward_scan(delta, mask, gamma * lam)
    returns = (adv + values) * mask
    metrics: Metrics = {}
    if whiten:
        adv, metrics = batch_whiten(adv, inputs, eps)
    m = mask.to(values.dtype)
    v_mean = float((values * m).sum() / m.sum().clamp(min=1))
    return adv, returns, {**summarize(adv, returns, inputs), **metrics, "value_mean": v_mean}
