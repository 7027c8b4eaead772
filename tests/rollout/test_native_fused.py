"""Fused q/k/v and gate/up projections (relayrl/rollout/native_fused.py): the same logits as the separate
projections (fp32, atol 1e-5: one GEMM over the concatenated rows may block its sums differently), only
weights that do not train are fused, and a weight refresh through LocalWeights reaches the fused buffers
(the canary and the engine's samples follow the trained weights)."""

from __future__ import annotations

import copy

import torch

from relayrl.distributed.weights.local import LocalWeights
from relayrl.models.tiny import TinyModelSpec, build_tiny_model
from relayrl.rollout.base import GenerationRequest, SamplingParams, generate_all
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.native_fused import fuse_projections, gate_up_weight, qkv_weights
from relayrl.rollout.native_model import DecoderRunner


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    model.requires_grad_(False)
    return model


def _logits(runner: DecoderRunner) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[5, 9, 13, 17], [7, 8, 0, 0]])
    shape = runner.cache_shape(2)
    k, v = torch.zeros(shape), torch.zeros(shape)
    rows = torch.arange(2)
    pre = runner.prefill(ids, torch.tensor([3, 1]), k, v, rows, rows)
    dec = runner.decode(torch.tensor([3, 4]), torch.tensor([4, 2]), k, v, 16, rows)
    return pre, dec


def test_fused_projections_compute_what_separate_ones_do(tiny_model):
    with torch.no_grad():
        plain = DecoderRunner(_frozen(tiny_model), 32, fuse=False)
        fused = DecoderRunner(_frozen(tiny_model), 32)
        assert plain.fused_layers == 0 and fused.fused_layers == 2
        for got, want in zip(_logits(fused), _logits(plain), strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_fusion_rebinds_parameters_as_views_and_skips_trained_weights(tiny_model):
    assert fuse_projections(tiny_model) == 0  # requires_grad: a trained module is never re-laid out
    partly = _frozen(tiny_model)
    partly.lm_head.weight.requires_grad_(True)  # e.g. a LoRA model: its frozen base is not fused either
    assert fuse_projections(partly) == 0 and gate_up_weight(partly.model.layers[0].mlp) is None
    model = _frozen(tiny_model)
    names = [n for n, _ in model.named_parameters()]
    assert fuse_projections(model) == 2
    assert [n for n, _ in model.named_parameters()] == names  # HF names kept
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    weight, bias, sizes = qkv_weights(attn)
    assert sizes == (64, 32, 32) and bias is not None
    want = torch.cat(
        [tiny_model.model.layers[0].self_attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    )
    assert torch.equal(weight, want)
    attn.k_proj.weight.data.fill_(3.0)  # writing a parameter writes the fused buffer
    assert bool((weight[64:96] == 3.0).all())
    mlp.up_proj.weight.data.zero_()
    inter = mlp.up_proj.weight.shape[0]
    gate_up = gate_up_weight(mlp)
    assert gate_up.shape[0] == 2 * inter and bool((gate_up[inter:] == 0).all())
    assert torch.equal(gate_up[:inter], tiny_model.model.layers[0].mlp.gate_proj.weight)


def test_a_refresh_reaches_the_fused_buffers(tiny_tokenizer):
    policy = build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=64, layers=2, seed=1))
    lw = LocalWeights(policy, dtype=torch.float32, own_copy=True)
    engine = NativeEngine(lw.model, max_slots=4, max_seq_len=48)
    assert engine.runner.fused_layers == 2
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert lw.max_abs_diff() > 0
    lw.load_into(engine, version=1)
    assert lw.max_abs_diff() == 0.0
    reqs = [GenerationRequest(prompt_ids=[5, 6, 7], params=SamplingParams(temperature=0, max_new_tokens=10))]
    got = generate_all(engine, reqs)[0].completions[0]
    engine.close()
    ref = NativeEngine(copy.deepcopy(policy), max_slots=4, max_seq_len=48)  # unfused, the trained weights
    want = generate_all(ref, reqs)[0].completions[0]
    ref.close()
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
