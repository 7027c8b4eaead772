"""KTO: Kahneman-Tversky Optimization (Ethayarajh et al. 2024, arXiv 2402.01306, eq. 8).

    r_i  = log pi(y_i|x_i) - log pi_ref(y_i|x_i)             log-probs summed over response tokens
    z0   = max(0, mean_j [log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)])   detached; y'_j a response of ANOTHER
                                                               prompt of the same batch (the KL reference point)
    desirable    loss_i = lambda_D (1 - sigmoid(beta (r_i - z0)))
    undesirable  loss_i = lambda_U (1 - sigmoid(beta (z0 - r_i)))

Denominator: samples. Departure from OpenRLHF (which estimates z0 per micro-batch): z0 is the mean over the
whole optimizer step's batch on every rank, so the update does not depend on micro-batching or rank count.
"""

from __future__ import annotations

import torch
from torch import Tensor


def kto_reference_point(kl_sum: Tensor | float, kl_count: Tensor | float) -> Tensor:
    """z0 = max(0, kl_sum / kl_count) from the batch's summed mismatched log-ratios (detached)."""
    z = torch.as_tensor(kl_sum, dtype=torch.float64) / max(float(kl_count), 1.0)
    return z.clamp(min=0.0).detach()


def kto(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    z0: Tensor | float,
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """[N] log-probs, [N] bool -> (loss [N], per-sample metrics: reward = beta r, detached)."""
    r = policy_logps - ref_logps
    z = torch.as_tensor(z0, dtype=r.dtype, device=r.device)
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (z - r)))
    loss = torch.where(desirable, good, bad)
    return loss, {"reward": beta * r.detach()}
