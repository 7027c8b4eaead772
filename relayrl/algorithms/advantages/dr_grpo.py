"""`dr_grpo`: Dr. GRPO ("GRPO done right"): group mean baseline, no std division.

Paper: Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783.

    s_i = r_i - mean_{group(i)} r
    A_t = G_t = sum_{k >= t} gamma^(k - t) R_k,  R_t = -beta * kl_t + [t = last action token] * s_i

It removes GRPO's two biases: the per-question std division (here) and the per-response length
normalisation (pair it with the aggregation `seq_mean_token_sum_norm`, a constant denominator such as the
max generation length). Denominator: the group mean divides by n. Defaults gamma = 1. Needs group_size >= 2.
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


def dr_grpo(
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
    whiten: bool | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """Dr. GRPO advantages. Uses gamma (lam, eps unused). -> (A [B,T], G [B,T], metrics)."""
    check_inputs(inputs, need_group=True)
    g = group_view(float_rewards(inputs), inputs.group_size)
    scores = zero_equal_groups(g - g.mean(dim=1, keepdim=True), g)
    adv, ret, metrics = scores_to_advantages(scores, inputs, gamma=gamma, eps=eps, whiten=bool(whiten))
    return adv, ret, {**metrics, **group_stats_metrics(g)}
