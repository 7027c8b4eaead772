"""relayrl.models.forward on CPU: both layouts equal a per-sequence forward (values and parameter gradients),
log-probs equal a plain log_softmax, micro-batch plans keep their budgets, no mask is built, and a model
switched to the varlen attention still generates and runs the native engine exactly as before."""

from __future__ import annotations

import copy
import logging
from itertools import pairwise

import pytest
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from relayrl.data.packing import LAYOUTS
from relayrl.models import forward as fw
from relayrl.models.tiny import TinyModelSpec, build_tiny_model

LENGTHS = [5, 17, 3, 40, 1, 12]
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _seqs(lengths=LENGTHS, vocab=90, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen) for n in lengths]


def _build(arch, tiny_tokenizer):
    if arch == "qwen2":
        return build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2))
    common = dict(
        vocab_size=len(tiny_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if arch == "llama":
            return LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))


@pytest.fixture(params=["qwen2", "llama", "qwen3"])
def model(request, tiny_tokenizer):
    return _build(request.param, tiny_tokenizer)


def _per_sequence_hidden(model, seqs):
    return torch.cat([model.model(input_ids=s[None], use_cache=False).last_hidden_state[0] for s in seqs])


def _value_and_grads(model, fn, seed=1):
    """fn() -> tensor; returns (value, {param name: grad of mean(value * fixed random weights)}).

    The mean keeps gradients O(1), so TOL is a relative bound (fp32 reordering gives ~1e-7 here)."""
    model.zero_grad(set_to_none=True)
    out = fn()
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) / out.numel()
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def _assert_same(got, want):
    (value, grads), (ref_value, ref_grads) = got, want
    torch.testing.assert_close(value, ref_value, **TOL)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hidden_and_gradients_equal_per_sequence(model, layout):
    seqs = _seqs()
    ref = _value_and_grads(model, lambda: _per_sequence_hidden(model, seqs))
    fw.prepare_model(model, layout)
    got = _value_and_grads(model, lambda: fw.forward_hidden(model, seqs, layout))
    assert got[0].shape == (sum(LENGTHS), 64)
    _assert_same(got, ref)


def _naive_logprobs(model, seqs, temperature):
    """log_softmax of a plain per-sequence CausalLM forward, aligned with the tokens (first token 0)."""
    logps, ents = [], []
    for s in seqs:
        ls = torch.log_softmax(model(input_ids=s[None], use_cache=False).logits[0].float() / temperature, -1)
        zero = ls.new_zeros(1)
        logps.append(torch.cat([zero, ls[:-1].gather(1, s[1:, None]).squeeze(1)]))
        ents.append(torch.cat([zero, -(ls.exp() * ls).sum(-1)[:-1]]))
    return torch.cat(logps), torch.cat(ents)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_log_softmax(tiny_model, layout, temperature):
    seqs = _seqs()
    fw.prepare_model(tiny_model, layout)
    logp, ent = fw.token_logprobs(tiny_model, seqs, layout, temperature=temperature, entropy=True)
    ref_logp, ref_ent = _naive_logprobs(tiny_model, seqs, temperature)
    assert logp.dtype == ent.dtype == torch.float32 and logp.shape == (sum(LENGTHS),)
    torch.testing.assert_close(logp, ref_logp, **TOL)
    torch.testing.assert_close(ent, ref_ent, **TOL)
    firsts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    assert (logp[firsts] == 0).all() and (ent[firsts] == 0).all()
    assert fw.token_logprobs(tiny_model, seqs, layout)[1] is None


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_logprobs_gradients_equal_naive(tiny_model, layout):
    seqs = _seqs()
    fw.prepare_model(tiny_model, layout)

    def loss(pair):
        logp, ent = pair
        return torch.stack([logp, 0.1 * ent])

    ref = _value_and_grads(tiny_model, lambda: loss(_naive_logprobs(tiny_model, seqs, 0.7)))
    got = _value_and_grads(
        tiny_model, lambda: loss(fw.token_logprobs(tiny_model, seqs, layout, temperature=0.7, entropy=True))
    )
    _assert_same(got, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_value_head_model(tiny_model_path, layout):
    from relayrl.config.components import ModelConfig
    from relayrl.models.value_head import build_value_model, padded_values

    critic = build_value_model(ModelConfig(name_or_path=str(tiny_model_path)), init="normal")
    seqs = _seqs()
    ref = torch.cat([padded_values(critic, s[None])[0] for s in seqs])
    fw.prepare_model(critic, layout)
    hidden = fw.forward_hidden(critic, seqs, layout)
    torch.testing.assert_close(critic.score(hidden).squeeze(-1), ref, **TOL)
    torch.testing.assert_close(fw.token_values(critic, seqs, layout), ref, **TOL)


def test_lora_model_switches_its_base_and_trains_adapters(tiny_model_path):
    from relayrl.config.components import LoraConfig, ModelConfig
    from relayrl.models.loading import load_causal_lm

    model = load_causal_lm(ModelConfig(name_or_path=str(tiny_model_path), lora=LoraConfig(rank=4)))
    seqs = _seqs()
    base = model.get_base_model()
    ref = _value_and_grads(model, lambda: _per_sequence_hidden(base, seqs))
    fw.prepare_model(model, "varlen")
    assert base.config._attn_implementation == fw.ATTN_NAME
    got = _value_and_grads(model, lambda: fw.forward_hidden(model, seqs, "varlen"))
    assert got[1] and all("lora_" in n for n in got[1])
    _assert_same(got, ref)


def _spy(monkeypatch, interface, name, record):
    original = interface._global_mapping[name]

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        record.append((args, kwargs, out))
        return out

    monkeypatch.setitem(interface._global_mapping, name, spy)


def test_padded_layout_builds_no_mask(tiny_model, monkeypatch):
    masks, calls = [], []
    _spy(monkeypatch, AttentionMaskInterface, "sdpa", masks)
    _spy(monkeypatch, AttentionInterface, "sdpa", calls)
    fw.prepare_model(tiny_model, "padded")
    fw.forward_hidden(tiny_model, _seqs(), "padded")
    assert masks and all(out is None for _, _, out in masks)  # sdpa's mask function skipped the mask
    assert len(calls) == 2 and all(args[4] is None for args, _, _ in calls)  # -> is_causal=True, no mask


def test_varlen_layout_passes_cu_seqlens_and_no_mask(tiny_model, monkeypatch):
    fw.prepare_model(tiny_model, "varlen")
    masks, calls = [], []
    _spy(monkeypatch, AttentionMaskInterface, fw.ATTN_NAME, masks)
    _spy(monkeypatch, AttentionInterface, fw.ATTN_NAME, calls)
    fw.forward_hidden(tiny_model, _seqs(), "varlen")
    assert masks and all(out is None for _, _, out in masks)
    assert len(calls) == 2
    for args, kwargs, _ in calls:
        query, mask = args[1], args[4]
        assert mask is None and query.shape[:3] == (1, 4, sum(LENGTHS))
        assert kwargs["cu_seq_lens_q"].tolist() == [0, 5, 22, 25, 65, 66, 78]
        assert kwargs["cu_seq_lens_q"].dtype == torch.int32 and kwargs["max_length_q"] == 40


def test_varlen_with_activation_checkpointing(tiny_model, monkeypatch):
    # the backward recomputes each layer outside forward_hidden: the captured cu_seqlens must still be used
    from relayrl.models.loading import checkpointing_enabled

    seqs = _seqs()
    ref = _value_and_grads(tiny_model, lambda: _per_sequence_hidden(tiny_model, seqs))
    if hasattr(tiny_model, "activation_checkpointing_enable"):  # transformers 5.24; 5.17 has the old name
        tiny_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        tiny_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tiny_model.train()
    assert checkpointing_enabled(tiny_model)
    fw.prepare_model(tiny_model, "varlen")
    calls = []
    _spy(monkeypatch, AttentionInterface, fw.ATTN_NAME, calls)
    got = _value_and_grads(tiny_model, lambda: fw.forward_hidden(tiny_model, seqs, "varlen"))
    _assert_same(got, ref)
    assert len(calls) == 4 and all("cu_seq_lens_q" in kw and a[4] is None for a, kw, _ in calls)


def _fake_kernels(calls):
    """Stand-ins for torch's varlen_attn (CPU math) with the signatures of torch 2.13, torch 2.11 and an
    older one (is_causal, no scale): each records its call and returns causal attention per sequence."""

    def reference(q, k, v, cu, scale, enable_gqa=False):
        if enable_gqa:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        bounds = cu.tolist()
        outs = [
            torch.nn.functional.scaled_dot_product_attention(
                *(x[s:e].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=scale
            ).transpose(0, 1)
            for s, e in pairwise(bounds)
        ]
        return torch.cat(outs)

    def record(q, k, cu_q, max_q, max_k, **kw):
        calls.append({"shapes": (q.shape, k.shape), "cu": cu_q, "max": (max_q, max_k), **kw})

    def torch_2_13(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1), enable_gqa=False):  # fmt: skip
        record(q, k, cu_q, max_q, max_k, scale=scale, window=window_size, gqa=enable_gqa)
        assert window_size == (-1, 0) and isinstance(window_size, tuple)  # causal
        return reference(q, k, v, cu_q, scale, enable_gqa)

    def torch_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        record(q, k, cu_q, max_q, max_k, scale=scale, window=window_size)
        assert window_size == (-1, 0) and isinstance(window_size, tuple)
        return reference(q, k, v, cu_q, scale)

    def is_causal_no_scale(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False):
        record(q, k, cu_q, max_q, max_k, is_causal=is_causal)
        assert is_causal
        return reference(q, k, v, cu_q, None)  # sdpa's default scale 1/sqrt(D), as flash's

    return {"torch-2.13": torch_2_13, "torch-2.11": torch_2_11, "is_causal-no-scale": is_causal_no_scale}


@pytest.mark.parametrize("variant", ["torch-2.13", "torch-2.11", "is_causal-no-scale"])
def test_kernel_call_adapts_to_the_varlen_signature(tiny_model, monkeypatch, variant):
    calls = []
    monkeypatch.setattr(fw, "_varlen_attn", _fake_kernels(calls)[variant])
    monkeypatch.setattr(fw, "_kernel_usable", lambda q: True)
    fw._kernel_params.cache_clear()
    try:
        seqs = _seqs()
        ref = _value_and_grads(tiny_model, lambda: _per_sequence_hidden(tiny_model, seqs))
        fw.prepare_model(tiny_model, "varlen")
        got = _value_and_grads(tiny_model, lambda: fw.forward_hidden(tiny_model, seqs, "varlen"))
    finally:
        fw._kernel_params.cache_clear()
    _assert_same(got, ref)
    n, kv_heads = sum(LENGTHS), 2 if variant == "torch-2.13" else 4  # else K/V expanded to the 4 query heads
    assert len(calls) == 2
    for call in calls:
        assert call["shapes"] == ((n, 4, 16), (n, kv_heads, 16))
        assert call["cu"].dtype == torch.int32 and call["max"] == (40, 40)
        assert call.get("gqa", False) is (variant == "torch-2.13")
        assert call.get("scale", 16**-0.5) == 16**-0.5


def test_switched_model_generates_and_runs_native_engine_as_before(tiny_model, tiny_tokenizer):
    from relayrl.rollout.native_model import DecoderRunner

    sdpa_model = copy.deepcopy(tiny_model).eval()
    varlen_model = fw.prepare_model(tiny_model, "varlen").eval()
    batch = tiny_tokenizer(["hello there", "hi"], return_tensors="pt", padding=True)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tiny_tokenizer.pad_token_id}
    with torch.no_grad():
        want = sdpa_model.generate(**batch, **kwargs)
        got = varlen_model.generate(**batch, **kwargs)
        torch.testing.assert_close(varlen_model(**batch).logits, sdpa_model(**batch).logits, rtol=0, atol=0)
    assert torch.equal(got, want)

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    last = torch.tensor([3, 1])
    outs = []
    for m in (sdpa_model, varlen_model):
        runner = DecoderRunner(m, max_len=16)
        caches = [torch.zeros(runner.cache_shape(2)) for _ in range(2)]
        with torch.no_grad():
            outs.append(runner.prefill(ids, last, *caches, torch.arange(2), torch.arange(2)))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


def test_choose_layout_and_log_once(tiny_model, monkeypatch, caplog):
    monkeypatch.setattr(fw, "_logged", set())
    with caplog.at_level(logging.INFO, logger="relayrl.models.forward"):
        assert fw.choose_layout(tiny_model, "cpu") == "padded"
        assert fw.choose_layout(tiny_model, torch.device("cpu")) == "padded"
    assert [r.getMessage() for r in caplog.records] == [
        "attention layout: padded (length-bucketed, causal, no mask): cpu device"
    ]
    # the decision on a CUDA device, without needing one: torch 2.13 has varlen_attn
    assert fw.choose_layout(tiny_model, "cuda") == "varlen"
    monkeypatch.setattr(fw, "_varlen_attn", None)
    assert fw.choose_layout(tiny_model, "cuda") == "padded"


def test_sliding_window_models_stay_padded(tiny_tokenizer):
    from transformers import Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
        max_window_layers=0,
    )  # fmt: skip
    model = Qwen2ForCausalLM(cfg)
    assert fw.choose_layout(model, "cuda") == "padded"
    with pytest.raises(ValueError, match="sliding-window attention"):
        fw.prepare_model(model, "varlen")


def test_split_flat_and_to_padded():
    lengths = [2, 3, 1]
    flat = torch.arange(1.0, 7.0, requires_grad=True)
    assert [t.tolist() for t in fw.split_flat(flat, lengths)] == [[1, 2], [3, 4, 5], [6]]
    padded = fw.to_padded(flat, lengths, 4)
    assert padded.tolist() == [[1, 2, 0, 0], [3, 4, 5, 0], [6, 0, 0, 0]]
    padded.sum().backward()
    assert flat.grad.tolist() == [1.0] * 6
    assert fw.to_padded(torch.ones(6, 2), lengths, 3).shape == (3, 3, 2)
    with pytest.raises(ValueError, match="width 2 is shorter"):
        fw.to_padded(flat, lengths, 2)
    with pytest.raises(ValueError, match="lengths sum to 7"):
        fw.split_flat(flat, [4, 3])


def test_errors_teach(tiny_model):
    seqs = _seqs()
    with pytest.raises(ValueError, match=r"prepare_model\(model, 'varlen'\)"):
        fw.forward_hidden(tiny_model, seqs, "varlen")
    with pytest.raises(ValueError, match="layout must be one of"):
        fw.forward_hidden(tiny_model, seqs, "packed")
    with pytest.raises(ValueError, match="sequence 1 must be a non-empty 1-D"):
        fw.forward_hidden(tiny_model, [seqs[0], seqs[0][:0]], "padded")
    with pytest.raises(ValueError, match="at least one sequence"):
        fw.forward_hidden(tiny_model, [], "padded")
