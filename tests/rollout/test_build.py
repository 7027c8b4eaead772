"""The one engine factory (relayrl/rollout/build.py) and the capabilities engines declare (rollout/base.py):
what each registered class declares before it is built, which optional protocols it implements, how the
shared EngineSettings map to each engine's own options (raw keywords winning), and the errors for an unknown
name or an engine that cannot pause."""

from __future__ import annotations

import pytest

from relayrl.rollout.base import EngineCapabilities, EngineSettings, Pausable, WorkerLoading, paused
from relayrl.rollout.build import ENGINES, build_engine, engine_capabilities, engine_class
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.vllm_engine import VLLMEngine


def test_each_engine_declares_its_capabilities_before_it_is_built():
    assert engine_capabilities("native") == EngineCapabilities(fixed_slots=True, tensor_parallel=True)
    assert engine_capabilities("hf") == EngineCapabilities()
    assert engine_capabilities("vllm") == EngineCapabilities(
        own_weights=True, tensor_parallel=True, needs_gpu=True
    )
    assert [engine_class(n) for n in ENGINES] == [NativeEngine, HFEngine, VLLMEngine]


def test_pausing_and_worker_loading_are_declared_by_the_classes():
    for name in ENGINES:
        assert issubclass(engine_class(name), Pausable), name  # type: ignore[arg-type]
    assert issubclass(VLLMEngine, WorkerLoading)
    assert not issubclass(NativeEngine, WorkerLoading) and not issubclass(HFEngine, WorkerLoading)


def test_an_unknown_engine_is_refused_with_the_names():
    with pytest.raises(
        ValueError, match=r"unknown rollout engine 'fast'; choose one of \['hf', 'native', 'vllm'\]"
    ):
        engine_capabilities("fast")


def test_settings_map_to_each_engines_options():
    s = EngineSettings(
        max_seq_len=128, max_seqs=12, prefix_cache=False, dtype="bfloat16", placement="colocated"
    )
    assert NativeEngine.options(s) == {"max_seq_len": 128, "max_slots": 12, "prefix_cache": False}
    assert HFEngine.options(s) == {"max_seq_len": 128}  # hf batches up to its own max_batch rows
    unset = EngineSettings()
    assert NativeEngine.options(unset) == {} and HFEngine.options(unset) == {}  # the engines' own defaults


def test_the_factory_builds_from_settings_and_raw_options_win(tiny_model, tiny_tokenizer):
    engine = build_engine("native", tiny_model, tiny_tokenizer, EngineSettings(max_seq_len=64, max_seqs=3))
    try:
        assert isinstance(engine, NativeEngine)
        assert (engine.max_seq_len, engine.max_slots, engine.capabilities.fixed_slots) == (64, 3, True)
    finally:
        engine.close()
    engine = build_engine("native", tiny_model, tiny_tokenizer, EngineSettings(max_seqs=3), max_slots=5)
    try:
        assert isinstance(engine, NativeEngine) and engine.max_slots == 5
    finally:
        engine.close()


def test_paused_refuses_an_engine_without_pausing():
    class Plain:
        pass

    with pytest.raises(TypeError, match=r"Plain does not declare pausing .*load_weights\(named_tensors\)"):
        paused(Plain())  # type: ignore[arg-type]
