"""Off-policy correction for the rollout-engine vs trainer log-prob mismatch.

The engine (sampling kernels, bf16, top-p) and the trainer compute slightly different log-probs for the
same tokens; the experience is therefore off-policy w.r.t. the trainer's pi_old. With
w_t = pi_old(a_t) / pi_rollout(a_t) = exp(clamp(old_logprobs - rollout_logprobs, -20, 20)):

| name          | weight per token                        | mask                                              |
|---------------|-----------------------------------------|---------------------------------------------------|
| `none`        | 1 (0 off the action mask)               | none (low / high ignored)                         |
| `tis`         | clamp(w_t, low, high) (low 0: min(w, C))| none                                              |
| `icepop`      | w_t                                     | tokens with w_t outside [low, high] dropped       |
| `seq_mask_tis`| min(w_t, high)                          | sequences whose geometric-mean weight exp(mean_t log w_t) is outside [low, high] dropped |

`OFF_POLICY[name](old_logprobs, rollout_logprobs, action_mask, *, low=None, high=None) -> (is_weight [B, T],
keep_mask [B, T] bool, metrics)`; is_weight is float32 (float64 for float64 inputs) and 0 off the mask.
low / high None: the method's own default bounds below (what `algo.off_policy_low/high` None means).
A token the engine gave log-prob -inf gets log w = +20 (clamped); NaN on an action token raises (host tensors:
on an accelerator the check would stall the device once per micro-batch, and the train step's non-finite guard
catches what reaches the loss). Multiply
the per-token policy loss by is_weight (pass it as `PolicyLossInputs.is_weight`) and use
`action_mask & keep_mask` as its mask; aggregate with the unmasked action mask, so the count includes
dropped tokens as zero-loss tokens.

References: Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (blog,
2025; TIS, defaults low = 0, high = C = 2; OpenRLHF's interval form uses low = 0.5, high = 5); Ling team, Ring-1T / Ling 2.0 technical report (IcePop;
defaults low = 0.5, high = 5); seq-mask-TIS as in the follow-up MIS blog / verl rollout correction
(defaults low = 0.5, high = 2). Metrics (none for `none`), all means over the action tokens of the batch
(denominator: their count, at least 1): `is_weight_mean` (masked tokens count as weight 0), `masked_frac`, `kl_rollout_train`
(k3 estimate of KL(pi_rollout || pi_old), tokens sampled from pi_rollout: w - 1 - log w),
`kl_rollout_train_k1` (-log w); seq_mask_tis adds `masked_seq_frac` (of rows). The corrections' metrics are
0-dim tensors on the inputs' device (read one with float()); `logprob_mismatch`'s are floats.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

Metrics = dict[str, Tensor | float]

LOG_W_CLAMP = 20.0

__all__ = [
    "LOG_W_CLAMP",
    "OffPolicyCorrection",
    "icepop",
    "logprob_mismatch",
    "no_correction",
    "seq_mask_tis",
    "tis",
]


class OffPolicyCorrection(Protocol):
    """`OFF_POLICY[name]`."""

    def __call__(
        self,
        old_logprobs: Tensor,
        rollout_logprobs: Tensor,
        action_mask: Tensor,
        *,
        low: float | None = None,
        high: float | None = None,
    ) -> tuple[Tensor, Tensor, Metrics]: ...


def _wide(x: Tensor) -> Tensor:
    x = x.detach()
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _bounds(
    low: float | None, high: float | None, default_low: float, default_high: float
) -> tuple[float, float]:
    lo = default_low if low is None else float(low)
    hi = default_high if high is None else float(high)
    if not 0 <= lo <= hi:
        raise ValueError(f"off-policy correction needs 0 <= low <= high, got low={lo}, high={hi}")
    return lo, hi


def _log_w(old_logprobs: Tensor, rollout_logprobs: Tensor, action_mask: Tensor) -> tuple[Tensor, Tensor]:
    if not old_logprobs.shape == rollout_logprobs.shape == action_mask.shape:
        raise ValueError(
            f"off-policy correction: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)} and action_mask {tuple(action_mask.shape)} must all be [B, T]"
        )
    mask = action_mask.bool()
    diff = _wide(old_logprobs) - _wide(rollout_logprobs)
    rows = [] if diff.device.type != "cpu" else (diff.isnan() & mask).any(dim=1).nonzero().flatten().tolist()
    if rows:
        raise ValueError(
            f"off-policy correction: old_logprobs / rollout_logprobs are NaN on action tokens of rows "
            f"{rows[:10]}; check the rollout engine's log-probs"
        )
    log_w = torch.where(mask, diff, 0.0).clamp(-LOG_W_CLAMP, LOG_W_CLAMP)  # padding is never read
    return log_w, mask


def _metrics(weight: Tensor, keep: Tensor, log_w: Tensor, mask: Tensor) -> Metrics:
    m = mask.to(weight.dtype)
    n = m.sum().clamp(min=1)
    # KL(rollout || old) with a ~ rollout: k1 = log(rollout/old) = -log_w ; k3 = w - 1 - log w
    return {
        "is_weight_mean": (weight * m).sum() / n,
        "masked_frac": ((~keep) & mask).to(m.dtype).sum() / n,
        "kl_rollout_train": ((log_w.exp() - 1 - log_w) * m).sum() / n,
        "kl_rollout_train_k1": (-log_w * m).sum() / n,
    }


def no_correction(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """`none`: weight 1 on action tokens (0 off the mask), nothing masked, no metrics; low / high ignored."""
    if not old_logprobs.shape == rollout_logprobs.shape == action_mask.shape:
        raise ValueError(
            f"off-policy correction: old_logprobs {tuple(old_logprobs.shape)}, rollout_logprobs "
            f"{tuple(rollout_logprobs.shape)} and action_mask {tuple(action_mask.shape)} must all be [B, T]"
        )
    mask = action_mask.bool()
    return mask.to(_wide(old_logprobs).dtype), torch.ones_like(mask), {}


def tis(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """Truncated IS: weight clamp(w_t, low, high) (defaults low = 0, i.e. none, high = 2), nothing masked."""
    lo, hi = _bounds(low, high, 0.0, 2.0)
    log_w, mask = _log_w(old_logprobs, rollout_logprobs, action_mask)
    weight = log_w.exp().clamp(min=lo, max=hi) * mask
    keep = torch.ones_like(mask)
    return weight, keep, _metrics(weight, keep, log_w, mask)


def icepop(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """IcePop: weight w_t, tokens with w_t outside [low, high] masked (defaults 0.5, 5.0)."""
    lo, hi = _bounds(low, high, 0.5, 5.0)
    log_w, mask = _log_w(old_logprobs, rollout_logprobs, action_mask)
    w = log_w.exp()
    keep = (w >= lo) & (w <= hi)
    weight = w * (keep & mask)
    return weight, keep, _metrics(weight, keep, log_w, mask)


def seq_mask_tis(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    action_mask: Tensor,
    *,
    low: float | None = None,
    high: float | None = None,
) -> tuple[Tensor, Tensor, Metrics]:
    """Token TIS weight min(w_t, high); sequences whose geometric-mean weight exp(mean_t log w_t) (over its
    action tokens) is outside [low, high] are masked entirely (defaults 0.5, 2.0)."""
    lo, hi = _bounds(low, high, 0.5, 2.0)
    log_w, mask = _log_w(old_logprobs, rollout_logprobs, action_mask)
    n_tok = mask.sum(dim=1).clamp(min=1)
    seq_w = (log_w.sum(dim=1) / n_tok).exp()
    keep_seq = (seq_w >= lo) & (seq_w <= hi)
    keep = keep_seq[:, None].expand_as(mask).clone()
    weight = log_w.exp().clamp(max=hi) * (keep & mask)
    metrics = _metrics(weight, keep, log_w, mask)
    metrics["masked_seq_frac"] = (~keep_seq & mask.any(dim=1)).float().mean()
    return weight, keep, metrics


def logprob_mismatch(
    trainer_logprobs: Tensor, rollout_logprobs: Tensor, action_mask: Tensor
) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's recomputation of the same tokens (docs/rollout.md
    reports them per engine). Over the action tokens of [B, T] tensors:

    - `logprob_absdiff_mean` / `logprob_absdiff_p99`: mean and 99th percentile of |trainer - rollout| per token;
    - `logprob_absdiff_max`: the largest;
    - `seq_ratio_out_frac`: fraction of sequences (with at least one action token) whose importance ratio
      pi_trainer(y) / pi_rollout(y) = exp(sum_t (trainer_t - rollout_t)) lies outside [0.5, 2].

    Trainer = the policy before the update (pi_old), so in async mode the numbers include staleness."""
    if not trainer_logprobs.shape == rollout_logprobs.shape == action_mask.shape:
        raise ValueError(
            f"logprob_mismatch: shapes {tuple(trainer_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, "
            f"{tuple(action_mask.shape)} must all be [B, T]"
        )
    mask = action_mask.bool()
    diff = (trainer_logprobs.detach().double() - rollout_logprobs.detach().double()) * mask
    tokens = diff[mask].abs()
    if tokens.numel() == 0:
        return {}
    rows = mask.any(dim=1)
    log_ratio = diff.sum(dim=1)[rows]
    out = (log_ratio.abs() > math.log(2.0)).double().mean()
    return {
        "logprob_absdiff_mean": float(tokens.mean()),
        "logprob_absdiff_p99": float(torch.quantile(tokens, 0.99)),
        "logprob_absdiff_max": float(tokens.max()),
        "seq_ratio_out_frac": float(out),
    }
