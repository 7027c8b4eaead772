"""The advantage-estimator seam: `AdvantageInputs` in, `(advantages [B, T], returns [B, T], metrics)` out.

Data shapes (shared by every estimator):

- B = sequences in the batch. The n samples of one prompt are contiguous rows (rows g*n .. g*n+n-1 form
  group g) and the group size n is passed explicitly. Groups never straddle data-parallel ranks.
- T = token positions (usually the whole padded sequence or the response part; anything works as long as
  all [B, T] tensors line up).
- `action_mask` [B, T] bool/float: True where the policy generated the token. Multi-turn trajectories have
  several separate runs of action tokens (environment feedback masked out between them).

Action-token-only recursions. Returns and GAE are computed over the *action tokens only*: each row is
compacted (its action tokens, in order, moved to the front with a stable sort), the backward recursion runs
on the compacted row, and the results are scattered back. Masked positions (prompt, env feedback, padding)
get advantage 0 and return 0 and are skipped by the recursion, so "t+1" always means *the next action
token* and the scalar reward lands on the *last action token* of the row. Environment tokens between turns
are part of the transition; gamma is applied once per action token.

Per-token rewards (KL in the reward, when `kl` is given; dense rewards d, when `dense_rewards` is given):
    R_t = -kl_coef * kl_t + [t = last action token] * s + d_t
where s is the estimator's scalar (the raw reward r for `gae`/`reinforce`, a group-baselined score for the
group estimators) and d_t a dense per-token reward (a process reward model's step scores at the step-end
tokens), added as is (not baselined or whitened before the returns; the estimator's whitening, if any, acts on
the returns).

Numerics. Integer / float16 / bfloat16 rewards and values are computed in float32 (float64 stays float64;
the outputs have that dtype). Non-finite rewards, or non-finite `values` / `kl` on action tokens, raise a
ValueError naming the rows; whatever sits at masked positions (padding) is never read. A group whose
rewards are all equal (max == min) gets group scores of exactly 0 in every group estimator (`zero_equal_groups`),
and batch whitening of values that are all equal gives exactly 0. Batch means and standard deviations are
two-pass in float64 (`masked_mean_std`), exact at any common offset.

Registry: `relayrl.algorithms.advantages.ADVANTAGES[name](inputs, gamma=..., lam=..., eps=...)`; every
estimator accepts the same keyword arguments (each docstring says which ones it uses).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

Metrics = dict[str, float]


@dataclass(kw_only=True, slots=True)
class AdvantageInputs:
    """Everything an advantage estimator may read. Tensors are detached by the estimators."""

    rewards: Tensor
    """[B] float: scalar reward per sequence (after shaping)."""
    action_mask: Tensor
    """[B, T] bool or float: 1 where the token is a policy action (gets a loss), 0 otherwise."""
    group_size: int = 1
    """n: samples per prompt; rows g*n .. g*n+n-1 form one group. Group estimators need n >= 2."""
    values: Tensor | None = None
    """[B, T] float: critic values V(s_t) at action tokens (required by `gae`), else None."""
    kl: Tensor | None = None
    """[B, T] float: per-token KL estimate (policy vs reference) for KL-in-reward, else None."""
    kl_coef: float = 0.0
    """beta: weight of `kl` in the per-token reward R_t = -beta * kl_t + [last] * s + d_t."""
    dense_rewards: Tensor | None = None
    """[B, T] float: dense per-token rewards d_t added to R_t on action tokens (e.g. process-reward step
    scores at step ends), else None."""
    stats_reducer: Callable[[Tensor], Tensor] | None = None
    """For batch whitening across data-parallel ranks: a function that sums a small float64 tensor over
    ranks (e.g. `lambda t: (dist.all_reduce(t), t)[1]`); called twice per whitening (two-pass statistics).
    None: this batch is the whole batch."""


class AdvantageEstimator(Protocol):
    """`ADVANTAGES[name]`: inputs + common keyword scalars -> (advantages [B, T], returns [B, T], metrics)."""

    def __call__(
        self,
        inputs: AdvantageInputs,
        *,
        gamma: float = 1.0,
        lam: float = 0.95,
        eps: float = 1e-6,
        whiten: bool | None = None,
    ) -> tuple[Tensor, Tensor, Metrics]: ...


def check_inputs(inputs: AdvantageInputs, *, need_group: bool = False, need_values: bool = False) -> None:
    """Validate shapes; errors name the field and how to fix it."""
    r, m = inputs.rewards, inputs.action_mask
    if r.dim() != 1:
        raise ValueError(f"AdvantageInputs.rewards must be [B], got shape {tuple(r.shape)}")
    if m.dim() != 2 or m.shape[0] != r.shape[0]:
        raise ValueError(
            f"AdvantageInputs.action_mask must be [B, T] with B = len(rewards) = {r.shape[0]}, "
            f"got {tuple(m.shape)}"
        )
    for name in ("values", "kl", "dense_rewards"):
        x = getattr(inputs, name)
        if x is not None and x.shape != m.shape:
            raise ValueError(
                f"AdvantageInputs.{name} must match action_mask {tuple(m.shape)}, got {tuple(x.shape)}"
            )
    bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"AdvantageInputs.rewards has non-finite values at rows {bad[:10]}; fix the reward source"
        )
    for name in ("values", "kl", "dense_rewards"):
        x = getattr(inputs, name)
        if x is not None:
            rows = (~torch.isfinite(x.detach()) & m.bool()).any(dim=1).nonzero().flatten().tolist()
            if rows:
                raise ValueError(
                    f"AdvantageInputs.{name} has non-finite values on action tokens of rows {rows[:10]}; "
                    f"check the {_SOURCES[name]}"
                )
    if need_values and inputs.values is None:
        raise ValueError(
            "advantage estimator 'gae' needs AdvantageInputs.values (a critic); use a critic-free one"
        )
    if need_group:
        n = inputs.group_size
        if n < 2:
            raise ValueError(
                f"group advantage estimators need group_size >= 2 samples per prompt, got {n}; "
                "set n_samples_per_prompt >= 2 or use 'reinforce' / 'gae'"
            )
        if r.shape[0] % n:
            raise ValueError(f"batch of {r.shape[0]} rewards is not a whole number of groups of size {n}")


_SOURCES = {"values": "critic", "kl": "policy / reference log-probs", "dense_rewards": "dense reward source"}


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64; every other dtype (int, bool, float16, bfloat16, float32) -> float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def float_rewards(inputs: AdvantageInputs) -> Tensor:
    """Detached rewards [B] in their compute dtype (see `compute_dtype`)."""
    return inputs.rewards.detach().to(compute_dtype(inputs.rewards))


def group_view(rewards: Tensor, group_size: int) -> Tensor:
    """[B] -> [B / n, n] (rows of a group are contiguous)."""
    return rewards.reshape(-1, group_size)


def _compact_order(mask: Tensor) -> Tensor:
    """[B, T] long permutation that moves each row's action tokens (in order) to the front."""
    return torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices


def masked_backward_scan(x: Tensor, mask: Tensor, decay: float) -> Tensor:
    """y_t = x_t + decay * y_{next action token after t}, over action tokens only; 0 at masked positions.

    Vectorised over rows; a Python loop over the (compacted) time axis.
    """
    mask = mask.bool()
    order = _compact_order(mask)
    xc = torch.where(mask, x, 0).gather(1, order)
    mc = mask.gather(1, order).to(x.dtype)
    yc = torch.zeros_like(xc)
    nxt = torch.zeros_like(xc[:, 0])
    n_act = int(mask.sum(dim=1).max()) if mask.numel() else 0  # compacted rows: nothing after this
    for t in range(n_act - 1, -1, -1):
        nxt = (xc[:, t] + decay * nxt) * mc[:, t]
        yc[:, t] = nxt
    return torch.zeros_like(x).scatter(1, order, yc)


def last_action_index(mask: Tensor) -> Tensor:
    """[B] index of the last action token of each row (0 for rows without one)."""
    t = torch.arange(mask.shape[1], device=mask.device)
    return (mask.bool() * (t + 1)).amax(dim=1).clamp(min=1) - 1


def token_rewards(
    scores: Tensor, mask: Tensor, kl: Tensor | None, kl_coef: float, dense: Tensor | None = None
) -> Tensor:
    """R_t = -kl_coef * kl_t + [t = last action token] * score + dense_t, zero off the action mask. [B, T]."""
    mask = mask.bool()
    dtype = compute_dtype(scores)
    r = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    if kl is not None and kl_coef != 0.0:
        r = torch.where(mask, -kl_coef * kl.detach().to(dtype), 0.0)  # padding KL is never read
    has_action = mask.any(dim=1)
    r = r.scatter_add(1, last_action_index(mask)[:, None], (scores.to(dtype) * has_action)[:, None])
    if dense is not None:
        r = r + torch.where(mask, dense.detach().to(dtype), 0.0)
    return r * mask


def discounted_returns(scores: Tensor, inputs: AdvantageInputs, gamma: float) -> Tensor:
    """G_t = sum_{k >= t, k action} gamma^{#action tokens between} R_k over action tokens. [B, T]."""
    r = token_rewards(scores.detach(), inputs.action_mask, inputs.kl, inputs.kl_coef, inputs.dense_rewards)
    return masked_backward_scan(r, inputs.action_mask, gamma)


def masked_moments(x: Tensor, mask: Tensor, *, center: float = 0.0) -> Tensor:
    """float64 [3] = (sum (x - c), sum (x - c)^2, count) over mask, c = `center`: all-reduce it (sum) for global
    statistics. Two passes (`masked_mean_std`): center 0 for the mean, then center = that mean for the
    variance, so a large common offset (rewards near 1e6) costs no precision."""
    m = mask.bool()
    xd = torch.where(m, x.detach().to(torch.float64) - center, 0.0)
    return torch.stack([xd.sum(), (xd * xd).sum(), m.sum().to(torch.float64)])


def moments_to_mean_std(moments: Tensor, *, center: float = 0.0) -> tuple[float, float]:
    """(mean, unbiased std) from summed `masked_moments` taken around `center`: with d = x - c,
    mean = c + sum d / N and var = (sum d^2 - (sum d)^2 / N) / (N - 1), N = the action-token count (all ranks
    after the all-reduce); (0, 0) for N = 0, std 0 for N = 1. Exact up to rounding when c is (close to) the
    mean: take the moments twice, as `masked_mean_std` does (a one-pass c = 0 loses ~ offset^2 / var digits)."""
    s, s2, n = (float(v) for v in moments)
    if n < 1:
        return 0.0, 0.0
    var = max(s2 - s * s / n, 0.0) / max(n - 1.0, 1.0)
    return center + s / n, var**0.5


def masked_mean_std(
    x: Tensor, mask: Tensor, reducer: Callable[[Tensor], Tensor] | None = None
) -> tuple[float, float]:
    """Two-pass (mean, unbiased std) of x over mask; `reducer` sums the moments over ranks (called twice, in
    the same order on every rank)."""
    reduce = reducer if reducer is not None else (lambda t: t)
    mean, _ = moments_to_mean_std(reduce(masked_moments(x, mask)))
    return moments_to_mean_std(reduce(masked_moments(x, mask, center=mean)), center=mean)


def whiten(x: Tensor, mask: Tensor, *, mean: float, std: float, eps: float = 1e-6) -> tuple[Tensor, Metrics]:
    """(x - mean) / (std + eps) on action tokens, 0 elsewhere, with the statistics passed in explicitly; all 0
    when std is 0 (every value equal: no rounding residual of x - mean is blown up by 1 / eps).

    Use `masked_mean_std` (with a reducer for global, all-ranks statistics) to get them.
    """
    if std == 0.0:
        return torch.zeros_like(x), {"whiten_mean": mean, "whiten_std": std}
    out = torch.where(mask.bool(), (x - mean) / (std + eps), 0.0)
    return out, {"whiten_mean": mean, "whiten_std": std}


def batch_whiten(x: Tensor, inputs: AdvantageInputs, eps: float) -> tuple[Tensor, Metrics]:
    """Whiten over all action tokens of the batch (of all ranks when `inputs.stats_reducer` is set)."""
    mean, std = masked_mean_std(x, inputs.action_mask, inputs.stats_reducer)
    return whiten(x, inputs.action_mask, mean=mean, std=std, eps=eps)


def summarize(adv: Tensor, ret: Tensor, inputs: AdvantageInputs) -> Metrics:
    """Common metrics: reward mean/std over rows; advantage mean/std (population) and return mean over the
    action tokens of this batch (denominator: its action-token count, at least 1)."""
    m = inputs.action_mask.to(adv.dtype)
    n = m.sum().clamp(min=1)
    a_mean = (adv * m).sum() / n
    return {
        "reward_mean": float(inputs.rewards.float().mean()),
        "reward_std": float(inputs.rewards.float().std()) if inputs.rewards.numel() > 1 else 0.0,
        "advantage_mean": float(a_mean),
        "advantage_std": float((((adv - a_mean) * m) ** 2).sum().div(n).sqrt()),
        "return_mean": float((ret * m).sum() / n),
    }


def next_action_values(values: Tensor, mask: Tensor) -> Tensor:
    """[B, T]: at each action token, V at the *next action token* of the row (0 after the last one)."""
    mask = mask.bool()
    order = _compact_order(mask)
    vc = torch.where(mask, values, 0).gather(1, order)
    mc = mask.gather(1, order).to(values.dtype)
    nxt = torch.zeros_like(vc)
    nxt[:, :-1] = vc[:, 1:] * mc[:, 1:]
    return torch.zeros_like(values).scatter(1, order, nxt) * mask


def scores_to_advantages(
    scores: Tensor, inputs: AdvantageInputs, *, gamma: float, eps: float, whiten: bool
) -> tuple[Tensor, Tensor, Metrics]:
    """Shared tail of the critic-free estimators: per-token rewards -> returns G -> A = G (optionally
    whitened over all action tokens of the batch). Returns (advantages, returns, metrics)."""
    returns = discounted_returns(scores, inputs, gamma)
    adv, metrics = returns, {}
    if whiten:
        adv, metrics = batch_whiten(returns, inputs, eps)
    return adv, returns, {**summarize(adv, returns, inputs), **metrics}


def equal_groups(groups: Tensor) -> Tensor:
    """[G, 1] bool: the groups whose rewards are all equal (max == min). They carry no group-relative signal;
    the group estimators set their scores to exactly 0 (in float32, r - mean(r) leaves a rounding residual
    that a std of 0 would turn into a large advantage)."""
    return groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)


def zero_equal_groups(scores: Tensor, groups: Tensor) -> Tensor:
    """[G, n] scores with the rows of `equal_groups(groups)` set to exactly 0, flattened to [B]."""
    return torch.where(equal_groups(groups), 0.0, scores).reshape(-1)


def group_stats_metrics(groups: Tensor) -> Metrics:
    """Fraction of groups whose rewards are all equal (they carry no group-relative signal)."""
    same = equal_groups(groups).float().mean()
    return {"zero_std_group_frac": float(same)}
