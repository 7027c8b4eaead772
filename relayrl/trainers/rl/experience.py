"""Controller-side pieces of an RL step that need no model: reward shaping, dynamic filtering, KL and
advantages, and the rollout metrics. Pure functions of trajectories / tensors plus explicit settings.

    rewards, m = shape_rewards(trajs, cfg, norm)          [B] float32 after clip / overlong / truncation / norm
    kept, m = filter_groups(trajs, n, filter_cfg)         whole groups with a learning signal (DAPO)
    adv, ret, kl, m = compute_advantages(...)             ADVANTAGES[cfg.algo.advantage] on the batch
    m = rollout_metrics(trajs)                            rollout/* scalars for the log
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from relayrl.agents.base import Trajectory
from relayrl.config.rl import FilterConfig, RLConfig


def shape_rewards(
    trajs: list[Trajectory], cfg: RLConfig, norm: object | None
) -> tuple[Tensor, dict[str, float]]:
    """Scalar rewards [B] after the shaping steps that are switched on (order: overlong penalty, truncation
    penalty, clipping, running normalisation)."""
    from relayrl.algorithms.shaping import clip_rewards, overlong_penalty, truncation_penalty

    r = cfg.reward
    rewards = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32)
    metrics: dict[str, float] = {}
    if r.overlong_buffer > 0:
        lengths = torch.tensor([t.response_len for t in trajs])
        pen, m = overlong_penalty(
            lengths,
            max_len=cfg.rollout.max_new_tokens,
            buffer_len=r.overlong_buffer,
            factor=r.overlong_penalty,
        )
        rewards, metrics = rewards + pen.float(), {**metrics, **m}
    if r.truncation_penalty:
        truncated = torch.tensor([t.truncated for t in trajs])
        rewards, m = truncation_penalty(rewards, truncated, penalty=r.truncation_penalty)
        metrics.update(m)
    if r.clip > 0:
        rewards, m = clip_rewards(rewards, low=-r.clip, high=r.clip)
        metrics.update(m)
    if norm is not None:
        rewards, m = norm(rewards)
        rewards = rewards.float()
        metrics.update(m)
    return rewards, {f"rollout/{k}": v for k, v in metrics.items()}


def filter_groups(
    trajs: list[Trajectory], group_size: int, cfg: FilterConfig
) -> tuple[list[Trajectory], dict[str, float]]:
    """Keep the groups (n contiguous trajectories of one prompt) whose scores vary and whose mean is in
    [min_mean, max_mean]; returns the kept trajectories (groups intact) and filter/* counts."""
    from relayrl.algorithms.filtering import dynamic_filter, group_rows

    if not trajs:
        return [], {"filter/groups_kept": 0.0, "filter/groups_dropped": 0.0}
    scores = torch.tensor([float(t.score if t.score is not None else t.reward) for t in trajs])
    kept, _, m = dynamic_filter(scores, group_size=group_size, mean_range=(cfg.min_mean, cfg.max_mean))
    rows = group_rows(kept, group_size).tolist()
    return [trajs[i] for i in rows], {f"filter/{k}": v for k, v in m.items()}


def complete_groups(trajs: list[Trajectory], group_size: int) -> list[Trajectory]:
    """Trajectories of prompts that still have all `group_size` samples (after the failure policy), grouped."""
    by_prompt: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_prompt[t.sample.index].append(t)
    return [t for g in by_prompt.values() if len(g) == group_size for t in g]


def compute_advantages(
    cfg: RLConfig,
    *,
    rewards: Tensor,
    action_mask: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    values: Tensor | None,
    kl_coef: float,
) -> tuple[Tensor, Tensor, Tensor | None, dict[str, float]]:
    """(advantages [B, T], returns [B, T], per-token KL [B, T] or None, metrics) for the batch.

    KL(pi_old || ref) is measured whenever a reference exists (metric rollout/kl); it enters the reward
    only with kl_mode=reward (R_t = -beta kl_t), the loss only with kl_mode=loss (in the policy worker)."""
    from relayrl.algorithms.advantages import ADVANTAGES, AdvantageInputs
    from relayrl.algorithms.kl import kl_estimate
    from relayrl.algorithms.registry import needs_groups

    a = cfg.algo
    kl, metrics = None, {}
    if ref_logprobs is not None:
        kl, m = kl_estimate(old_logprobs, ref_logprobs, action_mask, estimator=a.kl_estimator)
        metrics["rollout/kl"] = m["kl"]
    in_reward = a.kl_mode == "reward"
    group = cfg.rollout.n_samples if needs_groups(a.advantage) else 1
    inputs = AdvantageInputs(
        rewards=rewards,
        action_mask=action_mask,
        group_size=group,
        values=values,
        kl=kl if in_reward else None,
        kl_coef=kl_coef if in_reward else 0.0,
    )
    adv, ret, m = ADVANTAGES[a.advantage](inputs, gamma=a.gamma, lam=a.lam)
    metrics.update({f"adv/{k}": v for k, v in m.items()})
    return adv.float(), ret.float(), kl, metrics


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """rollout/* means over trajectories: reward, score, response length, truncation, turns, extra logs."""
    if not trajs:
        return {}
    n = len(trajs)
    rewards = [float(t.reward) for t in trajs if t.reward is not None]
    lengths = [t.response_len for t in trajs]
    out = {
        "rollout/reward_mean": sum(rewards) / max(1, len(rewards)),
        "rollout/reward_std": _std(rewards),
        "rollout/response_len": sum(lengths) / n,
        "rollout/response_len_max": float(max(lengths)),
        "rollout/truncated_frac": sum(t.truncated for t in trajs) / n,
        "rollout/turns": sum(t.num_turns for t in trajs) / n,
        "rollout/samples": float(n),
    }
    logs: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        for k, v in t.extra_logs.items():
            logs[k].append(v)
    out.update({f"rollout/{k}": sum(v) / len(v) for k, v in logs.items()})
    return out


def _std(x: list[float]) -> float:
    if len(x) < 2:
        return 0.0
    m = sum(x) / len(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))
