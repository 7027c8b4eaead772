"""`gspo`: Group Sequence Policy Optimization (sequence-level ratio), in its token form (GSPO-token).

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071.

    s_i     = exp( clamp( (1/|y_i|) sum_t (log pi - log pi_old), -20, 20 ) )   geometric mean of token ratios
    s_i,t   = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]        value s_i, gradient s_i * grad log pi(y_i,t)
    loss_t  = -min(s_i,t A_t, clip(s_i,t, 1 - eps_low, 1 + eps_high) A_t)

|y_i| = action tokens of sequence i (the mean's denominator). A sequence whose mean log-ratio is clamped
gets no gradient (like a clamped token in `ppo`). With a sequence-level advantage (A_t = A_i) and the
`seq_mean_token_mean` aggregation this is exactly the GSPO objective (1/G) sum_i min(s_i A_i, clip(s_i) A_i).
Defaults eps_low = 3e-4, eps_high = 4e-4 (the paper's). `dual_clip` is not used.
"""

from __future__ import annotations

from torch import Tensor

from relayrl.algorithms.policy_losses.base import (
    LOG_RATIO_CLAMP,
    Metrics,
    PolicyLossInputs,
    check_eps,
    check_inputs,
    finish,
    masked,
)


def gspo(
    inputs: PolicyLossInputs,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    log_ratio_clamp: float = LOG_RATIO_CLAMP,
) -> tuple[Tensor, Metrics]:
    """GSPO-token loss. -> (loss [B, T], metrics; ratio metrics are of the sequence ratio s_i)."""
    check_inputs(inputs)
    lo = 3e-4 if eps_low is None else eps_low
    hi = 4e-4 if eps_high is None else eps_high
    check_eps(lo, hi)
    mask = inputs.action_mask
    logp = masked(inputs.logprobs, mask)
    n_tok = mask.bool().sum(dim=1).clamp(min=1)
    raw = (logp - masked(inputs.old_logprobs.detach(), mask)).detach().sum(dim=1) / n_tok
    seq_log_ratio = raw.clamp(-log_ratio_clamp, log_ratio_clamp)
    live = (raw.abs() <= log_ratio_clamp).to(logp.dtype)[:, None]  # clamped sequence: no gradient (as ppo)
    s = seq_log_ratio.exp()[:, None] * (live * (logp - logp.detach())).exp()
    adv = masked(inputs.advantages.detach(), mask)
    surr1 = s * adv
    surr2 = s.clamp(1 - lo, 1 + hi) * adv
    loss = -surr1.minimum(surr2)
    clipped = surr2 < surr1
    return finish(loss, inputs, seq_log_ratio[:, None].expand_as(logp), clipped)
