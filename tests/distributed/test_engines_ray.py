"""Separate engine actors (`dist.num_engines`, ray mode, CPU with gloo): the engines generate the prompts'
shares, the policy's rank 0 broadcasts new weights to them after every step (their own process group), and
the run equals the colocated one; async training works across the actor boundary."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer, run_rl
from relayrl.workers.engine import EngineWorker

pytestmark = pytest.mark.slow  # engine actors on Ray

DATA = Path(__file__).parents[1] / "trainers" / "data"


def _cfg(model: Path, out: Path, *, steps: int, mode: str = "ray", engines: int = 2, **train):
    cfg = tiny_cpu_config(str(model), str(out), steps=steps, reward=str(DATA / "digit_reward.py"))
    return replace(
        cfg,
        train=replace(cfg.train, **train),
        dist=replace(cfg.dist, mode=mode, num_cpus=2, num_engines=engines if mode == "ray" else 0),
    )


def _checksum(folder: Path) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


@pytest.fixture(scope="module")
def local_run(tiny_model_path, tmp_path_factory):
    """The colocated 2-step run both engine tests compare with (local mode: one engine in the policy's process);
    read only: the tests compare their metrics with its history."""
    return run_rl(_cfg(tiny_model_path, tmp_path_factory.mktemp("local"), steps=2, mode="local"))


@pytest.mark.timeout(300)
def test_two_engine_actors_match_the_colocated_run_and_hold_the_trained_weights(
    tiny_model_path, tmp_path, local_run
):
    import ray

    local = local_run
    trainer = RLTrainer(_cfg(tiny_model_path, tmp_path / "ray", steps=2), banner=False)
    seen: dict[int, list[float]] = {}
    result = trainer.fit(
        on_step=lambda step, m: seen.__setitem__(
            step, trainer.roles.engines.call(EngineWorker.weight_checksum)
        )
    )
    assert not ray.is_initialized()
    assert local.exit_code == result.exit_code == 0, result.message
    # the same prompts, seeds and weights: the same samples, rewards and losses as one colocated engine
    for a, b in zip(local.history, result.history, strict=True):
        for k in ("rollout/reward_mean", "rollout/response_len", "train/policy_loss", "train/logprob_diff"):
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (
                f"{k}: local {a[k]} vs engines {b[k]}"
            )
    # after the last step's broadcast both engines hold exactly the trained weights (fp32 on a CPU)
    final = _checksum(tmp_path / "ray/final")
    assert len(seen[2]) == 2 and all(c == pytest.approx(final, rel=1e-12) for c in seen[2])
    assert seen[1][0] != pytest.approx(final, rel=1e-9)  # and they changed between steps


@pytest.mark.timeout(300)
def test_a_tensor_parallel_native_engine_of_two_actors_matches_the_colocated_run(
    tiny_model_path, tmp_path, local_run
):
    """One separate native engine with dist.engine_tp 2: two shard actors (rank 0 leads, rank 1 follows),
    each receiving the policy's broadcast and keeping its half; the run equals one colocated engine (fp32:
    TP only reorders sums, so the same samples and, after the step-1 broadcast, the same step-2 losses)."""
    local = local_run
    cfg = _cfg(tiny_model_path, tmp_path / "ray", steps=2, engines=1)
    cfg = replace(cfg, dist=replace(cfg.dist, engine_tp=2))
    trainer = RLTrainer(cfg, banner=False)
    assert trainer.roles.engines is not None and trainer.roles.engines.world == 2
    result = trainer.fit()
    assert local.exit_code == result.exit_code == 0, result.message
    for a, b in zip(local.history, result.history, strict=True):
        for k in ("rollout/reward_mean", "rollout/response_len", "train/policy_loss", "train/logprob_diff"):
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6), (
                f"{k}: local {a[k]} vs TP engine {b[k]}"
            )


@pytest.mark.timeout(300)
def test_async_training_with_separate_engines(tiny_model_path, tmp_path):
    cfg = _cfg(tiny_model_path, tmp_path / "run", steps=3, async_train=True)
    cfg = replace(cfg, rollout=replace(cfg.rollout, max_new_tokens=24, max_len=96, engine_slots=4))
    trainer = RLTrainer(cfg, banner=False)
    versions: dict[int, set[int]] = {}

    def record(step: int, metrics: dict) -> None:
        versions[step] = {
            v for t in trainer._last_trajs for v, a in zip(t.versions, t.action_mask, strict=True) if a
        }

    result = trainer.fit(on_step=record)
    assert result.exit_code == 0, result.message
    assert [m["async/staleness_max"] for m in result.history] == [0.0, 1.0, 1.0]
    for step, vs in versions.items():
        assert vs and vs <= {step - 2, step - 1}


def test_num_engines_needs_ray_mode(tiny_model_path, tmp_path):
    from relayrl.config.base import ConfigError
    from relayrl.trainers.rl.validate import validate_rl

    cfg = _cfg(tiny_model_path, tmp_path / "run", steps=1, mode="local")
    cfg = replace(cfg, dist=replace(cfg.dist, num_engines=2))
    with pytest.raises(ConfigError, match=r"dist\.num_engines=2 needs dist\.mode ray"):
        validate_rl(cfg)


@pytest.mark.parametrize(
    "engine, engines, match",
    [
        ("hf", 2, r"dist\.engine_tp=2 with separate engines .* vllm or native \(got 'hf'\)"),
        ("vllm", 0, r"dist\.engine_tp=2 \(colocated\) needs rollout\.engine native \(got 'vllm'\)"),
    ],
)
def test_engine_tp_needs_separate_vllm_engines(tiny_model_path, tmp_path, engine, engines, match):
    from relayrl.config.base import ConfigError
    from relayrl.trainers.rl.validate import validate_rl

    cfg = _cfg(tiny_model_path, tmp_path, steps=1, engines=engines)
    cfg = replace(cfg, rollout=replace(cfg.rollout, engine=engine), dist=replace(cfg.dist, engine_tp=2))
    with pytest.raises(ConfigError, match=match):
        validate_rl(cfg)
