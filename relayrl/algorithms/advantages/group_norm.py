"""`group_norm`: GRPO's group-normalised outcome advantage.

Paper: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models"
(GRPO), arXiv 2402.03300, section 4.1.2 (outcome supervision).

    s_i = (r_i - mean_{group(i)} r) / (std_{group(i)} r + eps)     std: unbiased (Bessel, n - 1), as
                                                                 torch.std / OpenRLHF / TRL
    R_t = -beta * kl_t + [t = last action token] * s_i   (GRPO proper puts KL in the loss: kl_coef = 0 here)
    A_t = G_t = sum_{k >= t} gamma^(k - t) R_k            (= s_i on every action token when beta = 0, gamma = 1)

Denominators: the group mean divides by n, the group variance by n - 1. Defaults gamma = 1, eps = 1e-6. A
group with equal rewards (max == min) gets s = 0 exactly (zeroed, not computed: in float32 r - mean r leaves
a rounding residual that the zero std would divide). Needs group_size >= 2.
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


def group_norm(
    inputs: AdvantageInputs,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
    whiten: bool | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """GRPO advantages. Uses gamma, eps (lam unused). -> (A [B,T], G [B,T], metrics)."""
    check_inputs(inputs, need_group=True)
    g = group_view(float_rewards(inputs), inputs.group_size)
    scores = zero_equal_groups((g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, keepdim=True) + eps), g)
    adv, ret, metrics = scores_to_advantages(scores, inputs, gamma=gamma, eps=eps, whiten=bool(whiten))
    return adv, ret, {**metrics, **group_stats_metrics(g)}
