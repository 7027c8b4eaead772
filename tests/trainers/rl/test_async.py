"""Async training (train.async_train): bounded staleness, per-token versions across partial rollouts, the
resume guarantee, TIS on by default, config errors, and that the tiny task still learns (CPU, real engine).

The runs use 4 engine slots for 32 samples of up to 40 tokens, so a batch takes several times longer to
generate than a step to train (measured: ~0.35 s waiting vs ~0.08 s update per step): weight syncs land
while the next batch is in flight, which is what makes partial rollouts happen.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.agents.base import Trajectory
from relayrl.config.base import ConfigError, load_yaml
from relayrl.config.presets import tiny_cpu_config
from relayrl.config.rl import RLConfig
from relayrl.data.records import PromptSample
from relayrl.trainers.rl.async_rollout import Batch, RolloutPipeline, staleness_filter
from relayrl.trainers.rl.loop import RLTrainer, run_rl

pytestmark = pytest.mark.slow  # async RL runs, several of them on Ray

DATA = Path(__file__).parents[1] / "data"


def _cfg(model: Path, out: Path, *, steps: int = 5, staleness: int = 1, **train):
    cfg = tiny_cpu_config(str(model), str(out), steps=steps, reward=str(DATA / "digit_reward.py"))
    return replace(
        cfg,
        train=replace(cfg.train, async_train=True, max_staleness=staleness, **train),
        rollout=replace(cfg.rollout, max_new_tokens=40, max_len=128, engine_slots=4),
    )


def _run_recording(cfg) -> tuple[object, dict[int, list[Trajectory]]]:
    trainer = RLTrainer(cfg, banner=False)
    seen: dict[int, list[Trajectory]] = {}
    result = trainer.fit(on_step=lambda step, m: seen.__setitem__(step, list(trainer._last_trajs)))
    return result, seen


@pytest.mark.timeout(120)
def test_staleness_is_bounded_and_partial_rollouts_keep_per_token_versions(tiny_model_path, tmp_path):
    result, seen = _run_recording(_cfg(tiny_model_path, tmp_path / "run"))
    assert result.exit_code == 0, result.message
    partial = 0
    for step, trajs in seen.items():
        trained_by = step - 1  # step k trains the weights of version k - 1
        for t in trajs:
            v = [x for x, a in zip(t.versions, t.action_mask, strict=True) if a]
            assert len(v) == t.response_len and v == sorted(v), f"step {step}: versions {v}"
            assert trained_by - 1 <= v[0] and v[-1] <= trained_by  # max_staleness 1
            partial += len(set(v)) > 1
    assert partial > 0, "no sample ran across a weight sync (the test's premise: generation outlasts a step)"
    h = result.history
    assert h[0]["async/staleness_max"] == 0.0  # the first batch is made by the initial weights
    assert all(m["async/staleness_max"] == 1.0 for m in h[1:])  # the next ones started a version earlier
    assert all(m["async/dropped_stale"] == 0.0 for m in h)
    assert sum(m["async/partial_frac"] for m in h) > 0
    assert all("train/is_weight_mean" in m for m in h)  # TIS is the default correction in async mode
    saved = load_yaml(RLConfig, tmp_path / "run/config.yaml")
    assert saved.algo.off_policy == "tis" and saved.train.async_train


@pytest.mark.timeout(120)
def test_max_staleness_zero_waits_for_each_step(tiny_model_path, tmp_path):
    result, seen = _run_recording(_cfg(tiny_model_path, tmp_path / "run", steps=3, staleness=0))
    assert result.exit_code == 0, result.message
    for step, trajs in seen.items():
        assert {v for t in trajs for v, a in zip(t.versions, t.action_mask, strict=True) if a} == {step - 1}
    assert all(m["async/staleness_max"] == 0.0 and m["async/partial_frac"] == 0.0 for m in result.history)


@pytest.mark.timeout(180)
def test_resumed_async_run_trains_the_same_prompts_with_the_same_seeds(tiny_model_path, tmp_path):
    """The documented guarantee: after a resume, every step trains the prompts the uninterrupted run trained
    (the checkpoint stores the sampler as after the consumed batch, not the producer's, which is ahead)."""

    def prompts(seen):
        return {s: sorted(t.sample.index for t in ts) for s, ts in seen.items()}

    cfg = _cfg(tiny_model_path, tmp_path / "full", steps=4)
    full, seen_full = _run_recording(replace(cfg, ckpt=replace(cfg.ckpt, resume="auto")))
    assert full.exit_code == 0

    split_cfg = _cfg(tiny_model_path, tmp_path / "split", steps=4)
    split_cfg = replace(split_cfg, ckpt=replace(split_cfg.ckpt, resume="auto"))
    trainer = RLTrainer(split_cfg, banner=False)
    seen_split: dict[int, list[Trajectory]] = {}

    def interrupt(step: int, metrics: dict) -> None:
        seen_split[step] = list(trainer._last_trajs)
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # checkpoint at step 2 while batch 3 is in flight

    first = trainer.fit(on_step=interrupt)
    assert first.exit_code == 128 + signal.SIGINT and first.steps == 2
    second, seen_rest = _run_recording(split_cfg)
    assert second.exit_code == 0 and second.steps == 4
    seen_split.update(seen_rest)
    assert prompts(seen_split) == prompts(seen_full)
    # the first step after the resume is generated by the checkpoint's weights alone (no partial rollout)
    assert {v for t in seen_rest[3] for v, a in zip(t.versions, t.action_mask, strict=True) if a} == {2}


@pytest.mark.timeout(120)
def test_async_training_raises_the_reward(tiny_model_path, tmp_path):
    """The convergence check of test_rl_convergence with async on (measured: 0.103 -> 0.40)."""
    cfg = tiny_cpu_config(
        str(tiny_model_path), str(tmp_path / "run"), steps=16, reward=str(DATA / "digit_reward.py")
    )
    result = run_rl(replace(cfg, train=replace(cfg.train, async_train=True)))
    assert result.exit_code == 0, result.message
    rewards = [h["rollout/reward_mean"] for h in result.history]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-4:]) / 4
    assert last > first + 0.1, f"reward {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize("flag", ["--dist.engine_sleep yes", "--dist.offload_optimizer_in_rollout true"])
def test_async_with_memory_juggling_flags_is_a_config_error(tiny_model_path, tmp_path, flag):
    from relayrl.config.command_line import parse_cli
    from relayrl.trainers.rl.validate import validate_rl

    argv = ["--model.name_or_path", str(tiny_model_path), "--train.async_train", "true", *flag.split()]
    with pytest.raises(ConfigError, match=flag.split()[0].removeprefix("--")):
        validate_rl(parse_cli(RLConfig, argv))


def test_negative_max_staleness_is_a_config_error():
    from relayrl.config.command_line import parse_cli

    with pytest.raises(ConfigError, match="max_staleness"):
        parse_cli(RLConfig, ["--train.max_staleness", "-1"])


# ------------------------------------------------------------------------------------------- pieces
def _traj(index: int, versions: list[int]) -> Trajectory:
    sample = PromptSample(index=index, prompt="p", prompt_ids=[1, 2])
    return Trajectory(
        sample=sample,
        token_ids=[1, 2] + [3] * len(versions),
        action_mask=[False, False] + [True] * len(versions),
        rollout_logprobs=[0.0] * (2 + len(versions)),
        versions=[-1, -1, *versions],
    )


def test_staleness_filter_drops_whole_groups_and_counts():
    trajs = [_traj(0, [5, 5]), _traj(0, [3, 4]), _traj(1, [4, 5]), _traj(1, [5, 5])]
    keep, m = staleness_filter(trajs, version=5, max_staleness=1, group_size=2)
    assert keep == trajs[2:]  # group 0 has a token 2 versions old
    assert m["async/dropped_stale"] == 2.0
    assert m["async/staleness_max"] == 2.0 and m["async/staleness_mean"] == (0 + 2 + 1 + 0) / 4
    assert m["async/partial_frac"] == 0.5
    keep, m = staleness_filter(trajs, version=5, max_staleness=1, group_size=None)
    assert keep == [trajs[0], *trajs[2:]] and m["async/dropped_stale"] == 1.0
    unknown = _traj(2, [1])
    unknown.versions = []  # an executor that records no versions: kept, not counted as stale
    keep, m = staleness_filter([unknown], version=9, max_staleness=0, group_size=1)
    assert keep == [unknown] and m["async/versions_known_frac"] == 0.0 and "async/staleness_max" not in m


def test_pipeline_starts_batch_j_only_after_step_j_minus_1_minus_k():
    started: dict[int, int] = {}
    done = [0]

    def produce(j: int) -> Batch:
        started[j] = done[0]
        return Batch(step=j)

    pipe = RolloutPipeline(produce, first_step=1, last_step=6, max_staleness=2, steps_done=0)
    try:
        for step in range(1, 7):
            batch, _ = pipe.take(step)
            assert batch.step == step and batch.started_version >= step - 1 - 2
            time.sleep(0.05)  # give the producer the chance to run ahead as far as it may
            assert max(started) <= step + 2  # never more than K batches ahead of the trainer
            done[0] = step
            pipe.step_done(step)
    finally:
        pipe.close(timeout=5)
    assert all(started[j] >= j - 3 for j in started)


def test_pipeline_hands_the_producers_error_to_the_trainer():
    def produce(j: int) -> Batch:
        raise RuntimeError(f"reward server down at step {j}")

    pipe = RolloutPipeline(produce, first_step=3, last_step=5, max_staleness=1, steps_done=2)
    try:
        batch, _ = pipe.take(3)
        assert isinstance(batch.error, RuntimeError) and "step 3" in str(batch.error)
        with pytest.raises(RuntimeError, match="producer stopped before step 4"):
            pipe.take(4)
    finally:
        pipe.close(timeout=5)
    assert not any(t.name == "relayrl-rollout-pipeline" and t.is_alive() for t in threading.enumerate())


@pytest.mark.timeout(300)
def test_async_in_ray_mode_with_a_two_rank_policy(tiny_model_path, tmp_path):
    """The same pipeline with the policy as 2 FSDP2 ranks on a local Ray cluster (gloo): each rank's actor runs
    its share of the rollout on one thread while the update and the weight sync (a collective gather into the
    engine's replica, under `paused()`) run on another."""
    import ray

    cfg = _cfg(tiny_model_path, tmp_path / "run", steps=3)
    cfg = replace(cfg, dist=replace(cfg.dist, mode="ray", num_cpus=2, policy_num_gpus_per_node=2))
    result, seen = _run_recording(cfg)
    assert not ray.is_initialized()
    assert result.exit_code == 0, result.message
    assert [m["async/staleness_max"] for m in result.history] == [0.0, 1.0, 1.0]
    for step, trajs in seen.items():
        versions = {v for t in trajs for v, a in zip(t.versions, t.action_mask, strict=True) if a}
        assert versions and versions <= {step - 2, step - 1}
    assert (tmp_path / "run/final/model.safetensors").is_file()


SKIP_SECOND_BATCH = """
calls = 0


def reward_func(queries, prompts, labels, **kwargs):
    global calls
    calls += 1
    if calls == 2:  # every sample of the second batch fails: its step is skipped
        return {"rewards": [float("nan")] * len(queries)}
    out = [sum(c.isdigit() for c in q[len(p):]) / max(1, len(q) - len(p)) for q, p in zip(queries, prompts)]
    return {"rewards": out, "scores": out}
"""


@pytest.mark.timeout(120)
def test_a_skipped_step_does_not_make_later_batches_stale(tiny_model_path, tmp_path):
    """A step with nothing to train still advances the policy version (same weights), so the batches after it
    start at the right version: only that step is skipped, none after it is dropped as stale."""
    reward = tmp_path / "skip_second.py"
    reward.write_text(SKIP_SECOND_BATCH)
    cfg = _cfg(tiny_model_path, tmp_path / "run", steps=6)
    cfg = replace(cfg, reward=replace(cfg.reward, source=str(reward)))
    result = run_rl(cfg)
    assert result.exit_code == 0, result.message
    assert [int(m["train/step"]) for m in result.history] == [1, 3, 4, 5, 6]
    assert all(m["async/dropped_stale"] == 0.0 and m["async/staleness_max"] <= 1.0 for m in result.history)


@pytest.mark.timeout(120)
def test_eval_runs_beside_the_producer(tiny_model_path, tmp_path):
    """Eval generates on the same engine while the producer generates the next batch (two event loops, one
    engine): both finish, every eval step is logged."""
    cfg = _cfg(tiny_model_path, tmp_path / "run", steps=4)
    cfg = replace(cfg, task=replace(cfg.task, eval_rows=16), eval=replace(cfg.eval, every=2))
    result = run_rl(cfg)
    assert result.exit_code == 0, result.message
    assert [("eval/pass@1" in m) for m in result.history] == [False, True, False, True]
    assert result.first_eval and "eval/pass@1" in result.eval
