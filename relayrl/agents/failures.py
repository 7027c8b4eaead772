"""Failure handling for user code (agent steps, reward functions, remote reward models).

A failing sample is never given a silent zero reward. Whoever runs user code calls `mark_failed(traj, kind,
message)`: the trajectory becomes `TrajectoryStatus.FAILED` with `error` / `failure_kind` set, the first
failure of each (source, kind) is logged with context (sample index, datasource, prompt head), and every
failure is counted. The RL loop then applies one stated policy to the batch:

    kept, metrics = apply_failure_policy(trajs, "drop_group")

Policies (`FailurePolicy`):
    drop_group   (default) drop every trajectory of a prompt (same `sample.index`) that has a failure, so
                 group baselines (GRPO, RLOO) never mix failed and healthy samples.
    drop_sample  drop only the failed trajectories.
    zero_reward  keep failed trajectories with reward = score = 0.0 (explicit opt-in; still counted, status
                 stays FAILED so they are visible).
    raise        raise `RolloutFailure` naming the first failure.

Whatever the policy, a batch in which every trajectory failed raises `RolloutFailure` (except zero_reward):
training on nothing would hide a broken reward function or server.

Metrics (counts over the batch): rollout/failed, rollout/failed_frac, rollout/failed/<kind>, rollout/dropped.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from relayrl.agents.base import Trajectory, TrajectoryStatus

logger = logging.getLogger("relayrl.agents")


class FailurePolicy(StrEnum):
    """What the RL loop does with FAILED trajectories (see module doc)."""

    DROP_GROUP = "drop_group"
    DROP_SAMPLE = "drop_sample"
    ZERO_REWARD = "zero_reward"
    RAISE = "raise"


class RolloutFailure(RuntimeError):
    """Raised by `apply_failure_policy` under policy "raise", or when every trajectory of a batch failed."""


class FailureLog:
    """Counts failures by kind and logs the first one of each (source, kind) with its context."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def record(self, traj: Trajectory, source: str, kind: str, message: str) -> None:
        with self._lock:
            self.counts[kind] += 1
            first = (source, kind) not in self._logged
            self._logged.add((source, kind))
        if first:
            logger.error(
                "%s failed (%s) on sample %d [%s] prompt %r: %s "
                "(logged once per kind; later ones are counted in rollout/failed/%s)",
                source,
                kind,
                traj.sample.index,
                traj.sample.datasource,
                traj.sample.prompt[:80],
                message,
                kind,
            )

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self._logged.clear()


FAILURES = FailureLog()
"""Process-wide failure log used when a component is not given its own."""


def mark_failed(
    traj: Trajectory, kind: str, message: str, *, source: str = "agent", log: FailureLog | None = None
) -> None:
    """Mark `traj` FAILED with `kind` ("exception", "nan", "wrong_length", "timeout", ...), log once, count."""
    traj.status = TrajectoryStatus.FAILED
    traj.failure_kind = kind
    traj.error = f"{source}: {kind}: {message}"
    traj.reward = None
    traj.score = None
    (log or FAILURES).record(traj, source, kind, message)


def check_scalar(value: Any, what: str) -> float:
    """`value` as a finite float; ValueError("nan"/"wrong_length"...). The rule: a reward is a NUMBER (int,
    float, a numpy scalar, a 1-element tensor); strings (numeric or not) and booleans are refused as
    bad_output, so "0.5" and "yes" fail alike instead of one passing by accident."""
    if isinstance(value, str | bytes | bool):
        shown = repr(value)[:40]
        raise ScalarError(
            "bad_output", f"{what} is a {type(value).__name__} ({shown}), expected a number (int or float)"
        )
    if hasattr(value, "numel"):  # torch tensor
        if value.numel() != 1:
            raise ScalarError("wrong_length", f"{what} has {value.numel()} elements, expected 1")
        value = value.item()
    if not isinstance(value, int | float):
        try:
            value = float(value)  # numpy scalars
        except (TypeError, ValueError):
            raise ScalarError("bad_output", f"{what} is {type(value).__name__}, expected a number") from None
    value = float(value)
    if not math.isfinite(value):
        raise ScalarError("nan", f"{what} is {value}")
    return value


class ScalarError(ValueError):
    """A reward / score that is not one finite number; `kind` is the failure kind."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def apply_failure_policy(
    trajs: Sequence[Trajectory], policy: FailurePolicy | str = FailurePolicy.DROP_GROUP
) -> tuple[list[Trajectory], dict[str, float]]:
    """Apply `policy` to a batch; returns (kept trajectories in input order, metrics). See module doc."""
    try:
        policy = FailurePolicy(policy)
    except ValueError:
        choices = ", ".join(p.value for p in FailurePolicy)
        raise ValueError(f"failure policy {policy!r} is not one of: {choices}") from None
    failed = [t for t in trajs if t.status == TrajectoryStatus.FAILED]
    metrics: dict[str, float] = {
        "rollout/failed": float(len(failed)),
        "rollout/failed_frac": len(failed) / len(trajs) if trajs else 0.0,
    }
    for kind, count in Counter(t.failure_kind or "unknown" for t in failed).items():
        metrics[f"rollout/failed/{kind}"] = float(count)
    if failed and policy == FailurePolicy.RAISE:
        raise RolloutFailure(_describe(failed, len(trajs), "policy 'raise'"))
    if policy == FailurePolicy.ZERO_REWARD:
        for t in failed:
            t.reward, t.score = 0.0, 0.0
        kept = list(trajs)
    elif policy == FailurePolicy.DROP_SAMPLE:
        kept = [t for t in trajs if t.status != TrajectoryStatus.FAILED]
    else:
        bad = {t.sample.index for t in failed}
        kept = [t for t in trajs if t.sample.index not in bad]
    metrics["rollout/dropped"] = float(len(trajs) - len(kept))
    if failed and not kept:
        raise RolloutFailure(_describe(failed, len(trajs), f"every trajectory dropped by {policy.value!r}"))
    return kept, metrics


def _describe(failed: list[Trajectory], total: int, why: str) -> str:
    first = failed[0]
    kinds = dict(Counter(t.failure_kind or "unknown" for t in failed))
    return (
        f"{len(failed)}/{total} trajectories failed ({why}); kinds {kinds}. First: sample {first.sample.index} "
        f"prompt {first.sample.prompt[:80]!r}: {first.error}. Fix the agent / reward source, or choose another "
        "failure policy (drop_group, drop_sample, zero_reward)."
    )
