"""The fused mixture-of-experts decode kernels (relayrl/rollout/moe_kernels.py) against the torch path.

On a CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; skipped without triton).
Tolerances: fp32 1e-5 absolute for outputs of order 1-10 (only the GEMMs' summation order differs); fp16 within
2 fp16 ulps of the output (each of the kernel's roundings is the torch path's, on GEMM results that may differ
in their last bit); routing weights 1e-6 (softmax's exp and sum order), expert ids equal.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from relayrl.rollout import GenerationRequest, SamplingParams, generate_all
from relayrl.rollout import moe_kernels as MK
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.native_moe import MoEForward, RouterSpec, experts_forward, select_experts
from tests.helpers.moe_models import lively_moe

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not MK.usable(torch.device(DEV)), reason="triton not installed (or TRITON_INTERPRET unset)"
    ),
]
SMALL = {  # tiles smaller than the shapes: several column blocks, K steps and pair-id chunks per program
    "gate_up": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1),
    "down": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=1, num_stages=1),
    "scan": dict(CHUNK=16),
}


def _reference(x, idx, weights, gate_up, down):
    """One (token, slot) at a time in x's dtype: each GEMM's output rounded, SiLU rounded, then the product;
    the weighted sum over k in fp32 (native_moe's rounding sequence)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate, up = F.linear(x[t : t + 1], gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down[e])
            out[t] += weights[t, j] * y[0].float()
    return out.to(x.dtype)


def _case(n, hidden, inter, experts, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).to(dtype)
    gate_up = (0.3 * torch.randn(experts, 2 * inter, hidden, generator=g)).to(dtype)
    down = (0.3 * torch.randn(experts, hidden, inter, generator=g)).to(dtype)
    spec = RouterSpec(top_k=top_k, num_experts=experts, normalize=True)
    weights, idx = select_experts(torch.randn(n, experts, generator=g), spec)
    return x, idx, weights, gate_up, down


def _check(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    else:  # 2 ulps of each output: 2^-9 of the binade's top for fp16
        ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2**-14))) - 10)
        assert ((out.float() - ref.float()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small-tiles"])
def test_fused_experts_match_the_torch_path(dtype, config):
    """Uneven sizes (hidden 40, width 24: masked tiles), an expert twice in one token's row (a replayed route
    can do that), 20 pairs on one expert (two chunks of BLOCK_M = 16; with SMALL spread over 3 scans of 16
    pair ids), experts without tokens (0, 1, 2)."""
    x, idx, weights, gate_up, down = _case(21, 40, 24, 8, 2, dtype)
    idx[0] = torch.tensor([5, 5])  # repeated expert
    idx[1:, 0] = 3
    idx[1:, 1] = 4 + torch.arange(20) % 4
    out = MK.fused_experts(x.to(DEV), idx.to(DEV), weights.to(DEV), gate_up.to(DEV), down.to(DEV), config)
    _check(out.cpu(), _reference(x, idx, weights, gate_up, down), dtype)
    if (
        config is None
    ):  # 34 pairs on 2 experts: 17 a expert on average, so BLOCK_M 32 (moe_kernels._rows_per_tile)
        busy = idx[1:18] % 2  # of experts 3 and 4 (gate_up[3:5]) only
        out = MK.fused_experts(x[1:18].to(DEV), busy.to(DEV), weights[1:18].to(DEV), gate_up[3:5].to(DEV),
                               down[3:5].to(DEV))  # fmt: skip
        _check(out.cpu(), _reference(x[1:18], busy, weights[1:18], gate_up[3:5], down[3:5]), dtype)
    few = torch.tensor([[1, 2], [2, 1], [1, 7]])  # experts 0, 3, 4, 5, 6 hold no token
    out = MK.fused_experts(x[:3].to(DEV), few.to(DEV), weights[:3].to(DEV), gate_up.to(DEV), down.to(DEV))
    _check(out.cpu(), _reference(x[:3], few, weights[:3], gate_up, down), dtype)


@pytest.mark.parametrize(("experts", "top_k", "normalize"), [(8, 2, True), (20, 3, False), (128, 8, True)])
def test_select_experts_kernel_matches_torch(experts, top_k, normalize):
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(9, experts, generator=g)
    spec = RouterSpec(top_k=top_k, num_experts=experts, normalize=normalize)
    ref_w, ref_i = select_experts(logits, spec)
    w, i = MK.select_experts(logits.to(DEV), top_k, normalize)
    assert torch.equal(i.cpu(), ref_i) and i.dtype == torch.long
    torch.testing.assert_close(w.cpu(), ref_w, atol=1e-6, rtol=0)
    tied = torch.zeros(1, experts)  # all equal: the lowest ids, each 1 / E (1 / k renormalised)
    w, i = MK.select_experts(tied.to(DEV), top_k, normalize)
    assert i.cpu().tolist() == [list(range(top_k))]
    torch.testing.assert_close(w.cpu(), torch.full((1, top_k), 1 / top_k if normalize else 1 / experts))


def test_moe_forward_takes_the_kernels_only_when_switched_on():
    block = lively_moe("qwen3").model.layers[0].mlp
    spec = RouterSpec(top_k=2, num_experts=8, normalize=True)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    on, off = MoEForward(block, spec, kernels=True), MoEForward(block, spec)
    assert on.kernels and not off.kernels
    with torch.no_grad():
        a, b = on(x), off(x)
    assert on.last_idx is not None and off.last_idx is not None
    assert torch.equal(on.last_idx, off.last_idx)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=2e-6)  # outputs up to ~30: a few fp32 ulps
    block.experts.act_fn = torch.nn.GELU()  # the kernels hard-code SiLU: another activation keeps torch
    assert not MoEForward(block, spec, kernels=True).kernels


def test_moe_engine_samples_the_same_with_and_without_kernels(tiny_tokenizer, prompts):
    """fp32: the same tokens (greedy and seeded sampling), log-probs within 1e-5, the same recorded routes."""
    model = lively_moe("qwen3")
    reqs = [
        GenerationRequest(prompt_ids=prompts[0], params=SamplingParams(temperature=0, max_new_tokens=4)),
        GenerationRequest(
            prompt_ids=prompts[1], params=SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
        ),
    ]
    results = []
    for kernels in (False, True):
        engine = NativeEngine(
            model, tiny_tokenizer, max_slots=2, max_seq_len=32, fused_kernels=kernels, record_routes=True
        )
        moe = [engine.runner.mlps[li] for li in engine.runner.moe_layers]
        assert all(isinstance(f, MoEForward) and f.kernels is kernels for f in moe)
        results.append(generate_all(engine, reqs))
        engine.close()
    for off, on in zip(*results, strict=True):
        a, b = off.completions[0], on.completions[0]
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
        assert a.routes is not None and b.routes is not None and torch.equal(a.routes, b.routes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_fused_experts_at_the_qwen3_30b_a3b_shape():
    """bf16, 64 tokens x top-8 of 128 experts (hidden 2048, width 768): the routes equal torch's and the output
    is within 1% (relative L2) of the torch path's; the only differences are GEMM summation orders moving a
    bf16 rounding of the intermediate products."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device="cuda")).to(torch.bfloat16)

    x, gate_up, down = rand(64, 2048), rand(128, 2 * 768, 2048, scale=0.04), rand(128, 2048, 768, scale=0.04)
    logits = torch.randn(64, 128, generator=g, device="cuda")
    w, i = MK.select_experts(logits, 8, True)
    ref_w, ref_i = select_experts(logits, RouterSpec(top_k=8, num_experts=128, normalize=True))
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=0)
    out = MK.fused_experts(x, i, w, gate_up, down).float()
    experts = types.SimpleNamespace(gate_up_proj=gate_up, down_proj=down, act_fn=F.silu)
    ref = experts_forward(x, i, w, experts).float()  # the grouped-GEMM torch path
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-2
