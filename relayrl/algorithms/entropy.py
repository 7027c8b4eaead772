"""Entropy of the temperature-scaled next-token distribution, as a metric or a bonus.

The distribution is the one the rollout engine sampled from: p = softmax(logits / temperature)
(top-p / top-k truncation is not modelled; see `off_policy` for correcting that mismatch).

    H_t = logsumexp(z) - sum_v p_v z_v,  z = logits / temperature

For long sequences and big vocabularies compute it with `relayrl.models.logprobs.head_logprobs(...,
with_entropy=True)` (chunked, never a full [B, T, V] fp32 tensor); `entropy_from_logits` is for small
logits. The bonus is a per-token loss -coef * H_t aggregated like the policy loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

Metrics = dict[str, Tensor]


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """[..., V] -> [...]: entropy of softmax(logits / temperature), computed in float32 or wider.

    Logits of -inf (a banned token) contribute 0 (p log p -> 0), not NaN, to the value and the gradient."""
    if temperature <= 0:
        raise ValueError(f"entropy temperature must be > 0 (the sampling temperature), got {temperature}")
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    logp = torch.log_softmax(z / temperature, dim=-1)
    finite_logp = logp.clamp(min=torch.finfo(logp.dtype).min)  # -inf -> most negative float; p = 0 there
    return -(logp.exp() * finite_logp).sum(dim=-1)


def entropy_bonus(entropy: Tensor, action_mask: Tensor, *, coef: float) -> tuple[Tensor, Metrics]:
    """Per-token loss -coef * H_t [B, T] (0 off the mask; subtracting entropy = a bonus). Metric `entropy`
    = sum over action tokens / their count (0 for an empty mask; a 0-dim tensor on the inputs' device). coef = 0
    gives a zero loss (metric only)."""
    m = action_mask.bool()
    ent = torch.where(m, entropy, 0.0)
    mean = ent.detach().sum() / m.sum().clamp(min=1)
    return -coef * ent, {"entropy": mean}
