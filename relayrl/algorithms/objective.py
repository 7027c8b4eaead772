"""The RL objectives as pure modules: per-token inputs of one micro-batch -> (loss_sum, count, metrics).

    objective = PolicyObjective(policy_loss="ppo", aggregation="token_mean", ...)   built ONCE from the
                                                                                  resolved algorithm config
    out = objective(PolicyTerms(logprobs=..., old_logprobs=..., ...), kl_coef=0.0) -> ObjectiveOutput
    out = ValueObjective(clip_eps=0.2)(ValueTerms(values=..., old_values=..., returns=..., action_mask=...))

`ObjectiveOutput(loss_sum, count, metrics, metric_counts)` is the training core's loss contract
(relayrl.training.step): the step divides the summed gradients by the global (all micro-batches, all ranks)
total of `count`, so the update is independent of the micro-batching. Which count depends on the
aggregation (`AGGREGATIONS[name]` returns the pair): action tokens (token_mean) or sequences with at least
one action token (seq_mean_token_mean, seq_mean_token_sum_norm).

The policy objective composes the tested functions of this package, in this order:

    is_weight, keep = OFF_POLICY[off_policy](old, rollout, mask, low, high)     (none: weight 1, keep all)
    l_t = POLICY_LOSSES[policy_loss](logprobs, old, advantages, mask & keep, is_weight)
        + kl_coef * KL_t(logprobs, ref)              when the KL is a loss term (kl_loss)
        - entropy_coef * H_t                         when entropy_coef != 0 (entropy_bonus)
    loss_sum, count = AGGREGATIONS[aggregation](l, mask, norm_const)

On-policy shortcut: `old_logprobs=None` means the update is exactly on-policy (one epoch, one mini-batch,
no off-policy correction), so pi_old = pi_theta and the detached current log-probs stand in for it: the
ratio is 1 by construction (PPO's gradient at ratio 1) and no separate old-log-prob forward is needed.

Metrics are sums with their own denominators (`metric_counts`): token metrics over the micro-batch's action
tokens: clip_frac, ratio_mean, approx_kl, entropy, kl_loss, logprob_diff (|trainer - engine log-prob|, the
rollout/trainer mismatch) and the off-policy metrics; `policy_loss` over `count`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from relayrl.algorithms.entropy import entropy_bonus
from relayrl.algorithms.kl import kl_loss
from relayrl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInputs
from relayrl.algorithms.registry import AGGREGATIONS, OFF_POLICY
from relayrl.algorithms.value import value_loss

SUMMABLE_POLICY_METRICS = ("clip_frac", "ratio_mean", "approx_kl")
"""Policy-loss metrics that are means over action tokens (so token-weighted sums add up across micro-batches);
ratio_min / ratio_max are not."""


@dataclass(kw_only=True, slots=True)
class PolicyTerms:
    """Per-token tensors of one micro-batch, each [B, T] and aligned with the tokens (relayrl.workers.base)."""

    logprobs: Tensor
    """float32, requires grad: log pi_theta(x_t | x_<t) under the sampling temperature."""
    action_mask: Tensor
    """bool: tokens the policy generated."""
    advantages: Tensor
    """float32: A_t (0 off the mask)."""
    rollout_logprobs: Tensor
    """float32: the engine's log-probs of the sampled tokens."""
    old_logprobs: Tensor | None = None
    """float32: log pi_old; None = exactly on-policy (the detached `logprobs` are used)."""
    entropy: Tensor | None = None
    """float32: entropy of the next-token distribution at each token's position (metric / bonus)."""
    ref_logprobs: Tensor | None = None
    """float32: reference log-probs (KL as a loss term)."""


@dataclass(kw_only=True, slots=True)
class ObjectiveOutput:
    """One micro-batch's share of an optimizer step's loss (the training core's loss contract)."""

    loss_sum: Tensor
    """0-dim, differentiable: the micro-batch's sum of per-unit losses."""
    count: Tensor
    """0-dim float: units in the micro-batch (action tokens or sequences, per the aggregation)."""
    metrics: dict[str, Tensor | float] = field(default_factory=dict)
    """Sums; divide by the step total of `metric_counts[name]` (default `count`)."""
    metric_counts: dict[str, Tensor | float] = field(default_factory=dict)
    """Denominator shares of the metrics that are not over `count`."""


@dataclass(kw_only=True, frozen=True, slots=True)
class PolicyObjective:
    """The policy objective of an RL algorithm (see module doc); fields are registry names and scalars."""

    policy_loss: str = "ppo"
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip: float | None = None
    aggregation: str = "token_mean"
    norm_const: float | None = None
    """Dr. GRPO's constant normaliser (seq_mean_token_sum_norm): the generation length budget."""
    kl_loss_estimator: str | None = None
    """KL estimator of a KL loss term (k1 / k2 / k3); None = the KL is not in the loss."""
    entropy_coef: float = 0.0
    off_policy: str = "none"
    off_policy_low: float | None = None
    off_policy_high: float | None = None

    def __post_init__(self) -> None:
        for name, registry in (
            ("policy_loss", POLICY_LOSSES),
            ("aggregation", AGGREGATIONS),
            ("off_policy", OFF_POLICY),
        ):
            if getattr(self, name) not in registry:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {', '.join(registry)}")

    def __call__(self, t: PolicyTerms, *, kl_coef: float = 0.0) -> ObjectiveOutput:
        mask = t.action_mask.bool()
        old = t.logprobs.detach() if t.old_logprobs is None else t.old_logprobs
        is_weight, keep, off_metrics = OFF_POLICY[self.off_policy](
            old, t.rollout_logprobs, mask, low=self.off_policy_low, high=self.off_policy_high
        )
        inputs = PolicyLossInputs(
            logprobs=t.logprobs,
            old_logprobs=old,
            advantages=t.advantages,
            action_mask=mask & keep,
            is_weight=is_weight if self.off_policy != "none" else None,
        )
        per_token, loss_metrics = POLICY_LOSSES[self.policy_loss](
            inputs, eps_low=self.eps_low, eps_high=self.eps_high, dual_clip=self.dual_clip
        )
        metrics: dict[str, Tensor | float] = {}
        if self.kl_loss_estimator is not None and t.ref_logprobs is not None:
            kl_tok, kl_m = kl_loss(
                t.logprobs, t.ref_logprobs, mask, coef=kl_coef, estimator=self.kl_loss_estimator
            )
            per_token = per_token + kl_tok
            metrics["kl_loss"] = kl_m["kl"]
        if t.entropy is not None:
            bonus, ent_m = entropy_bonus(t.entropy, mask, coef=self.entropy_coef)
            if self.entropy_coef:
                per_token = per_token + bonus
            metrics["entropy"] = ent_m["entropy"]
        loss_sum, count, _ = AGGREGATIONS[self.aggregation](per_token, mask, norm_const=self.norm_const)
        tokens = mask.sum().float()
        with torch.no_grad():
            diff = torch.where(mask, (t.logprobs.detach() - t.rollout_logprobs).abs(), 0.0).sum()
        metrics.update({k: loss_metrics[k] for k in SUMMABLE_POLICY_METRICS if k in loss_metrics})
        metrics.update(off_metrics)
        sums: dict[str, Tensor | float] = {k: v * tokens for k, v in metrics.items()}
        sums["logprob_diff"] = diff
        sums["policy_loss"] = loss_sum.detach()
        counts: dict[str, Tensor | float] = {k: tokens for k in sums if k != "policy_loss"}
        return ObjectiveOutput(loss_sum=loss_sum, count=count, metrics=sums, metric_counts=counts)


@dataclass(kw_only=True, slots=True)
class ValueTerms:
    """Per-token critic tensors of one micro-batch, each [B, T]."""

    values: Tensor
    """float32, requires grad: V(x_<t) of the current critic."""
    old_values: Tensor
    """float32: the values at experience time (clipping centre)."""
    returns: Tensor
    """float32: value targets."""
    action_mask: Tensor
    """bool: tokens with a value target."""


@dataclass(kw_only=True, frozen=True, slots=True)
class ValueObjective:
    """Clipped value loss (relayrl.algorithms.value), token-mean over the optimizer step."""

    clip_eps: float | None = 0.2

    def __call__(self, t: ValueTerms) -> ObjectiveOutput:
        mask = t.action_mask.bool()
        per_token, m = value_loss(t.values, t.old_values, t.returns, mask, clip_eps=self.clip_eps)
        loss_sum, count, _ = AGGREGATIONS["token_mean"](per_token, mask)
        sums: dict[str, Tensor | float] = {k: v * count for k, v in m.items()}
        return ObjectiveOutput(loss_sum=loss_sum, count=count, metrics=sums)
