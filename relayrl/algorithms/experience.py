"""Rewards -> advantages for one RL step: pure functions of tensors and explicit scalars (no config, no model).

    rewards, m = shape_rewards(rewards [B], lengths [B], truncated [B], *, max_new_tokens, overlong_buffer,
                               overlong_penalty, truncation_penalty, clip, norm)
        [B] float32 after the shaping steps that are switched on, in this order: DAPO overlong penalty,
        truncation penalty, clipping to [-clip, clip], normalisation (`norm`, e.g. RunningRewardNorm)
    adv, ret, kl, m = compute_advantages(rewards [B], action_mask [B, T], old_logprobs [B, T],
                                         ref_logprobs [B, T] | None, values [B, T] | None, *, advantage,
                                         gamma, lam, kl_mode, kl_estimator, n_samples, kl_coef,
                                         dense_rewards [B, T] | None)
        ADVANTAGES[advantage] on the batch: advantages [B, T] and returns [B, T] (float32), the per-token
        KL(pi_old || ref) [B, T] when a reference exists (else None)

B sequences with the n samples of a prompt contiguous, T token positions. Metric keys come back prefixed
(rollout/*, adv/*) as the RL log writes them. The caller (relayrl.trainers.rl.experience) turns trajectories
and the run's config into these arguments.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from relayrl.algorithms import shaping
from relayrl.algorithms.advantages import AdvantageInputs
from relayrl.algorithms.kl import kl_estimate
from relayrl.algorithms.registry import ADVANTAGES, needs_groups

Metrics = dict[str, float]


class RewardNorm(Protocol):
    """A reward normaliser (relayrl.algorithms.shaping.RunningRewardNorm / FixedRewardNorm)."""

    def __call__(self, rewards: Tensor) -> tuple[Tensor, Metrics]: ...


def shape_rewards(
    rewards: Tensor,
    lengths: Tensor,
    truncated: Tensor,
    *,
    max_new_tokens: int,
    overlong_buffer: int = 0,
    overlong_penalty: float = 1.0,
    truncation_penalty: float = 0.0,
    clip: float = 0.0,
    norm: RewardNorm | None = None,
) -> tuple[Tensor, Metrics]:
    """Scalar rewards [B] float32 after the shaping steps that are on: the overlong penalty when
    `overlong_buffer` > 0 (linear over the last `overlong_buffer` tokens before `max_new_tokens`, at most
    `overlong_penalty`), minus `truncation_penalty` for `truncated` [B] bool responses when it is
    not 0, clipping to [-clip, clip] when `clip` > 0, then `norm`. `lengths` [B]: response lengths in tokens.
    Metrics: rollout/<shaping metric>."""
    metrics: Metrics = {}
    if overlong_buffer > 0:
        pen, m = shaping.overlong_penalty(
            lengths, max_len=max_new_tokens, buffer_len=overlong_buffer, factor=overlong_penalty
        )
        rewards, metrics = rewards + pen.float(), {**metrics, **m}
    if truncation_penalty:
        rewards, m = shaping.truncation_penalty(rewards, truncated, penalty=truncation_penalty)
        metrics.update(m)
    if clip > 0:
        rewards, m = shaping.clip_rewards(rewards, low=-clip, high=clip)
        metrics.update(m)
    if norm is not None:
        rewards, m = norm(rewards)
        rewards = rewards.float()
        metrics.update(m)
    return rewards, {f"rollout/{k}": v for k, v in metrics.items()}


def compute_advantages(
    rewards: Tensor,
    action_mask: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    values: Tensor | None,
    *,
    advantage: str,
    gamma: float,
    lam: float,
    kl_mode: str,
    kl_estimator: str,
    n_samples: int,
    kl_coef: float,
    dense_rewards: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Metrics]:
    """(advantages [B, T], returns [B, T], per-token KL [B, T] or None, metrics) of estimator `advantage`.

    KL(pi_old || ref) with `kl_estimator` is measured whenever `ref_logprobs` is given (metric rollout/kl); it
    enters the reward only with kl_mode "reward" (R_t = -kl_coef kl_t), the loss only with kl_mode "loss" (in
    the policy objective, not here). Group estimators compare the `n_samples` contiguous samples of a prompt;
    the others see groups of 1. `dense_rewards` [B, T] (or None): per-token rewards added to R_t (a process
    reward model's step scores). Metrics: rollout/kl, adv/*."""
    kl, metrics = None, {}
    if ref_logprobs is not None:
        kl, m = kl_estimate(old_logprobs, ref_logprobs, action_mask, estimator=kl_estimator)
        metrics["rollout/kl"] = float(m["kl"])
    in_reward = kl_mode == "reward"
    inputs = AdvantageInputs(
        rewards=rewards,
        action_mask=action_mask,
        group_size=n_samples if needs_groups(advantage) else 1,
        values=values,
        kl=kl if in_reward else None,
        kl_coef=kl_coef if in_reward else 0.0,
        dense_rewards=dense_rewards,
    )
    adv, ret, m = ADVANTAGES[advantage](inputs, gamma=gamma, lam=lam)
    metrics.update({f"adv/{k}": v for k, v in m.items()})
    return adv.float(), ret.float(), kl, metrics
