"""`reinforce`: REINFORCE++ (critic-free, batch-whitened token returns).

Paper: Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
arXiv 2501.03262.

    R_t = -beta * kl_t + [t = last action token] * r
    G_t = sum_{k >= t} gamma^(k - t) R_k            (over action tokens only)
    A_t = (G_t - mean(G)) / (std(G) + eps)           mean/std over ALL action tokens of the batch

Denominators of the whitening statistics: mean = sum / N, var = sum of squared deviations / (N - 1) (unbiased),
N = action tokens of the whole batch (all data-parallel ranks when `AdvantageInputs.stats_reducer` sums the
moments across ranks).
Defaults gamma = 1, eps = 1e-6; `whiten=False` gives plain REINFORCE returns.
"""

from __future__ import annotations

from torch import Tensor

from relayrl.algorithms.advantages.base import (
    AdvantageInputs,
    Metrics,
    check_inputs,
    float_rewards,
    scores_to_advantages,
)


def reinforce(
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
    whiten: bool | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """REINFORCE++ advantages. Uses gamma, eps (lam unused). -> (A [B,T], G [B,T], metrics)."""
    check_inputs(inputs)
    return scores_to_advantages(
        float_rewards(inputs), inputs, gamma=gamma, eps=eps, whiten=True if whiten is None else whiten
    )
