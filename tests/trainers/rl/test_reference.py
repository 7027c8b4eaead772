"""Numerics regression (STYLE rule 13): a tiny deterministic RL run's per-step losses and rewards must
reproduce tests/trainers/data/rl_reference.json under the fixed seed.

Regenerate deliberately (after an intended numerical change, say why in the commit):
    RELAYRL_UPDATE_REFERENCE=1 .venv/bin/pytest tests/trainers/test_rl_reference.py
Tolerance 1e-5 relative: CPU fp32 with a fixed thread count reproduces bit-exactly on one machine; the slack
covers other CPUs' summation order, and any real change to sampling, losses or advantages moves these values
by far more (a changed sample flips a reward by 1/32).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import run_rl

DATA = Path(__file__).parents[1] / "data"
REFERENCE = DATA / "rl_reference.json"
KEYS = (
    "rollout/reward_mean",
    "adv/advantage_std",
    "train/policy_loss",
    "train/entropy",
    "train/grad_norm",
    "critic/loss",
)


@pytest.mark.timeout(60)
def test_per_step_losses_match_the_reference(tiny_model_path, tmp_path):
    cfg = tiny_cpu_config(
        str(tiny_model_path), str(tmp_path / "run"), steps=3, reward=str(DATA / "digit_reward.py")
    )
    cfg = replace(cfg, algo=replace(cfg.algo, advantage="gae", mini_batches=2, micro_batch_tokens=64))
    result = run_rl(cfg)
    assert result.exit_code == 0
    got = [{k: h[k] for k in KEYS} for h in result.history]
    if os.environ.get("RELAYRL_UPDATE_REFERENCE") == "1":
        REFERENCE.write_text(
            json.dumps(
                {"config": "tiny_cpu_config + gae, 2 mini-batches, 64-token micro-batches", "steps": got},
                indent=2,
            )
            + "\n"
        )
        pytest.skip("reference regenerated")
    want = json.loads(REFERENCE.read_text())["steps"]
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=1):
        for k in KEYS:
            assert math.isclose(g[k], w[k], rel_tol=1e-5, abs_tol=1e-7), f"step {step} {k}: {g[k]} != {w[k]}"
