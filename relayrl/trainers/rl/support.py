"""Small helpers of the RL loop (relayrl/trainers/rl/loop.py): step timer, SIGINT / SIGTERM flag, failure counts,
and the builders of the checkpoint manager and reward normaliser."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.config.rl import RLConfig
from relayrl.training.signals import SignalFlag

__all__ = [
    "SignalFlag",
    "Timer",
    "add",
    "as_dict",
    "checkpoint_manager",
    "due",
    "failure_counts",
    "reward_norm",
]


class Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        return {f"timing/{k}": v for k, v in self.seconds.items()}


def add(total: dict[str, float], more: dict[str, float]) -> None:
    for k, v in more.items():
        total[k] = total.get(k, 0.0) + v


def failure_counts(trajs: list[Trajectory]) -> dict[str, float]:
    """rollout/failed(/<kind>) and rollout/dropped when the failure policy dropped everything."""
    out = {"rollout/failed": 0.0, "rollout/dropped": float(len(trajs))}
    for t in trajs:
        if t.failure_kind is not None:
            out["rollout/failed"] += 1
            key = f"rollout/failed/{t.failure_kind}"
            out[key] = out.get(key, 0.0) + 1
    return out


def due(every: int, step: int) -> bool:
    return every > 0 and step % every == 0


def reward_norm(cfg: RLConfig) -> Any:
    """reward.normalize: a reward model's own statistics (rm:PATH whose config.json has reward_mean /
    reward_std, written by `relayrl rm`), else running statistics."""
    if not cfg.reward.normalize:
        return None
    from relayrl.algorithms.shaping import FixedRewardNorm, RunningRewardNorm
    from relayrl.models.value_head import reward_stats

    source = cfg.reward.source
    stats = reward_stats(source[len("rm:") :]) if source.startswith("rm:") else None
    if stats is not None:
        print(
            f"relayrl rl: rewards normalised with the reward model's statistics (mean {stats[0]:.4f}, std {stats[1]:.4f})"
        )
        return FixedRewardNorm(*stats)
    return RunningRewardNorm()


def checkpoint_manager(cfg: RLConfig, run_dir: Path) -> Any:
    """The shared CheckpointManager builder (trainers/setup.py). RL workers always save HF folders through
    their `save_pretrained` shims, so `ckpt.save_hf_model` does not apply here."""
    from dataclasses import replace

    from relayrl.training.setup import build_checkpoint_manager

    return build_checkpoint_manager(replace(cfg.ckpt, save_hf_model=True), run_dir)


def as_dict(cfg: RLConfig) -> dict[str, Any]:
    from relayrl.config.base import to_dict

    return to_dict(cfg)
