"""Entropy of the temperature-scaled next-token distribution, as a metric or a bonus.

The distribution is the one the rollout engine sampled from: p = softmax(logits / temperature)
(top-p / top-k truncation is not modelled; see `off_policy` for correcting that mismatch).

    H_t = logsumexp(z) - sum_v p_v z_v,  z = logits / temperature

For long sequences and big vocabularies compute it with `relayrl.models.logprobs.token_logprobs(...,
with_entropy=True)` (chunked, never a full [B, T, V] fp32 tensor); `entropy_from_logits` is for small
logits. The bonus is a per-token loss -coef * H_t aggregated like the policy loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

Metrics = dict[str, float]


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """[..., V] -> [...]: entropy of softmax(logits / temperature), computed in float32 or wider."""
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    z = z / temperature
    logp = torch.log_softmax(z, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def entropy_bonus(entropy: Tensor, action_mask: Tensor, *, coef: float) -> tuple[Tensor, Metrics]:
    """Per-token loss -coef * H_t [B, T] (0 off the mask; subtracting entropy = a bonus). Metric `entropy`
    = mean over action tokens. coef = 0 gives a zero loss (metric only)."""
    m = action_mask.to(entropy.dtype)
    mean = float(entropy.detach().mul(m).sum() / m.sum().clamp(min=1))
    return -coef * entropy * m, {"entropy": mean}
