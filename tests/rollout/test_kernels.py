"""The native engine's fused decode kernels (relayrl/rollout/kernels.py) against their torch references.

On a CPU the Triton kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 when no GPU
is present; skipped when triton is not installed). Tolerances: fp32 1e-6 absolute for values of order 1
(exp / rsqrt and the attention's summation order; the rotary and K/V writes are exact); fp16 bit-exact for
RMSNorm, SiLU x up and rotary (each rounding step is the torch code's), and 1 fp16 ulp at |x| <= 1 (1e-3) for
attention, whose probabilities are rounded to fp16 before the PV product as flash attention does. (Triton's
interpreter mishandles bf16, so bf16 is checked on the GPU: the `gpu` test at the end, 1 bf16 ulp.) The
engine with the kernels samples what it samples without them (fp32, greedy and seeded top-p, log-probs
within 1e-5).
"""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout import kernels as K
from relayrl.rollout.base import EngineSettings, GenerationRequest, SamplingParams, generate_all
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.native_model import DecoderRunner

needs_kernels = pytest.mark.skipif(
    not K.usable(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
    reason="triton not installed (or no GPU and TRITON_INTERPRET unset)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CPU_DTYPES = [(torch.float32, 1e-6), (torch.float16, 0.0)]


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@needs_kernels
@pytest.mark.parametrize(("dtype", "tol"), CPU_DTYPES)
def test_rms_norm_matches_torch(dtype, tol):
    g = _gen()
    x, r = (torch.randn(6, 96, generator=g).to(DEV, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(DEV, dtype)
    out, res = K.rms_norm(x, w, 1e-6, residual=r)
    ref, ref_res = K.rms_norm_ref(x, w, 1e-6, residual=r)
    assert torch.equal(res, ref_res)  # the residual sum is rounded exactly as torch's
    assert (out.float() - ref.float()).abs().max().item() <= tol
    out, res = K.rms_norm(x, w, 1e-6)
    assert res is x or torch.equal(res, x)
    assert (out.float() - K.rms_norm_ref(x, w, 1e-6)[0].float()).abs().max().item() <= tol


@needs_kernels
@pytest.mark.parametrize(("dtype", "tol"), CPU_DTYPES)
def test_silu_mul_reads_the_fused_gate_up_output(dtype, tol):
    gu = (3 * torch.randn(2, 3, 2 * 40, generator=_gen(1))).to(DEV, dtype)
    gate, up = gu[..., :40], gu[..., 40:]  # column slices of one tensor, as the fused GEMM returns
    out = K.silu_mul(gate, up)
    assert out.shape == gate.shape
    assert (out.float() - K.silu_mul_ref(gate, up).float()).abs().max().item() <= tol


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_kv_write_matches_torch_exactly(dtype):
    g = _gen(2)
    bs, heads, kv, d, max_len = 3, 4, 2, 16, 40
    qkv = torch.randn(bs, (heads + 2 * kv) * d, generator=g).to(DEV, dtype)
    q, k, v = qkv.split([heads * d, kv * d, kv * d], -1)  # strided views, as the fused q/k/v GEMM gives
    q, k, v = q.view(bs, heads, d), k.view(bs, kv, d), v.view(bs, kv, d)
    cos, sin = (torch.randn(max_len, d, generator=g).to(DEV, dtype) for _ in range(2))
    pos = torch.tensor([0, 7, max_len - 1], device=DEV)
    caches = [torch.randn(5, kv, max_len, d, generator=g).to(DEV, dtype) for _ in range(2)]
    mine = [c.clone() for c in caches]
    q_out = K.rope_kv_write(q, k, v, cos, sin, pos, *mine)
    q_ref = K.rope_kv_write_ref(q, k, v, cos, sin, pos, *caches)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])  # written at pos, nothing else


@needs_kernels
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_attention_reads_each_slots_own_length(dtype, tol, splits):
    g = _gen(3)
    bs, heads, kv, d, max_len = 4, 6, 2, 16, 200
    q = torch.randn(bs, heads, d, generator=g).to(DEV, dtype)
    k_cache, v_cache = (torch.randn(6, kv, max_len, d, generator=g).to(DEV, dtype) for _ in range(2))
    pos = torch.tensor([0, 63, 64, 150], device=DEV)  # one key, a block edge, just past it, a long one
    out = K.decode_attention(q, k_cache, v_cache, pos, 0.25, kv_len=192, splits=splits)
    ref = K.decode_attention_ref(q, k_cache, v_cache, pos, 0.25, kv_len=192)
    assert (out.float() - ref.float()).abs().max().item() <= tol
    k_cache[:bs, :, 151:] = float("nan")  # positions past every slot's length are never read
    out2 = K.decode_attention(q, k_cache, v_cache, pos, 0.25, kv_len=192, splits=splits)
    assert torch.equal(out, out2)


def test_switch_reaches_the_runner(lively_model):
    assert not DecoderRunner(lively_model, 64).kernels  # the runner's default: off
    assert not DecoderRunner(lively_model, 64, kernels=None).kernels  # auto: CUDA only
    assert NativeEngine.options(EngineSettings(fused_kernels=False)) == {
        "exact": False,
        "fused_kernels": False,
    }
    assert NativeEngine.options(EngineSettings()) == {}


@needs_kernels
def test_engine_samples_the_same_with_and_without_kernels(lively_model, tiny_tokenizer, prompts):
    model = lively_model.to(DEV)
    reqs = [
        GenerationRequest(prompt_ids=prompts[0], params=SamplingParams(temperature=0, max_new_tokens=6)),
        GenerationRequest(
            prompt_ids=prompts[3], params=SamplingParams(n=2, top_p=0.9, max_new_tokens=6, seed=3)
        ),
    ]
    results = []
    for kernels in (False, True):
        engine = NativeEngine(model, tiny_tokenizer, max_slots=3, max_seq_len=32, fused_kernels=kernels)
        assert engine.runner.kernels is kernels
        results.append(generate_all(engine, reqs))
        engine.close()
    for off, on in zip(*results, strict=True):
        for a, b in zip(off.completions, on.completions, strict=True):
            assert a.token_ids == b.token_ids and len(a.token_ids) > 0
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5


@pytest.mark.gpu
@needs_kernels
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_kernels_on_the_gpu():
    """bf16 at the 7B decode shapes: within 1 bf16 ulp of torch (2^-7 relative) elementwise, attention
    within 2e-2 absolute of the fp32 reference (bf16 inputs and probabilities)."""
    g = _gen(4)
    bs, heads, kv, d, max_len, hidden = 64, 28, 4, 128, 384, 3584

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    x, r, w = rand(bs, hidden), rand(bs, hidden), 1 + 0.1 * rand(hidden)
    out, res = K.rms_norm(x, w, 1e-6, residual=r)
    ref, ref_res = K.rms_norm_ref(x, w, 1e-6, residual=r)
    assert torch.equal(res, ref_res)
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
    gu = 3 * rand(bs, 2 * 1024)
    out, ref = K.silu_mul(gu[:, :1024], gu[:, 1024:]), K.silu_mul_ref(gu[:, :1024], gu[:, 1024:])
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
    q, k, v = rand(bs, heads, d), rand(bs, kv, d), rand(bs, kv, d)
    cos, sin, pos = rand(max_len, d), rand(max_len, d), torch.randint(0, max_len, (bs,), device="cuda")
    caches = [rand(bs, kv, max_len, d) for _ in range(2)]
    mine = [c.clone() for c in caches]
    assert torch.equal(
        K.rope_kv_write(q, k, v, cos, sin, pos, *mine), K.rope_kv_write_ref(q, k, v, cos, sin, pos, *caches)
    )
    assert torch.equal(mine[0], caches[0]) and torch.equal(mine[1], caches[1])
    for splits in (1, 4):
        out = K.decode_attention(q, *caches, pos, d**-0.5, max_len, splits=splits)
        ref = K.decode_attention_ref(q, *caches, pos, d**-0.5, max_len)
        assert (out.float() - ref.float()).abs().max().item() <= 2e-2
