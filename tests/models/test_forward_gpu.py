"""relayrl.models.forward on CUDA: the varlen layout (torch varlen_attn, flash) equals the per-sequence forward.

Tolerances. Flash kernels compute in bf16, so a bf16 result cannot match a float32 one to 1e-4. Every bf16
check therefore compares two bf16 computations against the same float32 truth (the per-sequence forward of
the float32 model, no autocast) and requires the varlen error to be no worse than that of the path used
before it (per-sequence sdpa under the same precision) times 1.5, plus 1e-3 relative for kernels whose
rounding order differs (flash varlen vs sdpa's flash / memory-efficient kernel). A real layout bug (a token
attending across sequences, wrong positions, a wrong GQA head map) gives errors of order 1, hundreds of times
larger. The float32 model without autocast runs the exact per-sequence fallback (flash has no float32): it
must equal the reference to 1e-4 relative.

Measured 2026-11-26 on an H200, torch 2.11.0+cu130 (varlen_attn without enable_gqa: K/V expanded),
transformers 5.17: relative errors vs float32 truth, varlen = per-sequence sdpa in every case (hidden
4.7e-3 / 6.2e-3 for autocast / bf16 model, logits 4.8e-3 / 5.7e-3), parameter gradients 5.1e-3 vs 5.9e-3
(autocast) and 6.1e-3 vs 6.8e-3 (bf16 model); the attention alone 2.9e-3 (out) and 4.1e-3 (q/k/v grads).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from relayrl.models import forward as fw
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(fw._varlen_attn is None, reason="torch has no torch.nn.attention.varlen"),
]

LENGTHS = [7, 33, 1, 64, 18, 120, 2]
SLACK, FLOOR = 1.5, 1e-3


@pytest.fixture()
def model():
    """fp32 Qwen2 with GQA (4 query heads, 2 KV heads, head dim 32) on CUDA."""
    spec = TinyModelSpec(hidden=128, layers=2, heads=4, kv_heads=2, seed=0)
    return build_tiny_model(build_tiny_tokenizer(), spec).cuda()


@pytest.fixture()
def kernel_calls(monkeypatch):
    """Count the calls that reach torch's varlen_attn (proves the flash kernel ran, not the fallback)."""
    calls = []
    real = fw._varlen_attn

    @functools.wraps(real)  # keeps the signature, which decides how GQA is passed
    def counting(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(fw, "_varlen_attn", counting)
    fw._kernel_params.cache_clear()
    yield calls
    fw._kernel_params.cache_clear()


def _seqs(vocab=90):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab, (n,), generator=gen).cuda() for n in LENGTHS]


def _per_sequence(model, seqs):
    return torch.cat([model.model(input_ids=s[None], use_cache=False).last_hidden_state[0] for s in seqs])


def _outputs(model, fn, seqs, autocast=False):
    """(hidden [N, H] fp32, logp [N], one flat vector of all parameter gradients) of fn(model, seqs)."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        hidden = fn(model, seqs)
        head = model.get_output_embeddings()
        logits = torch.nn.functional.linear(hidden, head.weight).float()
    weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(1)).cuda() / hidden.numel()
    (hidden.float() * weights).sum().add(logits.logsumexp(-1).mean()).backward()
    grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters() if p.grad is not None])
    return hidden.detach().float(), logits.detach(), grads


def _varlen(model, seqs):
    return fw.forward_hidden(model, seqs, "varlen")


def _rel(a, b):
    return float((a.detach() - b.detach()).norm() / b.detach().norm())


def _check_no_worse(got, ref, truth, what):
    for name, g, r, t in zip(("hidden", "logits", "grads"), got, ref, truth, strict=True):
        err, err_ref = _rel(g, t), _rel(r, t)
        print(f"{what} {name}: varlen {err:.2e}, per-sequence sdpa {err_ref:.2e} (relative to fp32 truth)")
        assert err <= SLACK * err_ref + FLOOR, (what, name, err, err_ref)


def test_choose_layout_picks_varlen_on_cuda(model):
    assert fw.choose_layout(model, "cuda") == "varlen"
    assert fw.choose_layout(model, torch.device("cuda", 0)) == "varlen"


def test_kernel_matches_per_sequence_attention_bf16(kernel_calls):
    # the attention function alone, GQA (8 query heads over 2 KV heads), bf16 inputs, values and gradients
    torch.manual_seed(0)
    n, heads, kv_heads, dim = sum(LENGTHS), 8, 2, 64
    q32 = torch.randn(1, heads, n, dim, device="cuda")
    k32, v32 = (torch.randn(1, kv_heads, n, dim, device="cuda") for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    grad_out = torch.randn(1, n, heads, dim, device="cuda")

    def run(fn, dtype):
        q, k, v = (x.detach().to(dtype).requires_grad_(True) for x in (q32, k32, v32))
        out = fn(q, k, v)
        out.backward(grad_out.to(out.dtype))
        return out.float(), torch.cat([x.grad.float().reshape(-1) for x in (q, k, v)])

    def varlen(q, k, v):
        kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 120, "max_length_k": 120}
        return fw.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=dim**-0.5, **kwargs)[0]

    def per_sequence(q, k, v):
        return fw._per_sequence(q, k, v, cu, dim**-0.5)

    truth = run(per_sequence, torch.float32)
    ref = run(per_sequence, torch.bfloat16)
    got = run(varlen, torch.bfloat16)
    assert kernel_calls == [torch.bfloat16]
    for name, g, r, t in zip(("out", "grads"), got, ref, truth, strict=True):
        err, err_ref = _rel(g, t), _rel(r, t)
        print(f"attention {name}: varlen {err:.2e}, per-sequence sdpa bf16 {err_ref:.2e}")
        assert err <= SLACK * err_ref + FLOOR, (name, err, err_ref)


def test_fp32_model_equals_per_sequence(model, kernel_calls):
    # float32 without autocast: flash has no fp32 kernel, so each sequence runs through sdpa alone (exact)
    seqs = _seqs()
    ref = _outputs(model, _per_sequence, seqs)
    fw.prepare_model(model, "varlen")
    got = _outputs(model, _varlen, seqs)
    assert kernel_calls == []
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        got_lp, got_ent = fw.token_logprobs(model, seqs, "varlen", temperature=0.7, entropy=True)
        ref_lp, ref_ent = fw.token_logprobs(model, seqs, "padded", temperature=0.7, entropy=True)
    torch.testing.assert_close(got_lp, ref_lp, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_ent, ref_ent, rtol=1e-4, atol=1e-5)


def test_fp32_weights_under_bf16_autocast(model, kernel_calls):
    # the training default: fp32 master weights, bf16 autocast; the kernel runs in bf16
    seqs = _seqs()
    truth = _outputs(model, _per_sequence, seqs)
    ref = _outputs(model, _per_sequence, seqs, autocast=True)
    fw.prepare_model(model, "varlen")
    got = _outputs(model, _varlen, seqs, autocast=True)
    assert kernel_calls and set(kernel_calls) == {torch.bfloat16}
    _check_no_worse(got, ref, truth, "fp32 weights + bf16 autocast")


def test_bf16_model(model, kernel_calls):
    seqs = _seqs()
    truth = _outputs(model, _per_sequence, seqs)
    bf16 = copy.deepcopy(model).bfloat16()
    ref = _outputs(bf16, _per_sequence, seqs)
    fw.prepare_model(bf16, "varlen")
    got = _outputs(bf16, _varlen, seqs)
    assert kernel_calls and set(kernel_calls) == {torch.bfloat16}
    _check_no_worse(got, ref, truth, "bf16 model")


def test_token_logprobs_bf16_autocast(model, kernel_calls):
    seqs = _seqs()
    with torch.no_grad():
        truth, truth_ent = fw.token_logprobs(model, seqs, "padded", temperature=0.7, entropy=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref, ref_ent = fw.token_logprobs(model, seqs, "padded", temperature=0.7, entropy=True)
            fw.prepare_model(model, "varlen")
            got, got_ent = fw.token_logprobs(model, seqs, "varlen", temperature=0.7, entropy=True)
    assert kernel_calls
    firsts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    assert (got[firsts] == 0).all() and (got_ent[firsts] == 0).all()
    for name, g, r, t in (("logp", got, ref, truth), ("entropy", got_ent, ref_ent, truth_ent)):
        err, err_ref = _rel(g, t), _rel(r, t)
        print(f"token_logprobs {name}: varlen {err:.2e}, padded sdpa {err_ref:.2e}")
        assert err <= SLACK * err_ref + FLOOR, (name, err, err_ref)
