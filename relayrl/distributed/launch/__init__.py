"""Launch role workers in-process (`local`) or as groups of Ray actors (`ray`): the same worker classes either way.

launcher = build_launcher(dist_cfg, {"policy": 2, "reward": 1, "reference": 2})   # role -> ranks
policy = launcher.spawn("policy", PolicyWorker, spec)     # RoleHandle[PolicyWorker] over the role's ranks
trajs = policy.call(PolicyWorker.rollout, prompts, seed)   # every rank runs it; results merged
job = reference.submit(ReferenceWorker.logprobs, batch)    # start several roles at once ...
ref = job.result()                                         # ... and collect each
launcher.shutdown()

base.py       RoleHandle[W] / Pending[R] / Launcher (the Protocols the trainers see), RoleError
local.py      LocalLauncher, LocalRole: every role one object in this process (the 1-rank case)
ray.py        RayLauncher, RayRole, RankHost: a role as one Ray actor per rank in a torch.distributed group
placement.py  which placement group each role sits in, GPUs / CPUs per bundle
failures.py   which rank failed, died or stalled: one RoleError naming role, rank, host and cause
oom.py        a CUDA out-of-memory error as one line: role, rank, phase, memory figures, settings that lower it
watchdog.py   a call that makes no progress for dist.stall_timeout_s: every rank's stacks to the run folder
rows.py       RowStore / StoredRows: a step's records in Ray's object store in blocks of rows; ranks fetch their share
profile.py    per-rank call timings and torch.profiler splits (RELAYRL_PROFILE_DIR; bench/profile_step.py)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from relayrl.config.dist import DistConfig
from relayrl.distributed.launch.base import Launcher
from relayrl.distributed.launch.local import LocalLauncher
from relayrl.distributed.launch.ray import RayLauncher

LAUNCHERS: dict[str, Callable[[DistConfig, dict[str, int], Path | None], Launcher]] = {
    "local": lambda cfg, roles, stacks: LocalLauncher(cfg.stall_timeout_s, stacks),
    "ray": RayLauncher,
}
"""dist.mode -> the launcher for it."""

STACKS_DIR = "stacks"
"""The run folder's sub-folder where the stall watchdog writes every stuck rank's Python stacks."""


def build_launcher(cfg: DistConfig, roles: dict[str, int], run_dir: Path | None = None) -> Launcher:
    """The launcher for `cfg.mode` sized for `roles` (role -> ranks); a clear error lists the modes. The stall
    watchdog (dist.stall_timeout_s) writes stacks to `<run_dir>/stacks` (stderr without a run folder)."""
    if cfg.mode not in LAUNCHERS:
        raise ValueError(f"dist.mode: unknown execution mode {cfg.mode!r}; choose one of {sorted(LAUNCHERS)}")
    return LAUNCHERS[cfg.mode](cfg, roles, None if run_dir is None else run_dir / STACKS_DIR)
