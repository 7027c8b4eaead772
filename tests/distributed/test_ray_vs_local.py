"""`dist.mode=ray` runs the same worker classes as Ray actors (local Ray cluster, 2 CPUs, placement group
with one bundle per role) and gives the same first-step metrics as `dist.mode=local` for the same seed.

Tolerance: 1e-5 relative (+1e-6 absolute). Sampling is identical (per-request seeds); the remaining
difference is float summation order, since a Ray actor runs torch with 1 thread and the local run with 2.
All four roles are exercised: policy (+ colocated engine), reference (KL in the loss), critic (gae), reward.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import run_rl

pytestmark = pytest.mark.slow  # an RL run on Ray beside a local one

DATA = Path(__file__).parents[1] / "trainers" / "data"
VOLATILE = ("timing/", "perf/")


def _cfg(model: Path, out: Path, mode: str):
    cfg = tiny_cpu_config(str(model), str(out), steps=1, reward=str(DATA / "digit_reward.py"))
    return replace(
        cfg,
        algo=replace(cfg.algo, advantage="gae", kl_mode="loss", kl_coef=0.1),
        dist=replace(cfg.dist, mode=mode, num_cpus=2),
    )


@pytest.mark.timeout(240)
def test_ray_and_local_first_step_metrics_match(tiny_model_path, tmp_path):
    import ray

    local = run_rl(_cfg(tiny_model_path, tmp_path / "local", "local"))
    remote = run_rl(_cfg(tiny_model_path, tmp_path / "ray", "ray"))
    assert not ray.is_initialized(), "the run must shut down the Ray cluster it started"
    assert local.exit_code == remote.exit_code == 0
    a, b = local.history[0], remote.history[0]
    keys = {k for k in a if not k.startswith(VOLATILE)}
    assert keys == {k for k in b if not k.startswith(VOLATILE)}
    for k in ("train/policy_loss", "critic/loss", "rollout/kl", "rollout/reward_mean", "train/kl_loss"):
        assert k in keys, k
    for k in sorted(keys):
        assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), f"{k}: local {a[k]} vs ray {b[k]}"
    assert (tmp_path / "ray/final/model.safetensors").is_file()
