"""GPU check of the chunked log-probs: bf16 LM head, T*B = 4096 tokens, V = 32k: agrees with the naive
computation and keeps the extra CUDA memory far below one full float32 logits tensor (500 MiB)."""

from __future__ import annotations

import pytest
import torch

from relayrl.models.logprobs import head_logprobs

pytestmark = pytest.mark.gpu


def _naive(h, w, tgt, temperature):
    lp = torch.log_softmax((h @ w.t()).float() / temperature, dim=-1)
    return lp.gather(-1, tgt[..., None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_matches_naive_and_memory():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    B, T, H, V = 4, 1024, 1024, 32000
    h = (torch.randn(B, T, H, device=dev) * 0.5).bfloat16().requires_grad_(True)
    w = (torch.randn(V, H, device=dev) * 0.03).bfloat16().requires_grad_(True)
    tgt = torch.randint(0, V, (B, T), device=dev)
    head_logprobs(h[:, :8], w, tgt[:, :8], temperature=0.8, with_entropy=True)  # warm up kernels
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, ent = head_logprobs(h, w, tgt, temperature=0.8, chunk_size=512, with_entropy=True)
    (logp.sum() + 0.1 * ent.sum()).backward()
    torch.cuda.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
    g_h, g_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref_logp, ref_ent = _naive(h, w, tgt, 0.8)
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    print(f"cuda peak extra memory (fwd+bwd, entropy, bf16 H=1024): {peak_mib:.0f} MiB")
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=2e-2)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=2e-2)
    # gradient error vs the fp32 truth: no worse than plain bf16 autograd's (grad_w is accumulated in bf16
    # one chunk at a time, so allow 2x)
    h32, w32 = h.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    t_logp, t_ent = _naive(h32, w32, tgt, 0.8)
    (t_logp.sum() + 0.1 * t_ent.sum()).backward()
    for got, naive_bf16, truth in ((g_h, h.grad, h32.grad), (g_w, w.grad, w32.grad)):
        err = float((got.float() - truth).norm() / truth.norm())
        err_naive = float((naive_bf16.float() - truth).norm() / truth.norm())
        print(f"relative grad error: chunked {err:.2e}, naive bf16 autograd {err_naive:.2e}")
        assert err < max(2 * err_naive, 1e-3), (err, err_naive)
    # grad_w in bf16 (62 MiB) + 2 fp32 chunk buffers of 62.5 MiB + bf16 chunk temporaries (31 MiB each)
    assert peak_mib < 320


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_autocast_fp32_master_head_runs_in_bf16():
    """Mixed precision: fp32 master LM head under bf16 autocast. The head matmuls run in bf16 (as autocast
    runs every other matmul), log-probs / softmax stay fp32, gradients land in fp32 on the master weight, and
    the result is as close to the fp32 truth as plain bf16 autocast autograd."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    N, H, V = 2048, 512, 32000
    h = (torch.randn(N, H, device=dev) * 0.5).requires_grad_(True)
    w = (torch.randn(V, H, device=dev) * 0.03).requires_grad_(True)
    tgt = torch.randint(0, V, (N,), device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp, _ = head_logprobs(h, w, tgt)
    logp.sum().backward()
    assert logp.dtype == torch.float32 and w.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    g_h, g_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref = torch.log_softmax((h @ w.t()).float(), -1).gather(-1, tgt[:, None]).squeeze(-1)
    ref.sum().backward()
    h32, w32 = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    truth = torch.log_softmax(h32 @ w32.t(), -1).gather(-1, tgt[:, None]).squeeze(-1)
    truth.sum().backward()
    err, err_auto = float((logp - truth).abs().mean()), float((ref - truth).abs().mean())
    assert err <= 2 * err_auto + 1e-3, (err, err_auto)
    for got, auto, t in ((g_h, h.grad, h32.grad), (g_w, w.grad, w32.grad)):
        err = float((got - t).norm() / t.norm())
        err_auto = float((auto - t).norm() / t.norm())
        assert err < max(2 * err_auto, 1e-3), (err, err_auto)
