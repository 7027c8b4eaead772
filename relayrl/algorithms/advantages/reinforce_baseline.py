"""`reinforce_baseline`: REINFORCE++-baseline (group mean baseline, then batch whitening).

Paper: Hu, "REINFORCE++", arXiv 2501.03262 (the "-baseline" variant for n samples per prompt).

    s_i = r_i - mean_{j in group(i)} r_j
    R_t = -beta * kl_t + [t = last action token] * s_i
    G_t = sum_{k >= t} gamma^(k - t) R_k            (over action tokens only)
    A_t = (G_t - mean(G)) / (std(G) + eps)           over ALL action tokens of the batch

Denominators: the group mean divides by n; the whitening mean by N and its (unbiased) variance by N - 1,
N = action tokens of the whole batch (all data-parallel ranks when `AdvantageInputs.stats_reducer` sums the
moments across ranks). Defaults gamma = 1, eps = 1e-6; `whiten=False` skips the whitening. Needs
group_size >= 2.
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


def reinforce_baseline(
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
    whiten: bool | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """REINFORCE++-baseline advantages. Uses gamma, eps (lam unused). -> (A [B,T], G [B,T], metrics)."""
    check_inputs(inputs, need_group=True)
    g = group_view(float_rewards(inputs), inputs.group_size)
    scores = zero_equal_groups(g - g.mean(dim=1, keepdim=True), g)
    adv, ret, metrics = scores_to_advantages(
        scores, inputs, gamma=gamma, eps=eps, whiten=True if whiten is None else whiten
    )
    return adv, ret, {**metrics, **group_stats_metrics(g)}
