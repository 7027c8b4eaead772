"""GPU checks of the data-parallel path (skipped without CUDA; the 2-GPU ones without 2 GPUs; Ray must be
installed): NCCL ranks give the same RL steps as one GPU, the colocated engine's sleep frees its KV cache and
wake restores it.

Tolerance of the 2-GPU vs 1-GPU comparison: the model runs in fp32 (model.dtype fp32) so both paths compute the
same math; only the summation order differs (partial gradients reduce-scattered over NCCL, cuBLAS picking
other kernels for other shapes), which keeps metrics within ~1e-5 relative; rtol 1e-3 leaves room for TF32-free
fp32 GEMM differences and still fails on any lost share or wrong denominator (> 1e-2 effects).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer, run_rl
from relayrl.workers.policy import PolicyWorker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
DATA = Path(__file__).parents[1] / "trainers" / "data"
VOLATILE = ("timing/", "perf/")


def _cfg(model: Path, out: Path, gpus: int, dtype: str):
    cfg = tiny_cpu_config(str(model), str(out), steps=2, reward=str(DATA / "digit_reward.py"))
    dist = replace(cfg.dist, mode="local")
    if gpus > 1:
        dist = replace(
            cfg.dist, mode="ray", num_cpus=8, gpus="yes", policy_num_gpus_per_node=gpus, timeout_s=300
        )
    return replace(
        cfg,
        model=replace(cfg.model, dtype=dtype),
        train=replace(cfg.train, device="cuda"),
        algo=replace(cfg.algo, kl_mode="loss", kl_coef=0.1),
        dist=replace(dist, ref_num_gpus_per_node=gpus, colocate_policy_ref=gpus > 1),
    )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_equal_one_gpu(tiny_model_path, tmp_path):
    pytest.importorskip("ray")
    one = run_rl(_cfg(tiny_model_path, tmp_path / "one", 1, "fp32"))
    trainer = RLTrainer(_cfg(tiny_model_path, tmp_path / "two", 2, "fp32"))
    canary: list[float] = []
    two = trainer.fit(
        on_step=lambda s, m: canary.append(trainer.roles.policy.call(PolicyWorker.weight_canary))
    )
    assert one.exit_code == two.exit_code == 0, two.message
    assert canary == [0.0, 0.0]
    for a, b in zip(one.history, two.history, strict=True):
        for k in sorted(k for k in a if not k.startswith(VOLATILE)):
            assert math.isclose(a[k], b[k], rel_tol=1e-3, abs_tol=1e-5), f"{k}: {a[k]} vs {b[k]}"
    # bf16 compute on 2 GPUs: runs, and the engines hold exactly the gathered bf16 weights
    trainer = RLTrainer(_cfg(tiny_model_path, tmp_path / "bf16", 2, "bf16"))
    canary.clear()
    res = trainer.fit(
        on_step=lambda s, m: canary.append(trainer.roles.policy.call(PolicyWorker.weight_canary))
    )
    assert res.exit_code == 0, res.message
    assert canary == [0.0, 0.0]
    assert all(h["perf/peak_mem_gib"] > 0 for h in res.history)


def test_engine_sleep_frees_and_wake_restores_memory(tiny_model_path):
    from transformers import AutoModelForCausalLM

    from relayrl.models.tiny import build_tiny_tokenizer
    from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all

    tok = build_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).cuda()
    engine = build_engine("native", model, tok, max_slots=64, max_seq_len=512)
    reqs = [GenerationRequest(prompt_ids=[5, 6, 7], params=SamplingParams(n=4, max_new_tokens=32, seed=3))]
    first = [c.token_ids for c in generate_all(engine, reqs)[0].completions]
    kv_bytes = 2 * engine.state.k_cache.numel() * engine.state.k_cache.element_size()
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    engine.sleep()
    torch.cuda.synchronize()
    asleep = torch.cuda.memory_allocated()
    engine.wake_up()
    torch.cuda.synchronize()
    woke = torch.cuda.memory_allocated()
    again = [c.token_ids for c in generate_all(engine, reqs)[0].completions]
    engine.close()
    assert kv_bytes > 0 and awake - asleep >= kv_bytes  # the KV cache (and graph pools) freed
    assert woke >= awake - 1024 * 1024  # and allocated again
    assert again == first
