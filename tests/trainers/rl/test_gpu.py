"""The RL step on a GPU (marked `gpu`): mixed precision end to end.

The policy computes with bf16 weights over fp32 masters (varlen attention); the native engine generates from
its own bf16 copy of them (rollout.engine_copy auto: a tiny model's copy is far below 5% of any card; fused
q/k/v and gate/up), which the sync refreshes from the policy on the device after every update.
After the run the weight canary is 0 (the engine holds exactly the trained fp32 weights cast to bf16), the
refresh time is reported, and the first step's engine-vs-trainer log-prob mismatch is bf16-sized (the same
weights, differently fused kernels), not a sync bug (order 1).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.workers.policy import PolicyWorker

DIGITS = str(Path(__file__).parents[1] / "data" / "digit_reward.py")


@pytest.mark.gpu
def test_mixed_precision_rl_step_keeps_the_engine_in_sync(tiny_model_path, tmp_path):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=3, reward=DIGITS)
    cfg = replace(cfg, train=replace(cfg.train, device="cuda"))
    trainer = RLTrainer(cfg)
    info = trainer.roles.policy.call(PolicyWorker.info)
    assert (info["precision"], info["layout"], info["engine_weights"]) == ("bf16", "varlen", "copy")
    canary = {}
    original_close = trainer.roles.close

    def close_after_canary():
        canary["diff"] = trainer.roles.policy.call(PolicyWorker.weight_canary)
        original_close()

    trainer.roles.close = close_after_canary
    result = trainer.fit()
    assert result.exit_code == 0 and canary["diff"] == 0.0
    first = result.history[0]
    print(f"first-step |trainer - engine| log-prob: {first['train/logprob_diff']:.4g}; "
          f"engine refresh {first['timing/engine_refresh'] * 1e3:.2f} ms")  # fmt: skip
    assert first["train/logprob_diff"] < 0.05
    assert all(h["timing/engine_refresh"] > 0 for h in result.history)
