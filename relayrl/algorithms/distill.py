"""On-policy distillation reward: the per-token reverse KL of the student (the policy that sampled) to a teacher.

Papers / recipes: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD, arXiv 2306.13649); Thinking Machines, "On-Policy Distillation" (2025). The student samples
x ~ pi; the teacher scores every sampled token; each action token t gets the dense reward

    d_t = -coef * (log pi(x_t | x_<t) - log pi_T(x_t | x_<t))

a one-sample (k1) estimate of -coef * KL(pi || pi_T) at position t, both log-probs under the same
temperature-scaled distributions. Departure from the Thinking Machines recipe (per-token advantage = d_t,
discount 0): d_t enters the run's advantage estimator as a dense reward (relayrl.algorithms.advantages:
R_t = ... + d_t), so with REINFORCE (gamma 1) each token's return is the reverse KL of the rest of the
sequence, the exact policy gradient of the sequence-level reverse KL; group estimators add d_t unbaselined.
Metric reverse_kl: mean of log pi - log pi_T over the batch's action tokens (denominator: action-token count).
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl_rewards(
    student_logprobs: Tensor, teacher_logprobs: Tensor, action_mask: Tensor, *, coef: float
) -> tuple[Tensor, dict[str, float]]:
    """(d [B, T] float32, {"reverse_kl": mean over action tokens}) from student / teacher log-probs [B, T] of
    the sampled tokens; 0 off the action mask."""
    mask = action_mask.bool()
    k1 = torch.where(mask, student_logprobs.float() - teacher_logprobs.float(), 0.0)
    n = mask.sum().clamp(min=1)
    return -coef * k1, {"reverse_kl": float(k1.sum() / n)}
