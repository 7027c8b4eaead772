"""The vllm adapter's CPU-side checks (no vllm package needed): the version check, the chunking of
`load_weights`, the EngineArgs the factory derives from its settings (the one GPU-memory-share decision:
placement defaults, an explicit share (rollout.vllm_gpu_util); seed, prefix caching, RNG kept, sleep mode or tp
worker processes beside a trainer; the user's EngineArgs last), and clear errors without the package or with
a module instead of a folder."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from relayrl.config.components import ModelConfig
from relayrl.config.rl import EvalConfig, RolloutConfig
from relayrl.rollout.base import EngineSettings
from relayrl.rollout.vllm_engine import VLLMEngine, named_chunks
from relayrl.rollout.vllm_setup import (
    SUPPORTED_VLLM,
    VLLM_GPU_UTIL,
    VLLM_SEPARATE_GPU_UTIL,
    check_vllm_version,
    engine_options,
    gpu_share,
    keeping_global_rng,
)
from relayrl.workers.builders import build_engine_for


def test_vllm_version_check():
    assert SUPPORTED_VLLM == "0.26"
    for ok in ("0.26", "0.26.0", "0.26.1", "0.26.0rc1", "0.26.1.dev3+gffd46bf"):
        check_vllm_version(ok)
    for bad in ("0.25.1", "0.27.0", "0.260.0", "1.26.0", "0.2"):
        with pytest.raises(
            RuntimeError, match=rf"vllm {bad} is installed.*--rollout.vllm_any_version true"
        ) as e:
            check_vllm_version(bad)
        assert "0.26" in str(e.value)


def test_load_chunks_are_bounded_and_strip_module_prefix():
    named = [(f"module.w{i}", torch.zeros(i + 1, dtype=torch.float32)) for i in range(6)]  # 4..24 bytes
    chunks = list(named_chunks(iter(named), max_bytes=16))
    assert [[n for n, _ in c] for c in chunks] == [["w0", "w1", "w2"], ["w3"], ["w4"], ["w5"]]
    assert all(a is b for c, part in zip(chunks, [named[:3], named[3:4], named[4:5], named[5:]], strict=True)
               for (_, a), (_, b) in zip(c, part, strict=True))  # fmt: skip
    assert list(named_chunks(iter([]), max_bytes=16)) == []


def test_vllm_engine_wants_a_folder(tiny_model):
    with pytest.raises(TypeError, match=r"name_or_path.*save_pretrained"):
        VLLMEngine(tiny_model)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_build_engine_for_vllm_without_the_package(tiny_model, tiny_tokenizer, tiny_model_path):
    rollout, evaluation = RolloutConfig(engine="vllm"), EvalConfig()
    with pytest.raises(ImportError, match=r"needs the vllm package \(pip install"):
        build_engine_for(
            rollout,
            evaluation,
            tiny_model,
            tiny_tokenizer,
            source=ModelConfig(name_or_path=str(tiny_model_path)),
        )
    with pytest.raises(ValueError, match="source="):
        build_engine_for(rollout, evaluation, tiny_model, tiny_tokenizer)


# ---- the EngineArgs the factory derives (vllm_setup.engine_options) ----------------------------------------


def test_the_gpu_share_is_decided_in_one_place(monkeypatch):
    assert (gpu_share("alone"), gpu_share("colocated"), gpu_share("separate")) == (None, 0.35, 0.85)
    assert (VLLM_GPU_UTIL, VLLM_SEPARATE_GPU_UTIL) == (0.35, 0.85)
    for placement in ("alone", "colocated", "separate"):  # --rollout.vllm_gpu_util wins everywhere
        assert gpu_share(placement, explicit=0.6) == 0.6
    monkeypatch.setenv("RELAYRL_VLLM_GPU_UTIL", "0.6")  # a config field now, not the environment
    assert gpu_share("colocated") == 0.35
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 1.5: .* in \(0, 1\)"):
        gpu_share("separate", explicit=1.5)


def test_alone_leaves_vllms_defaults():
    assert engine_options(EngineSettings(max_seq_len=512)) == {"max_seq_len": 512}
    assert engine_options(EngineSettings()) == {}
    assert engine_options(EngineSettings(gpu_util=0.2)) == {"gpu_memory_utilization": 0.2}
    assert engine_options(EngineSettings(any_version=True)) == {"any_version": True}


def test_beside_a_trainer():
    common = dict(max_seq_len=256, max_seqs=32, dtype="bfloat16", trust_remote_code=True)
    colocated = engine_options(EngineSettings(placement="colocated", **common))
    assert colocated == {
        "max_seq_len": 256,
        "gpu_memory_utilization": 0.35,
        "dtype": "bfloat16",
        "max_num_seqs": 32,
        "seed": 0,
        "enable_prefix_caching": True,
        "trust_remote_code": True,
        "keep_rng": True,
        "enable_sleep_mode": True,
    }
    separate = engine_options(
        EngineSettings(placement="separate", tp=2, engine_args={"enforce_eager": True}, **common)
    )
    assert separate["gpu_memory_utilization"] == 0.85 and separate["enforce_eager"] is True
    assert (separate["tensor_parallel_size"], separate["distributed_executor_backend"]) == (2, "mp")
    assert "enable_sleep_mode" not in separate
    user = engine_options(
        EngineSettings(placement="colocated", engine_args={"seed": 3, "gpu_memory_utilization": 0.5})
    )
    assert (user["seed"], user["gpu_memory_utilization"]) == (3, 0.5)  # the user's EngineArgs win


def test_the_rl_builder_asks_the_factory_for_what_it_always_passed(monkeypatch, tiny_tokenizer):
    """build_engine_for(vllm) reaches VLLMEngine with the policy's folder and exactly the arguments the old
    build_vllm_engine gave it (the constructor is replaced: vllm is not needed)."""
    seen: dict = {}

    def fake_init(self, model, tokenizer=None, **kwargs):
        seen.update(model=model, tokenizer=tokenizer, **kwargs)

    monkeypatch.setattr(VLLMEngine, "__init__", fake_init)
    rollout = RolloutConfig(engine="vllm", prompts_per_step=2, n_samples=4, max_len=128)
    source = ModelConfig(name_or_path="/models/policy")
    build_engine_for(rollout, EvalConfig(n_samples=9), None, tiny_tokenizer, source=source)
    assert seen == {
        "model": "/models/policy",
        "tokenizer": tiny_tokenizer,
        "max_seq_len": 128,
        "gpu_memory_utilization": 0.35,
        "dtype": "bfloat16",
        "max_num_seqs": 9,  # max(prompts x samples, eval samples)
        "seed": 0,
        "enable_prefix_caching": True,
        "trust_remote_code": False,
        "keep_rng": True,
        "enable_sleep_mode": True,
    }
    seen.clear()
    build_engine_for(rollout, EvalConfig(), None, tiny_tokenizer, source=source, tp=2)
    assert (seen["gpu_memory_utilization"], seen["tensor_parallel_size"], seen["max_num_seqs"]) == (
        0.85,
        2,
        8,
    )
    seen.clear()
    knobs = replace(rollout, vllm_gpu_util=0.6, vllm_any_version=True)
    build_engine_for(knobs, EvalConfig(), None, tiny_tokenizer, source=source)
    assert (seen["gpu_memory_utilization"], seen["any_version"]) == (0.6, True)
    with pytest.raises(ValueError, match=r"engine_device='cuda:1'.*leave engine_device empty"):
        build_engine_for(
            RolloutConfig(engine="vllm", engine_device="cuda:1"),
            EvalConfig(),
            None,
            tiny_tokenizer,
            source=source,
        )


def test_keep_rng_restores_every_global_stream():
    import random

    import numpy as np

    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    want = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with keeping_global_rng():
        random.seed(0), np.random.seed(0), torch.manual_seed(0)  # what vLLM's start-up does
        random.random(), np.random.rand(), torch.rand(1)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == want
