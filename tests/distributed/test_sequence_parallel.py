"""Sequence parallelism (dist.sp_size; relayrl.models.sequence_parallel) over REAL gloo process groups
(spawned CPU ranks, no Ray): SP=2 on 2 ranks, and DP=2 x SP=2 on 4 (slow), against the plain one-process
path (the padded layout, no group) on the same tiny Qwen2 (4 query heads, 1 KV head: repeated under SP).

Checked, all fp32: the SFT loss, its unit count, the gradient norm (FSDP averages over every rank; the step
must sum inside an SP group: a missing / doubled SP factor moves it by 2x), the weights after one SGD step
(lr 0.5, so the update is visible), policy log-probs and entropy at temperature 0.7 and critic values.
Tolerance rtol 1e-5 / atol 1e-6 (the ranks run the same fp32 arithmetic per token; only the order of a few
sums differs: FSDP's gradient reduce and the per-sequence vs padded attention batches). The micro-batches
have odd token totals, so the padding of a packed row to the SP size is exercised, as is the label that
crosses a shard boundary (every token's log-prob is compared).
"""

from __future__ import annotations

import pytest
import torch
from sp_fixtures import sp_run, spawn_sp

from relayrl.config.base import ConfigError
from relayrl.config.dist import DistConfig
from relayrl.models import sequence_parallel

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def reference():
    return sp_run(0, 1, 1, None)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _same_as_reference(out, ref):
    assert out["layout"] == "varlen" and ref["layout"] == "padded"
    for k in ("loss", "count", "grad_norm"):
        _close(torch.tensor(out[k]), torch.tensor(ref[k]), k)
    for k in ("logprobs", "entropy", "values"):
        _close(out[k], ref[k], k)
    assert out["weights"].keys() == ref["weights"].keys()
    for name, w in out["weights"].items():
        _close(w, ref["weights"][name], name)


@pytest.mark.slow  # 2 spawned processes (~3 s on 2 cores)
def test_two_ranks_sp2_equal_one_process(reference, tmp_path):
    ranks = spawn_sp(2, 2, tmp_path)
    for out in ranks:
        _same_as_reference(out, reference)


@pytest.mark.slow  # 4 spawned processes (~3-7 s on 2 cores)
def test_four_ranks_dp2_sp2_equal_one_process(reference, tmp_path):
    ranks = spawn_sp(4, 2, tmp_path)
    for out in ranks:
        _same_as_reference(out, reference)


def test_kv_heads_are_repeated_to_split_over_the_group():
    kv = torch.arange(2.0).reshape(1, 2, 1, 1)  # heads 0, 1
    assert sequence_parallel.expand_kv(kv, 4).flatten().tolist() == [0, 0, 1, 1]
    assert sequence_parallel.expand_kv(kv, 2) is kv


def test_heads_must_split_over_the_group():
    with pytest.raises(ValueError, match=r"dist.sp_size=4 must divide the model's attention heads \(14"):
        sequence_parallel.check_heads(14, 2, 4)


def test_sp_size_must_divide_the_ranks_and_needs_ray_mode():
    DistConfig(mode="ray", num_gpus_per_node=4, sp_size=2).check_command("model")
    with pytest.raises(ConfigError, match=r"dist.sp_size: 2 does not divide the model's 3 ranks"):
        DistConfig(mode="ray", num_gpus_per_node=3, sp_size=2).check_command("model")
    with pytest.raises(ConfigError, match=r"dist.sp_size: 4 does not divide the policy's 2 ranks"):
        DistConfig(mode="ray", policy_num_gpus_per_node=2, sp_size=4).check_command("rl")
    with pytest.raises(ConfigError, match="sp_size: 2 is invalid; expected 1 in local mode"):
        DistConfig(sp_size=2)
    with pytest.raises(ConfigError, match="sp_size: 0 is invalid"):
        DistConfig(sp_size=0)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sft_command_with_sp2_on_two_ray_ranks_equals_one_process(tiny_model_path, tmp_path):
    """`relayrl sft --dist.mode ray --dist.num_gpus_per_node 2 --dist.sp_size 2` (one data-parallel group:
    both ranks train every micro-batch, half of its tokens each) == one process, step by step (the wiring:
    the driver builds varlen micro-batches, both ranks take the same share, the loss counted once)."""
    import ray
    from dp_fixtures import addition_rows, assert_metrics_close, run_sft

    data = addition_rows(tmp_path / "train.jsonl")
    one = run_sft(tiny_model_path, data, tmp_path / "one", batch_size=8)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        sp = ("--dist.mode", "ray", "--dist.num_gpus_per_node", "2", "--dist.sp_size", "2")
        two = run_sft(tiny_model_path, data, tmp_path / "two", *sp, batch_size=8)
    finally:
        ray.shutdown()
    assert len(one) == len(two) == 4
    for a, b in zip(one, two, strict=True):
        assert_metrics_close(a, b, f"step {a['step']}")


def test_rl_checks_sp_size_against_the_roles_it_builds(tiny_model_path, tmp_path):
    from dataclasses import replace

    from relayrl.config.presets import tiny_cpu_config
    from relayrl.trainers.rl.validate import validate_rl

    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path), steps=1)
    cfg = replace(cfg, algo=replace(cfg.algo, advantage="gae"))
    dist = replace(cfg.dist, mode="ray", policy_num_gpus_per_node=2, critic_num_gpus_per_node=2, sp_size=2)
    validate_rl(replace(cfg, dist=dist))
    with pytest.raises(ConfigError, match=r"dist.sp_size: 2 does not divide the critic role's 1 ranks"):
        validate_rl(replace(cfg, dist=replace(dist, critic_num_gpus_per_node=1)))
