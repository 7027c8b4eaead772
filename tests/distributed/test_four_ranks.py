"""The N-rank code paths at N = 4, on a REAL local Ray cluster (2 CPUs, gloo, one CPU process per rank): every
result equals the 1-rank run of the same seed (the 2-rank versions are test_data_parallel / test_engines_ray).

- GRPO, policy on 4 ranks == 1 rank (local mode), 2 steps: every per-step metric (losses, rewards, gradient
  norm, ...), the exact sampled tokens and rewards of every trajectory, and the final weights. Two shapes of
  batch: 5 prompts x 4 samples in 2 mini-batches of 10 rows (uneven shares everywhere: 1 or 2 prompts to
  generate, 2 or 3 rows per rank, ranks with 1 or 2 micro-batches of <= 24 tokens), and 3 prompts in 4
  mini-batches of 3 rows (rank 3 generates nothing and has no row in any optimizer step: it runs padding
  passes of weight 0).
- PPO (gae critic, reference with the KL in the loss) with policy, reference and critic on 4 ranks each, the
  reference colocated on the policy's bundles, == local mode over 2 steps. colocate_all places on this
  cluster (`test_colocate_all_places_on_a_two_cpu_cluster`; it could not before the bundles' CPU fix).
- SFT on 4 ranks (`--dist.num_gpus_per_node 4`) == one process: 5 micro-batches a step over 4 ranks (1 or 2),
  the eval's 2 micro-batches leave ranks 2 and 3 without one; per-step metrics, final weights, and the 4-rank
  DCP checkpoint resumed on 1 rank continues the uninterrupted run.
- 4 separate native engine actors (`dist.num_engines 4`) beside a 2-rank policy == one colocated engine in
  local mode: the same tokens and rewards for every trajectory, the same metrics, and after the last step
  all 4 engines hold exactly the trained weights.

Tolerances are those of the 2-rank tests, for the same reason: the ranks compute the same sums in another
order (per-rank partial gradients, a gloo reduce-scatter, a different micro-batch split), so fp32 results
differ by rounding. Metrics: rtol 1e-4, atol 1e-5 (test_data_parallel: a lost share, a wrong global
denominator or a missing reduction moves a loss by > 1e-2). Weights: 1e-4 absolute (test_fsdp_ray: AdamW
moves a coordinate by at most lr = 3e-3 per step, a bug moves weights by ~lr). Measured here: metrics of size
> 1e-3 within 6e-6 relative, weights within 7e-6. Sampled tokens must be identical: request seeds depend only
on the step and the prompt, and the step-2 weights differ by rounding only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from dp_fixtures import assert_metrics_close as _close

from relayrl.config.dist import DistConfig
from relayrl.config.presets import tiny_cpu_config
from relayrl.config.rl import RLConfig
from relayrl.distributed.group import shares
from relayrl.distributed.launch.base import RoleError
from relayrl.distributed.launch.ray import RayLauncher
from relayrl.trainers.rl.loop import RLResult, RLTrainer
from relayrl.workers.base import split_rows
from relayrl.workers.engine import EngineWorker
from relayrl.workers.policy import PolicyWorker

pytestmark = pytest.mark.slow  # Ray with four gloo ranks

DATA = Path(__file__).parents[1] / "trainers" / "data"
RANKS = 4
WEIGHT_ATOL = 1e-4
LR = 3e-3  # tiny_cpu_config's


@pytest.fixture(scope="module")
def ray_cluster():
    """One local 2-CPU Ray cluster for the module; each run places its own actors on it and removes them."""
    import ray

    assert not ray.is_initialized(), "an earlier test left Ray running"
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM") if k in os.environ}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        yield ray
    finally:
        ray.shutdown()


# ------------------------------------------------------------------------------------------------ helpers


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _same_weights(got: Path, want: Path, start: Path) -> None:
    """`got` equals `want` within WEIGHT_ATOL, and `want` moved from `start` (the run really trained)."""
    a, b, s = _weights(got), _weights(want), _weights(start)
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in b)
    assert worst < WEIGHT_ATOL, worst
    assert max(float((b[k] - s[k]).abs().max()) for k in s) > LR / 2


def _rl_cfg(model: Path, out: Path, *, prompts: int, dist: dict | None = None, **algo: Any) -> RLConfig:
    """tiny_cpu_config, 2 steps of `prompts` x 4 samples; local mode, or ray mode with the `dist` fields."""
    cfg = tiny_cpu_config(str(model), str(out), steps=2, reward=str(DATA / "digit_reward.py"))
    return replace(
        cfg,
        rollout=replace(cfg.rollout, prompts_per_step=prompts),
        algo=replace(cfg.algo, **algo),
        dist=DistConfig(mode="ray", num_cpus=2, gpus="no", timeout_s=120, **dist) if dist else DistConfig(),
    )


@dataclass
class Run:
    """What a run logged, step by step."""

    result: RLResult
    samples: dict[int, list[tuple]] = field(default_factory=dict)
    """step -> (prompt index, token ids, reward) of every trajectory, in batch order."""
    probes: dict[int, Any] = field(default_factory=dict)
    """step -> what `probe(trainer)` returned after the step."""
    placement: dict[str, Any] = field(default_factory=dict)
    """role -> (ranks, pool) in ray mode, before the run."""


def _fit(cfg: RLConfig, probe: Any = None) -> Run:
    """Run `cfg` to the end, recording every step's trajectories (and `probe(trainer)` when given)."""
    trainer = RLTrainer(cfg, banner=False)
    placement: dict[str, Any] = {}
    if cfg.dist.mode == "ray":
        where, roles = trainer.roles.launcher.where, trainer.roles
        for n in ("policy", "reference", "critic", "engines"):
            if (role := getattr(roles, n)) is not None:
                placement[n] = (role.world, where[role.name])
        placement["pools"] = len(trainer.roles.launcher.pools)
    samples: dict[int, list[tuple]] = {}
    probes: dict[int, Any] = {}

    def on_step(step: int, metrics: dict) -> None:
        samples[step] = [(t.sample.index, tuple(t.token_ids), t.reward) for t in trainer._last_trajs]
        if probe is not None:
            probes[step] = probe(trainer)

    result = trainer.fit(on_step=on_step)
    assert result.exit_code == 0, result.message
    return Run(result=result, samples=samples, probes=probes, placement=placement)


def _canary(trainer: RLTrainer) -> float:
    """max |engine weight - trained weight| over the policy's ranks (0: every engine is up to date)."""
    return trainer.roles.policy.call(PolicyWorker.weight_canary)


def _engine_checksums(trainer: RLTrainer) -> list[float]:
    """Sum of |w| of each separate engine's weights, in engine order."""
    return trainer.roles.engines.call(EngineWorker.weight_checksum)


def _same_run(got: Run, want: Run) -> None:
    """Step by step: the same trajectories (tokens and rewards exactly), then the same metrics."""
    assert sorted(got.samples) == sorted(want.samples) == [1, 2]
    assert len(got.result.history) == len(want.result.history) == 2
    for step, a, b in zip((1, 2), want.result.history, got.result.history, strict=True):
        assert got.samples[step] == want.samples[step], f"step {step}: different samples"
        _close(a, b, f"step {step}")


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "prompts, mini_batches",
    [(5, 2), (3, 4)],
    ids=["uneven-shares", "rank-without-rows"],
)
def test_grpo_policy_on_four_ranks_equals_one_rank(
    ray_cluster, tiny_model_path, tmp_path, prompts, mini_batches
):
    # the shapes the ids promise: 4 ranks get unequal shares of the prompts and of each mini-batch's rows
    rows = prompts * 4
    prompt_shares = [len(r) for r in shares([1.0] * prompts, RANKS)]
    assert len(set(prompt_shares)) > 1, prompt_shares
    assert all(len(mb) % RANKS for mb in split_rows(rows, mini_batches))
    if mini_batches == 4:
        assert 0 in prompt_shares and all(len(mb) < RANKS for mb in split_rows(rows, mini_batches))

    algo = {"mini_batches": mini_batches, "micro_batch_tokens": 24}  # 2 rows (~12 tokens) per micro-batch
    four_ranks = {"policy_num_gpus_per_node": RANKS}
    one = _fit(_rl_cfg(tiny_model_path, tmp_path / "one", prompts=prompts, **algo))
    four = _fit(
        _rl_cfg(tiny_model_path, tmp_path / "four", prompts=prompts, dist=four_ranks, **algo), _canary
    )

    assert four.placement["policy"] == (RANKS, "policy")
    assert "reference" not in four.placement and "critic" not in four.placement  # GRPO without KL
    assert four.probes == {1: 0.0, 2: 0.0}  # every rank's engine holds the trained weights
    assert all(len(s) == rows for s in four.samples.values())
    _same_run(four, one)
    assert "train/policy_loss" in one.result.history[0] and "train/grad_norm" in one.result.history[0]
    assert one.result.history[0]["train/grad_norm"] > 0.1  # the loss has a gradient: the comparison bites
    _same_weights(tmp_path / "four/final", tmp_path / "one/final", tiny_model_path)


@pytest.mark.timeout(240)
def test_ppo_policy_reference_critic_on_four_ranks_equal_local(ray_cluster, tiny_model_path, tmp_path):
    algo = {"advantage": "gae", "kl_mode": "loss", "kl_coef": 0.1}
    local = _fit(_rl_cfg(tiny_model_path, tmp_path / "local", prompts=6, **algo))
    sizes = {f"{r}_num_gpus_per_node": RANKS for r in ("policy", "ref", "critic")}
    dist = {**sizes, "colocate_policy_ref": True}
    four = _fit(_rl_cfg(tiny_model_path, tmp_path / "ray", prompts=6, dist=dist, **algo))

    assert four.placement == {
        "policy": (RANKS, "policy"),
        "reference": (RANKS, "policy"),  # rank i of the reference sits on the policy's bundle i
        "critic": (RANKS, "critic"),
        "pools": 2,  # policy + reference, critic (a task: reward is scored in the driver: no reward actor)
    }
    for k in ("train/policy_loss", "train/kl_loss", "rollout/kl", "critic/loss", "rollout/reward_mean"):
        assert k in local.result.history[0], k
    assert local.result.history[1]["rollout/kl"] != 0.0  # the reference differs from the trained policy
    _same_run(four, local)
    _same_weights(tmp_path / "ray/final", tmp_path / "local/final", tiny_model_path)


def _remove_placement_groups_since(before: set[str]) -> None:
    """Remove the placement groups created after the `before` snapshot and not removed yet."""
    import ray
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    for pg_id, info in placement_group_table().items():
        if pg_id not in before and info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))


@pytest.mark.timeout(60)
def test_colocate_all_places_on_a_two_cpu_cluster(ray_cluster):
    """13 actors on 2 CPUs (2/13 CPU each): each shared bundle asks only for the actors it hosts (the reward
    actor sits on bundle 0 alone), so the policy's placement group fits (it asked for 2.46 CPUs before)."""
    from ray.util.placement_group import placement_group_table

    sizes = {f"{r}_num_gpus_per_node": RANKS for r in ("policy", "ref", "critic")}
    cfg = DistConfig(mode="ray", num_cpus=2, gpus="no", colocate_all=True, timeout_s=5, **sizes)
    before = set(placement_group_table())
    try:
        launcher = RayLauncher(cfg, {"policy": RANKS, "reward": 1, "reference": RANKS, "critic": RANKS})
        assert launcher.where == dict.fromkeys(("policy", "reward", "reference", "critic"), "policy")
        cpus = [b["CPU"] for b in launcher.pools["policy"].pg.bundle_specs]
        assert cpus[0] == pytest.approx(4 * launcher.cpu_per_actor)  # policy, reference, critic, reward
        assert cpus[1:] == pytest.approx([3 * launcher.cpu_per_actor] * (RANKS - 1))
        launcher.shutdown()
    finally:
        _remove_placement_groups_since(before)


@pytest.mark.timeout(60)
def test_a_placement_that_cannot_fit_leaves_no_placement_group_behind(ray_cluster):
    """A GPU bundle on a cluster without GPUs: RoleError within timeout_s, naming what was asked, and the
    launcher removes the placement groups it created (a joined cluster stays up)."""
    import ray
    from ray.util.placement_group import placement_group_table

    before = set(placement_group_table())
    cfg = DistConfig(mode="ray", num_cpus=2, gpus="yes", timeout_s=3)
    with pytest.raises(RoleError, match=r"cannot place 1 bundle\(s\) for policy .*'GPU': 1\.0"):
        RayLauncher(cfg, {"policy": 1, "reward": 1})
    created = {k: v["state"] for k, v in placement_group_table().items() if k not in before}
    assert created and set(created.values()) == {"REMOVED"}, created
    assert ray.is_initialized()


@pytest.mark.timeout(240)
def test_sft_on_four_ranks_equals_one_rank_and_resumes_on_one(ray_cluster, tiny_model_path, tmp_path):
    from dp_fixtures import addition_rows, run_sft

    data = addition_rows(tmp_path / "train.jsonl")

    def sft(name: str, *extra: str) -> list[dict]:
        return run_sft(
            tiny_model_path, data, tmp_path / name, "--train.eval_every", "2", *extra, batch_size=10
        )

    one = sft("one")
    four = sft("four", "--dist.mode", "ray", "--dist.num_gpus_per_node", str(RANKS))
    assert [r["step"] for r in one] == [r["step"] for r in four]
    assert any("eval/loss" in r for r in one) and any("train/loss" in r for r in one)
    for a, b in zip(one, four, strict=True):
        _close(a, b, f"step {a['step']}")
    ckpt = tmp_path / "four/checkpoints/step_2"
    assert (ckpt / "model/dcp/.metadata").is_file() and (ckpt / "model/rng/rank_3.pt").is_file()
    _same_weights(tmp_path / "four/final", tmp_path / "one/checkpoints/step_4/model", tiny_model_path)

    resumed = sft("r41", "--ckpt.resume", str(ckpt))  # 4 DCP shards gathered into one process
    after = [r for r in one if r["step"] > 2]
    assert [r["step"] for r in resumed] == [r["step"] for r in after] and after
    for a, b in zip(after, resumed, strict=True):
        _close(a, b, f"resumed 4->1 step {a['step']}")


@pytest.mark.timeout(240)
def test_four_engine_actors_beside_two_policy_ranks_match_the_colocated_run(
    ray_cluster, tiny_model_path, tmp_path
):
    from transformers import AutoModelForCausalLM

    local = _fit(_rl_cfg(tiny_model_path, tmp_path / "local", prompts=6))
    dist = {"policy_num_gpus_per_node": 2, "num_engines": RANKS}
    cfg = _rl_cfg(tiny_model_path, tmp_path / "ray", prompts=6, dist=dist)
    engines = _fit(cfg, _engine_checksums)

    assert engines.placement["policy"] == (2, "policy") and engines.placement["engines"] == (RANKS, "engine")
    _same_run(engines, local)  # 6 prompts on 4 engines (1 or 2 each), concatenated back in order
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ray/final", dtype=torch.float32)
    final = float(sum(p.detach().double().abs().sum() for p in model.parameters()))
    # after the last step's broadcast every engine holds exactly the trained weights (fp32 on a CPU) ...
    assert len(engines.probes[2]) == RANKS and all(
        c == pytest.approx(final, rel=1e-12) for c in engines.probes[2]
    )
    # ... and after the first they held other ones: the broadcast reached them every step
    assert all(c != pytest.approx(final, rel=1e-9) for c in engines.probes[1])
    _same_weights(tmp_path / "ray/final", tmp_path / "local/final", tiny_model_path)
