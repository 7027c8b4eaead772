"""The first RL step on CPU is exactly on-policy, and the update does only the forwards its math needs.

- The engine's log-probs of the sampled tokens equal the trainer's recomputation (train/logprob_diff, the mean
  |trainer - engine| over action tokens) within 1e-5; with one epoch and one mini-batch the ratio is 1 and
  approx_kl is 0 exactly, and no separate old-log-prob pass runs (the policy's `logprobs` is never called).
- With two epochs the ratio moves in the second epoch, so the old-log-prob pass runs (once per step).
- An off-policy correction with one epoch needs no pass either: its pi_old is the detached current log-prob.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer

DIGITS = str(Path(__file__).parents[1] / "data" / "digit_reward.py")  # graded reward: groups have variance


def _run(cfg):
    trainer = RLTrainer(cfg)
    calls: list[str] = []
    submit = trainer.roles.policy.submit

    def spy_submit(method, *a, **k):  # the controller starts log-probs and updates with submit
        calls.append(method.__name__)
        return submit(method, *a, **k)

    trainer.roles.policy.submit = spy_submit
    return trainer.fit(), calls


def test_first_step_is_on_policy_and_skips_the_old_logprob_pass(tiny_model_path, tmp_path):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=2, reward=DIGITS)
    result, calls = _run(cfg)
    first = result.history[0]
    assert first["train/logprob_diff"] < 1e-5
    assert first["train/approx_kl"] == 0.0 and first["train/ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert first["train/clip_frac"] == 0.0
    assert "logprobs" not in calls and calls.count("update") == 2


def test_two_epochs_keep_the_old_logprob_pass(tiny_model_path, tmp_path):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=2, reward=DIGITS)
    cfg = replace(cfg, algo=replace(cfg.algo, epochs=2))
    result, calls = _run(cfg)
    assert calls.count("logprobs") == 2  # once per step
    first = result.history[0]
    # metrics average the two epochs: the first runs at ratio 1, the second after one update moved the policy
    assert first["train/approx_kl"] > 0.0 and first["train/logprob_diff"] > 1e-4


def test_off_policy_correction_with_one_epoch_uses_the_detached_logprobs(tiny_model_path, tmp_path):
    base = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "a"), steps=2, reward=DIGITS)
    tis, calls = _run(replace(base, algo=replace(base.algo, off_policy="tis")))
    assert "logprobs" not in calls
    assert all("train/is_weight_mean" in h for h in tis.history)
    # the same run with the pass forced (2 mini-batches of one row set each would change the update; a KL in
    # the reward at coefficient 0 keeps one mini-batch and forces the pass): identical IS weights and losses
    forced_cfg = replace(
        base,
        train=replace(base.train, output_dir=str(tmp_path / "b")),
        algo=replace(base.algo, off_policy="tis", kl_mode="reward", kl_coef=0.0),
    )
    forced, calls = _run(forced_cfg)
    assert calls.count("logprobs") == 2
    for a, b in zip(tis.history, forced.history, strict=True):
        for key in ("train/is_weight_mean", "train/loss", "train/kl_rollout_train"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
