"""bench/peers/trl_grpo.py's TRL configuration: `--generation vllm` is the model.generate configuration with
every vLLM-colocated setting of bench/peers/trl_vllm.py on top, and ignore-EOS spelled as vLLM's SamplingParams
name. Skipped when TRL is not installed (it is a benchmark-only dependency)."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

if importlib.util.find_spec("trl") is None:  # not imported here: collection stays cheap
    pytest.skip("needs TRL (pip install -e '.[bench]')", allow_module_level=True)

PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers"
sys.path.insert(0, str(PEERS))

import trl_grpo  # noqa: E402
from trl_vllm import VLLM_COLOCATE  # noqa: E402


def test_vllm_variant_is_the_generate_config_plus_the_colocated_settings(tmp_path):
    w = replace(trl_grpo.WORKLOADS["cpu-tiny"], ignore_eos=True)  # a CPU workload: the config builds here
    plain = trl_grpo.trl_config(w, str(tmp_path / "a"), 3, "generate")
    vllm = trl_grpo.trl_config(w, str(tmp_path / "b"), 3, "vllm")
    assert plain.use_vllm is False
    for field, (value, why) in VLLM_COLOCATE.items():
        assert getattr(vllm, field) == value and why
    assert vllm.vllm_mode == "colocate" and vllm.vllm_enable_sleep_mode is False
    assert plain.generation_kwargs == {"min_new_tokens": w.new_tokens}  # model.generate's name
    assert vllm.generation_kwargs == {"min_tokens": w.new_tokens}  # vLLM SamplingParams' name
    skip = {"generation_kwargs", "output_dir", "logging_dir", "distributed_state", *VLLM_COLOCATE}
    differ = {k for k, v in vars(plain).items() if k not in skip and vars(vllm)[k] != v}
    assert differ == set()  # nothing else changes between the two variants
