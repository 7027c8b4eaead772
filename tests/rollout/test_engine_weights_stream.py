"""EngineWeights(stream=True): the weights an engine that holds its own copy (vllm) is sent after each step,
and the CPU-side checks of the vllm adapter (no vllm package needed).

- streamed: no copy is made (the engine's `model` is the source module, refresh costs 0, the canary is 0 by
  definition); `engine_tensors()` names every parameter as `named_parameters()` does (the tied lm_head once,
  as the embedding), holds exactly the source cast to the engine dtype, and follows in-place changes of the
  source (it is read at each call, never cached); tensors already in the engine dtype are not copied.
- LoRA: the adapters are merged (W + scale * B @ A) under the base model's HF names, bitwise equal to peft's
  own `merge_and_unload` in fp32; DoRA and LoRA + sharding are refused with an error naming the fix.
- sharded (gather): on a 1-rank gloo group with FSDP2, the full tensors equal the unsharded weights.
- vllm adapter: the version check, the chunking of `load_weights`, and clear errors without the package or
  with a module instead of a folder.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from relayrl.config.components import LoraConfig, ModelConfig
from relayrl.config.rl import EvalConfig, RolloutConfig
from relayrl.distributed.weights import EngineWeights
from relayrl.models.tiny import TinyModelSpec, build_tiny_model
from relayrl.rollout.vllm_engine import SUPPORTED_VLLM, VLLMEngine, check_vllm_version, named_chunks


def _step(model: torch.nn.Module) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def test_streamed_weights_are_every_parameter_cast_and_current(tiny_model):
    model = tiny_model
    ew = EngineWeights(model, dtype=torch.bfloat16, stream=True)
    assert ew.model is model and ew.kind == "streamed" and not ew.shared
    assert ew.refresh() == 0.0 and ew.max_abs_diff() == 0.0
    first = list(ew.engine_tensors())
    names = [n for n, _ in model.named_parameters()]
    assert [n for n, _ in first] == names and "lm_head.weight" not in names  # tied: given once
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = dict(model.named_parameters())
    for name, t in first:
        assert t.dtype == torch.bfloat16 and not t.requires_grad
        assert torch.equal(t, params[name].detach().to(torch.bfloat16)), name
    _step(model)  # in place: the next stream follows the source
    second = dict(ew.engine_tensors())
    moved = [n for n, t in first if not torch.equal(t, second[n])]
    assert len(moved) == len(names)
    for name, t in second.items():
        assert torch.equal(t, params[name].detach().to(torch.bfloat16)), name


def test_streamed_weights_in_the_source_dtype_are_not_copied(tiny_model):
    ew = EngineWeights(tiny_model, dtype=torch.float32, stream=True)
    params = dict(tiny_model.named_parameters())
    for name, t in ew.engine_tensors():
        assert t.data_ptr() == params[name].data_ptr(), name


def test_not_streamed_gives_none(tiny_model):
    assert EngineWeights(tiny_model, dtype=torch.float32).engine_tensors() is None
    assert EngineWeights(tiny_model, dtype=torch.bfloat16).kind == "copy"


def _lora_model(tiny_tokenizer):
    from relayrl.models.loading import apply_lora

    torch.manual_seed(0)
    model = apply_lora(build_tiny_model(tiny_tokenizer, TinyModelSpec(seed=0)), LoraConfig(rank=4))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)  # B = 0 at init would make the merge a no-op
    return model


def test_lora_adapters_are_merged_like_peft(tiny_tokenizer):
    model = _lora_model(tiny_tokenizer)
    ew = EngineWeights(model, dtype=torch.float32, stream=True)
    got = dict(ew.engine_tensors())
    want = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    assert list(got) == list(want)  # HF names: no base_model.model., no .base_layer, no lora_*
    assert "model.layers.0.self_attn.q_proj.weight" in got
    for name, t in want.items():
        assert torch.equal(got[name], t.detach()), name
    base = model.get_base_model().model.layers[0].self_attn.q_proj
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"], base.base_layer.weight)
    assert torch.equal(got["model.layers.0.self_attn.q_proj.bias"], base.base_layer.bias)


def test_lora_merge_follows_training(tiny_tokenizer):
    model = _lora_model(tiny_tokenizer)
    ew = EngineWeights(model, dtype=torch.float32, stream=True)
    _step(model)  # only the adapters train
    want = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    for name, t in ew.engine_tensors():
        assert torch.equal(t, want[name].detach()), name


def test_unsupported_streams_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"lora.rank > 0 .* sharded .* merge-lora"):
        EngineWeights(_lora_model(tiny_tokenizer), dtype=torch.float32, stream=True, gather=True)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    dora = get_peft_model(
        build_tiny_model(tiny_tokenizer, TinyModelSpec(seed=0)),
        PeftLoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
    )
    with pytest.raises(ValueError, match="DoRA"):
        EngineWeights(dora, dtype=torch.float32, stream=True)


def test_gathered_stream_gives_full_tensors_of_a_sharded_model(tiny_tokenizer, tmp_path):
    import torch.distributed as dist

    from relayrl.distributed.fsdp import ShardSpec, is_sharded, shard_model

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = build_tiny_model(tiny_tokenizer, TinyModelSpec(seed=0))
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        ew = EngineWeights(model, dtype=torch.bfloat16, gather=True, stream=True)  # before sharding
        shard_model(model, ShardSpec(device=torch.device("cpu")))
        assert is_sharded(model)
        got = list(ew.engine_tensors())
        assert [n for n, _ in got] == list(want)
        for name, t in got:
            assert not hasattr(t, "device_mesh") and t.dtype == torch.bfloat16
            assert torch.equal(t, want[name].to(torch.bfloat16)), name
    finally:
        dist.destroy_process_group()


# ---- the vllm adapter without the vllm package --------------------------------------------------------


def test_vllm_version_check():
    assert SUPPORTED_VLLM == "0.26"
    for ok in ("0.26", "0.26.0", "0.26.1", "0.26.0rc1", "0.26.1.dev3+gffd46bf"):
        check_vllm_version(ok)
    for bad in ("0.25.1", "0.27.0", "0.260.0", "1.26.0", "0.2"):
        with pytest.raises(RuntimeError, match=rf"vllm {bad} is installed.*RELAYRL_VLLM_ANY_VERSION=1") as e:
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
    from relayrl.workers.builders import build_engine_for

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
