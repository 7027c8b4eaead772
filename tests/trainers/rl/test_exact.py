"""`relayrl rl` with rollout.exact on a CPU: every step's engine-vs-trainer mismatch is exactly 0 and the update's
ratio exactly 1; the same run with the mode off has a non-zero mismatch (so the test can fail).

kl_mode "reward" keeps the old-log-prob pass with one epoch and one mini-batch, so each step reports the
mismatch of the engine's log-probs against the trainer's (mismatch/*) and the update's ratio against that pass
(train/ratio_mean, train/approx_kl) and against the engine (train/logprob_diff)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.config.base import ConfigError
from relayrl.config.presets import tiny_cpu_config
from relayrl.config.rl import RolloutConfig
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.trainers.rl.validate import validate_rl

DIGITS = str(Path(__file__).parents[1] / "data" / "digit_reward.py")


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
def test_exact_mode_has_zero_mismatch_every_step(tiny_model_path, tmp_path, exact):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=2, reward=DIGITS)
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, exact=exact),
        algo=replace(cfg.algo, kl_mode="reward", kl_coef=0.01),
    )
    history = RLTrainer(cfg).fit().history
    assert len(history) == 2
    for h in history:
        if exact:
            assert h["mismatch/logprob_absdiff_max"] == 0.0 and h["mismatch/seq_ratio_out_frac"] == 0.0
            assert h["train/logprob_diff"] == 0.0
            assert h["train/ratio_mean"] == 1.0 and h["train/approx_kl"] == 0.0
        else:
            assert h["mismatch/logprob_absdiff_max"] > 0.0


def test_exact_mode_needs_the_native_engine_and_unsharded_policies(tmp_path):
    with pytest.raises(ConfigError, match="exact"):
        RolloutConfig(engine="hf", exact=True)
    cfg = tiny_cpu_config("m", str(tmp_path), steps=1)
    cfg = replace(cfg, rollout=replace(cfg.rollout, exact=True))
    validate_rl(cfg)  # one local policy: fine
    with pytest.raises(ConfigError, match=r"rollout\.exact .* LoRA"):
        validate_rl(replace(cfg, model=replace(cfg.model, lora=replace(cfg.model.lora, rank=8))))
    two = replace(cfg.dist, mode="ray", policy_num_gpus_per_node=2)
    with pytest.raises(ConfigError, match=r"rollout\.exact .* 2 policy ranks \(FSDP shards"):
        validate_rl(replace(cfg, dist=two))
    validate_rl(replace(cfg, dist=replace(two, replicate=True)))  # whole policies on both ranks: fine
