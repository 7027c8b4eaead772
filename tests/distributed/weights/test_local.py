"""LocalWeights (the local transport): the engine's weights track the trainer's (the weight canary).

- shared: same dtype -> the engine runs on the trainer's own module (nothing to copy).
- copy (mixed precision): after an optimizer step the engine is stale until `refresh`, then equals the
  trainer's weights cast to its dtype exactly (canary 0), with LoRA adapters too; storage addresses of the
  engine's parameters never move (CUDA graphs captured over them stay valid); buffers keep their dtype.
- load_into: the refresh and the engine's load_weights run while the engine's rounds are paused, the version
  reaches the engine, and an engine that cannot pause is refused.
- streamed (an engine that holds its own copy, vllm): no copy is made (the engine's `model` is the source
  module, refresh costs 0, the canary is 0 by definition); `engine_tensors()` names every parameter as
  `named_parameters()` does (the tied lm_head once, as the embedding), holds exactly the source cast to the
  engine dtype, and follows in-place changes of the source (it is read at each call, never cached); tensors
  already in the engine dtype are not copied.
- LoRA: the adapters are merged (W + scale * B @ A) under the base model's HF names, bitwise equal to peft's
  own `merge_and_unload` in fp32; DoRA and LoRA + sharding are refused with an error naming the fix.
- sharded (gather): on a 1-rank gloo group with FSDP2, the full tensors equal the unsharded weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.config.components import LoraConfig
from relayrl.distributed.weights.local import LocalWeights
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer


def _step(model: torch.nn.Module) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(4, 60, (2, 9))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def test_shared_when_dtypes_match():
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0))
    ew = LocalWeights(model, dtype=torch.float32)
    assert ew.shared and ew.model is model and ew.refresh() == 0.0 and ew.max_abs_diff() == 0.0


def test_copy_refresh_canary():
    torch.manual_seed(0)
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0))
    ew = LocalWeights(model, dtype=torch.bfloat16)
    assert not ew.shared and ew.model is not model
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in ew.model.parameters())
    inv = [b for n, b in ew.model.named_buffers() if "inv_freq" in n]
    assert inv and all(b.dtype == torch.float32 for b in inv)  # rotary stays fp32
    assert ew.max_abs_diff() == 0.0
    ptrs = [p.data_ptr() for p in ew.model.parameters()]
    _step(model)
    assert ew.max_abs_diff() > 0  # stale: the canary sees it
    ew.refresh()
    assert ew.max_abs_diff() == 0.0
    for (name, p), q in zip(model.named_parameters(), ew.model.parameters(), strict=True):
        assert torch.equal(q, p.detach().to(torch.bfloat16)), name
    assert [p.data_ptr() for p in ew.model.parameters()] == ptrs


def test_copy_refresh_with_lora():
    from relayrl.config.components import LoraConfig
    from relayrl.models.loading import apply_lora

    torch.manual_seed(0)
    model = apply_lora(build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0)), LoraConfig(rank=4))
    ew = LocalWeights(model, dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)  # so the adapters change the outputs
    _step(model)
    assert ew.max_abs_diff() > 0
    ew.refresh()
    assert ew.max_abs_diff() == 0.0
    lora = [n for n, _ in ew.model.named_parameters() if "lora_" in n]
    assert lora  # the adapters are part of the engine copy


class _Engine:
    """Records whether the engine-side copy was already refreshed, and paused, at each load_weights."""

    def __init__(self, lw: LocalWeights, source: torch.nn.Module) -> None:
        self.lw, self.source, self.inside, self.events = lw, source, False, []

    def paused(self):
        import contextlib

        @contextlib.contextmanager
        def block():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

        return block()

    def load_weights(self, named_tensors=None, *, version=None):
        self.events.append(("load", named_tensors, version, self.inside, self.lw.max_abs_diff()))


def test_load_into_refreshes_and_loads_while_the_engine_is_paused():
    torch.manual_seed(0)
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0))
    lw = LocalWeights(model, dtype=torch.bfloat16)
    engine = _Engine(lw, model)
    _step(model)
    assert lw.max_abs_diff() > 0
    seconds = lw.load_into(engine, 4, before_load=lambda: engine.events.append(("wake", engine.inside)))  # type: ignore[arg-type]
    assert seconds >= 0
    assert engine.events == [("wake", True), ("load", None, 4, True, 0.0)]  # refreshed before, all paused


def test_load_into_refuses_an_engine_that_cannot_pause():
    class NoPause:
        def load_weights(self, named_tensors=None, *, version=None):
            raise AssertionError("not reached")

    lw = LocalWeights(build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0)), dtype=torch.float32)
    with pytest.raises(TypeError, match=r"NoPause does not declare pausing"):
        lw.load_into(NoPause(), 1)  # type: ignore[arg-type]


# ---- streamed ------------------------------------------------------------------------------------------


def _seeded_step(model: torch.nn.Module) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def test_streamed_weights_are_every_parameter_cast_and_current(tiny_model):
    model = tiny_model
    ew = LocalWeights(model, dtype=torch.bfloat16, stream=True)
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
    _seeded_step(model)  # in place: the next stream follows the source
    second = dict(ew.engine_tensors())
    moved = [n for n, t in first if not torch.equal(t, second[n])]
    assert len(moved) == len(names)
    for name, t in second.items():
        assert torch.equal(t, params[name].detach().to(torch.bfloat16)), name


def test_streamed_weights_in_the_source_dtype_are_not_copied(tiny_model):
    ew = LocalWeights(tiny_model, dtype=torch.float32, stream=True)
    params = dict(tiny_model.named_parameters())
    for name, t in ew.engine_tensors():
        assert t.data_ptr() == params[name].data_ptr(), name


def test_not_streamed_gives_none(tiny_model):
    assert LocalWeights(tiny_model, dtype=torch.float32).engine_tensors() is None
    assert LocalWeights(tiny_model, dtype=torch.bfloat16).kind == "copy"


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
    ew = LocalWeights(model, dtype=torch.float32, stream=True)
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
    ew = LocalWeights(model, dtype=torch.float32, stream=True)
    _seeded_step(model)  # only the adapters train
    want = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    for name, t in ew.engine_tensors():
        assert torch.equal(t, want[name].detach()), name


def test_unsupported_streams_are_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"lora.rank > 0 .* sharded .* merge-lora"):
        LocalWeights(_lora_model(tiny_tokenizer), dtype=torch.float32, stream=True, gather=True)
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    dora = get_peft_model(
        build_tiny_model(tiny_tokenizer, TinyModelSpec(seed=0)),
        PeftLoraConfig(r=4, target_modules=["q_proj"], use_dora=True),
    )
    with pytest.raises(ValueError, match="DoRA"):
        LocalWeights(dora, dtype=torch.float32, stream=True)


def test_gathered_stream_gives_full_tensors_of_a_sharded_model(tiny_tokenizer, tmp_path):
    import torch.distributed as dist

    from relayrl.distributed.fsdp import ShardSpec, is_sharded, shard_model

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = build_tiny_model(tiny_tokenizer, TinyModelSpec(seed=0))
        want = {n: p.detach().clone() for n, p in model.named_parameters()}
        ew = LocalWeights(model, dtype=torch.bfloat16, gather=True, stream=True)  # before sharding
        shard_model(model, ShardSpec(device=torch.device("cpu")))
        assert is_sharded(model)
        got = list(ew.engine_tensors())
        assert [n for n, _ in got] == list(want)
        for name, t in got:
            assert not hasattr(t, "device_mesh") and t.dtype == torch.bfloat16
            assert torch.equal(t, want[name].to(torch.bfloat16)), name
    finally:
        dist.destroy_process_group()


def test_a_meta_source_gives_zeros_then_the_weights_initialised_after_sharding():
    """A policy built on the meta device and materialised later (FSDP2 meta init, bench/tp_grpo.py): the
    engine copy starts as zeros with real rotary tables (the same as a real model's), and the first refresh
    brings the initialised weights (canary 0) and an engine over it samples what one over the source does."""
    real = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0))
    with torch.device("meta"):
        source = type(real)(real.config)
    ew = LocalWeights(source, dtype=torch.float32, own_copy=True, device=torch.device("cpu"))
    assert all(p.device.type == "cpu" and not p.any() for p in ew.model.parameters())
    want = dict(real.named_buffers())
    for name, b in ew.model.named_buffers():
        assert torch.equal(b, want[name]), name
    source.to_empty(device="cpu")
    source.load_state_dict(real.state_dict())
    source.model.rotary_emb = copy.deepcopy(real.model.rotary_emb)
    ew.refresh()
    assert ew.max_abs_diff() == 0.0
    ids = torch.tensor([[5, 9, 13, 17]])
    with torch.no_grad():
        assert torch.equal(ew.model(input_ids=ids).logits, real(input_ids=ids).logits)
