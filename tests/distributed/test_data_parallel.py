"""Data parallelism end to end on a real local Ray cluster (gloo, CPU ranks): RL and SFT on 2 FSDP2 ranks give
the same per-step metrics as 1 rank on the same global batch, and checkpoints resume across rank counts.

Tolerance: rtol 1e-4, atol 1e-5. The ranks compute the same sums in a different order (each rank's partial
gradient, then a reduce-scatter), so fp32 results differ by rounding (~1e-7 relative per operation); after
two Adam steps the observed worst relative difference of a metric of size > 1e-3 is ~1e-6. Metrics that are
themselves ~1e-8 (log-prob differences between engine and trainer) are covered by atol. A bug in the global
denominators, a missing gradient reduction or a rank's share lost would move the loss by > 1e-2.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from dp_fixtures import assert_metrics_close as _close
from dp_fixtures import one_and_two_ranks
from dp_fixtures import rl_cfg as _rl_cfg

from relayrl.config.presets import tiny_cpu_config
from relayrl.distributed.launch import rows
from relayrl.trainers.rl.loop import RLTrainer, run_rl
from relayrl.workers.policy import PolicyWorker

pytestmark = pytest.mark.slow  # multi-rank runs compared with one rank

DATA = Path(__file__).parents[1] / "trainers" / "data"


@pytest.mark.timeout(400)
def test_rl_two_ranks_equal_one_rank_and_resume_across_rank_counts(
    ray_cluster, tiny_model_path, tmp_path, monkeypatch
):
    """Policy, reference and critic each on 2 ranks (every role sharded, the engines generating halves of the
    prompts) == everything on 1 rank; the engines' weights equal the gathered trained weights after every
    step; a 2-rank checkpoint resumes on 1 rank and a 1-rank checkpoint on 2 ranks, continuing exactly. The
    driver stores the 32 rows of a step in blocks of 3 (at most 11 objects), so ranks read shares that start
    and end inside blocks."""
    monkeypatch.setattr(rows, "MAX_BLOCKS", 11)
    monkeypatch.setattr(rows, "MIN_BLOCK_BYTES", 0)  # the step's few KB would be one block
    one, two, info, canaries = one_and_two_ranks(
        _rl_cfg(tiny_model_path, tmp_path / "one", 1), _rl_cfg(tiny_model_path, tmp_path / "two", 2)
    )
    assert one.exit_code == two.exit_code == 0, two.message
    assert info["ranks"] == 2 and info["engine_weights"] == "gathered"
    assert canaries == [0.0, 0.0]
    assert len(one.history) == len(two.history) == 2
    for i, (a, b) in enumerate(zip(one.history, two.history, strict=True)):
        _close(a, b, f"step {i + 1}")
    assert "critic/loss" in one.history[0] and "train/kl_loss" in one.history[0]
    # the sharded checkpoint: DCP shards + per-rank RNG, no full weights
    ckpt2 = tmp_path / "two/checkpoints/step_1"
    assert (ckpt2 / "policy/dcp/.metadata").is_file() and (ckpt2 / "critic/dcp/.metadata").is_file()
    assert (ckpt2 / "policy/rng/rank_1.pt").is_file()
    assert (tmp_path / "two/final/model.safetensors").is_file()  # the HF export of the gathered model

    two_to_one = run_rl(_rl_cfg(tiny_model_path, tmp_path / "r21", 1, resume=str(ckpt2)))
    one_to_two = run_rl(
        _rl_cfg(tiny_model_path, tmp_path / "r12", 2, resume=str(tmp_path / "one/checkpoints/step_1"))
    )
    for name, r in (("2->1", two_to_one), ("1->2", one_to_two)):
        assert r.exit_code == 0, r.message
        assert r.steps == 2 and len(r.history) == 1, name
        _close(one.history[1], r.history[0], f"resumed {name}")


@pytest.mark.timeout(300)
def test_sft_two_ranks_equal_one_rank_and_resume_across_rank_counts(ray_cluster, tiny_model_path, tmp_path):
    """`relayrl sft --dist.mode ray --dist.num_gpus_per_node 2` == one process, per step; resumes 2->1 and
    2->2 continue the uninterrupted run; final/ is the trained model in HF format."""
    import torch
    from dp_fixtures import addition_rows, run_sft
    from transformers import AutoModelForCausalLM

    data = addition_rows(tmp_path / "train.jsonl")

    def sft(name: str, *extra: str) -> list[dict]:
        return run_sft(tiny_model_path, data, tmp_path / name, *extra, batch_size=8)

    ray2 = ("--dist.mode", "ray", "--dist.num_gpus_per_node", "2")
    one, two = sft("one"), sft("two", *ray2)
    for a, b in zip(one, two, strict=True):
        _close(a, b, f"step {a['step']}")
    ckpt = str(tmp_path / "two/checkpoints/step_2")
    for name, extra in (("r21", ()), ("r22", ray2)):
        resumed = sft(name, "--ckpt.resume", ckpt, *extra)
        assert [r["step"] for r in resumed] == [3, 4]
        for a, b in zip(one[2:], resumed, strict=True):
            _close(a, b, f"{name} step {a['step']}")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "two/final")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "one/checkpoints/step_4/model")
    worst = max((p - q).abs().max().item() for p, q in zip(final.parameters(), ref.parameters(), strict=True))
    assert worst < 1e-4, worst
    assert not torch.equal(
        final.model.embed_tokens.weight,
        AutoModelForCausalLM.from_pretrained(tiny_model_path).model.embed_tokens.weight,
    )


@pytest.mark.timeout(300)
def test_rl_two_ranks_with_one_tensor_parallel_engine_equal_one_rank(ray_cluster, tiny_model_path, tmp_path):
    """GRPO, the policy on 2 FSDP2 ranks running ONE colocated native engine with TP = 2 (dist.engine_tp 2:
    each rank holds half of the engine's weights, rank 0 generates every prompt, rank 1 follows) == 1 rank
    with a whole engine: the same sampled tokens (fp32, TP only reorders sums), metrics within the tolerance
    above, and after every step both shards hold exactly the trained weights (canary 0)."""

    def cfg(ranks: int, out: str):
        base = tiny_cpu_config(
            str(tiny_model_path), str(tmp_path / out), steps=2, reward=str(DATA / "digit_reward.py")
        )
        mode = "ray" if ranks > 1 else "local"
        dist = replace(base.dist, mode=mode, policy_num_gpus_per_node=ranks, engine_tp=ranks, timeout_s=120)
        return replace(base, dist=dist)

    samples: dict[str, list] = {"one": [], "tp": []}
    one_trainer = RLTrainer(cfg(1, "one"))
    one = one_trainer.fit(
        on_step=lambda s, m: samples["one"].append([t.token_ids for t in one_trainer._last_trajs])
    )
    trainer = RLTrainer(cfg(2, "tp"))
    info = trainer.roles.policy.call(PolicyWorker.info)
    canaries: list[float] = []

    def on_step(step: int, m: dict) -> None:
        samples["tp"].append([t.token_ids for t in trainer._last_trajs])
        canaries.append(trainer.roles.policy.call(PolicyWorker.weight_canary))

    two = trainer.fit(on_step=on_step)
    assert one.exit_code == two.exit_code == 0, two.message
    assert info["ranks"] == 2 and info["engine_weights"] == "tensor-parallel"
    assert canaries == [0.0, 0.0]
    assert samples["tp"] == samples["one"] and len(samples["one"][0]) > 0
    for i, (a, b) in enumerate(zip(one.history, two.history, strict=True)):
        _close(a, b, f"step {i + 1}")
