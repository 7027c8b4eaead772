"""`rloo`: REINFORCE Leave-One-Out.

Paper: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
Feedback in LLMs", arXiv 2402.14740 (baseline from Kool et al. 2019).

    s_i = r_i - (sum_{j in group(i), j != i} r_j) / (n - 1)
    R_t = -beta * kl_t + [t = last action token] * s_i
    A_t = G_t = sum_{k >= t} gamma^(k - t) R_k      (over action tokens only; no whitening by default)

Defaults gamma = 1. Needs group_size n >= 2 (the leave-one-out mean divides by n - 1). Equivalently
s_i = n / (n - 1) * (r_i - mean_group r). `whiten=True` adds batch whitening as in `reinforce`.
A group whose rewards are all equal (max == min) gets s = 0 exactly.
"""

from __future__ import annotations

from torch import Tensor

from relayrl.algorithms.advantages.base import (
    AdvantageInputs,
    Metrics,
    check_inputs,
    float_rewards,
    group_stats_metrics,
    group_view,
    scores_to_advantages,
    zero_equal_groups,
)


def rloo(
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
    whiten: bool | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """RLOO advantages. Uses gamma (lam unused; eps only with whiten=True). -> (A [B,T], G [B,T], metrics)."""
    check_inputs(inputs, need_group=True)
    n = inputs.group_size
    g = group_view(float_rewards(inputs), n)
    scores = zero_equal_groups(g - (g.sum(dim=1, keepdim=True) - g) / (n - 1), g)
    adv, ret, metrics = scores_to_advantages(scores, inputs, gamma=gamma, eps=eps, whiten=bool(whiten))
    return adv, ret, {**metrics, **group_stats_metrics(g)}
