"""Controller-side pieces of an RL step over trajectories: the run's config and trajectories in, the pure
tensor functions of relayrl.algorithms.experience / filtering called with explicit settings.

    rewards, m = trajectory_rewards(trajs, cfg, norm)     [B] float32 after clip / overlong / truncation / norm
    kept, m = filter_groups(trajs, n, filter_cfg)         whole groups with a learning signal (DAPO)
    kept = complete_groups(trajs, n)                      prompts that still have all n samples
    adv, ret, kl, m = step_advantages(cfg, ...)           ADVANTAGES[cfg.algo.advantage] on the batch
    m = rollout_metrics(trajs)                            rollout/* scalars for the log
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from torch import Tensor

from relayrl.agents.base import Trajectory
from relayrl.algorithms.distill import reverse_kl_rewards
from relayrl.algorithms.experience import RewardNorm, compute_advantages, shape_rewards
from relayrl.algorithms.filtering import dynamic_filter, group_rows
from relayrl.config.rl import FilterConfig, ResolvedRL, RLConfig
from relayrl.workers.base import SequenceBatch


def _reward(t: Trajectory) -> float:
    """`t.reward` as a float: every trajectory that reaches shaping or filtering has been scored."""
    assert t.reward is not None, f"the trajectory of prompt {t.sample.index} was not scored"
    return float(t.reward)


def trajectory_rewards(
    trajs: list[Trajectory], cfg: RLConfig, norm: RewardNorm | None
) -> tuple[Tensor, dict[str, float]]:
    """The trajectories' scalar rewards [B] after the shaping of `cfg.reward` (relayrl.algorithms.experience
    .shape_rewards: overlong penalty, truncation penalty, clipping, running normalisation)."""
    r = cfg.reward
    return shape_rewards(
        torch.tensor([_reward(t) for t in trajs], dtype=torch.float32),
        torch.tensor([t.response_len for t in trajs]),
        torch.tensor([t.truncated for t in trajs]),
        max_new_tokens=cfg.rollout.max_new_tokens,
        overlong_buffer=r.overlong_buffer,
        overlong_penalty=r.overlong_penalty,
        truncation_penalty=r.truncation_penalty,
        clip=r.clip,
        norm=norm,
    )


def dense_rewards(trajs: list[Trajectory], width: int) -> Tensor | None:
    """[B, width] float32 per-token rewards of the trajectories (right-padded like relayrl.workers.base
    .collate: column t is token t), or None when no trajectory has any (`Trajectory.dense_rewards`)."""
    if not any(t.dense_rewards for t in trajs):
        return None
    out = torch.zeros((len(trajs), width), dtype=torch.float32)
    for i, t in enumerate(trajs):
        if t.dense_rewards:
            if len(t.dense_rewards) != len(t.token_ids):
                raise ValueError(
                    f"trajectory of sample {t.sample.index}: dense_rewards has {len(t.dense_rewards)} entries "
                    f"for {len(t.token_ids)} tokens; the reward source must give one per token"
                )
            out[i, : len(t.dense_rewards)] = torch.tensor(t.dense_rewards, dtype=torch.float32)
    return out


def step_dense_rewards(
    trajs: list[Trajectory],
    cfg: RLConfig,
    width: int,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor | None,
    action_mask: Tensor,
) -> tuple[Tensor | None, dict[str, float]]:
    """The step's dense rewards [B, width] (or None): the trajectories' own (`dense_rewards`, e.g. a process
    reward model's) plus, with a teacher, the reverse-KL reward of on-policy distillation
    (relayrl.algorithms.distill, coefficient distill.coef); metrics distill/reverse_kl."""
    dense = dense_rewards(trajs, width)
    if teacher_logprobs is None:
        return dense, {}
    kd, m = reverse_kl_rewards(student_logprobs, teacher_logprobs, action_mask, coef=cfg.distill.coef)
    return (kd if dense is None else dense + kd), {f"distill/{k}": v for k, v in m.items()}


def distill_and_dense(
    trajs: list[Trajectory],
    cfg: RLConfig,
    batch: SequenceBatch,
    rewards: Tensor,
    student_logprobs: Tensor,
    teacher_logprobs: Tensor | None,
) -> tuple[Tensor, Tensor | None, dict[str, float]]:
    """(outcome rewards, dense rewards or None, metrics) of a step: `step_dense_rewards`, and with a teacher
    and distill.outcome false (pure distillation) the outcome rewards zeroed (the reverse KL is the reward)."""
    width = batch.input_ids.shape[1]
    dense, m = step_dense_rewards(trajs, cfg, width, student_logprobs, teacher_logprobs, batch.action_mask)
    if teacher_logprobs is not None and not cfg.distill.outcome:
        rewards = torch.zeros_like(rewards)
    return rewards, dense, m


def filter_groups(
    trajs: list[Trajectory], group_size: int, cfg: FilterConfig
) -> tuple[list[Trajectory], dict[str, float]]:
    """Keep the groups (n contiguous trajectories of one prompt) whose scores vary and whose mean is in
    [min_mean, max_mean]; returns the kept trajectories (groups intact) and filter/* counts."""
    if not trajs:
        return [], {"filter/groups_kept": 0.0, "filter/groups_dropped": 0.0}
    scores = torch.tensor([float(t.score) if t.score is not None else _reward(t) for t in trajs])
    kept, _, m = dynamic_filter(scores, group_size=group_size, mean_range=(cfg.min_mean, cfg.max_mean))
    rows = group_rows(kept, group_size).tolist()
    return [trajs[i] for i in rows], {f"filter/{k}": v for k, v in m.items()}


def complete_groups(trajs: list[Trajectory], group_size: int) -> list[Trajectory]:
    """Trajectories of prompts that still have all `group_size` samples (after the failure policy), grouped."""
    by_prompt: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_prompt[t.sample.index].append(t)
    return [t for g in by_prompt.values() if len(g) == group_size for t in g]


def step_advantages(
    cfg: ResolvedRL,
    *,
    rewards: Tensor,
    action_mask: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    values: Tensor | None,
    kl_coef: float,
    dense: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, dict[str, float]]:
    """(advantages [B, T], returns [B, T], per-token KL [B, T] or None, metrics) of the step's batch under the
    run's (resolved) `algo` and `rollout.n_samples`: relayrl.algorithms.experience.compute_advantages."""
    a = cfg.algo
    return compute_advantages(
        rewards,
        action_mask,
        old_logprobs,
        ref_logprobs,
        values,
        advantage=a.advantage,
        gamma=a.gamma,
        lam=a.lam,
        kl_mode=a.kl_mode,
        kl_estimator=a.kl_estimator,
        n_samples=cfg.rollout.n_samples,
        kl_coef=kl_coef,
        dense_rewards=dense,
    )


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """rollout/* means over trajectories: reward, score, response length, truncation, turns, extra logs."""
    if not trajs:
        return {}
    n = len(trajs)
    rewards = [float(r) for t in trajs if (r := t.reward) is not None]
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
