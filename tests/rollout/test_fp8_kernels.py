"""FP8 rollout's Triton quantisers (relayrl/rollout/fp8_kernels.py) against the torch functions they replace, and
the fp8 GEMM's error at Qwen2.5-7B widths (relayrl/rollout/fp8.py's "Mismatch").

On a CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU;
skipped when triton is missing), in fp32 and fp16 (the interpreter mishandles bf16; bf16 is checked on the GPU,
tests/rollout/test_fp8_gpu.py). Bounds: the quantiser's fp8 bytes and scales EQUAL torch's (no tolerance);
silu(gate) * up: every byte equal in fp32 / fp16 here (the interpreter's exp is numpy's).

7B widths (fp8.py's module doc): one fp8 GEMM (q/k/v 4608 x 3584 with bias; down 18944 -> 128 rows, the
longest K) on unit-RMS activations with an outlier token, against the exact (fp64) product: relative error per
token in [0.02, 0.05] (e4m3's rounding of activations and weights, ~0.038 measured), the bf16 GEMM's <= 0.005
(~0.0029 measured), the ratio in [8, 20] (13 measured): the engine's log-prob gap at 7B follows this ratio,
so a scale of the wrong axis, a misaligned q/k/v row block or a 3-D reshape bug (each pushing the error far
above e4m3's) would fail here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relayrl.rollout import fp8, fp8_kernels
from relayrl.rollout.fp8 import FP8Linear, FP8Runner, quantize_rows, silu_mul_quantize
from relayrl.rollout.kernels import rms_norm

needs_kernels = pytest.mark.skipif(
    not fp8_kernels.usable(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
    reason="triton not installed (or no GPU and TRITON_INTERPRET unset)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


def _rows(gen: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Rows of very different magnitudes, a zero row, zeros and a -0.0 inside a row."""
    x = torch.randn(m, k, generator=gen) * torch.logspace(-4, 2, m)[:, None]
    x[0, :5] = 0.0
    x[0, 3] = -0.0
    if m > 2:
        x[2] = 0.0
    return x


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantiser_kernel_equals_quantize_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    # one row; a ragged block; rows read once (<= ONE_PASS_MAX) and, past it, twice over 2048-column blocks
    for m, k in ((1, 64), (5, 300), (3, 2500), (2, fp8_kernels.ONE_PASS_MAX + 900)):
        x = _rows(gen, m, k).to(DEV, dtype)
        q, s = fp8_kernels.quantize_rows(x)
        want_q, want_s = quantize_rows(x)
        assert q.dtype == fp8.FP8 and s.shape == (m, 1)
        assert torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(s, want_s)
    empty_q, empty_s = fp8_kernels.quantize_rows(torch.zeros(0, 64, device=DEV, dtype=dtype))
    assert empty_q.shape == (0, 64) and empty_s.shape == (0, 1)


@needs_kernels
def test_quantiser_kernel_rounds_every_e4m3_value_and_tie_as_torch():
    """Every finite e4m3 value, every midpoint between neighbours (ties: to even) and the fp32 numbers either
    side of each midpoint, at scale 1 (the row's max is 448)."""
    grid = torch.arange(256, dtype=torch.uint8).view(fp8.FP8).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9))
    x = torch.cat([grid, mids, up, down, torch.tensor([448.0, -0.0])])[None].to(DEV)
    q, s = fp8_kernels.quantize_rows(x)
    want_q, _ = quantize_rows(x)
    assert s.item() == 1.0 and torch.equal(_bytes(q), _bytes(want_q))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_mul_quantize_kernel_equals_the_torch_function(dtype):
    gen = torch.Generator().manual_seed(1)
    for m, inter in ((4, 700), (3, 2 * fp8_kernels.CHUNK + 300)):  # one chunk; three, the last ragged
        gu = (torch.randn(m, 2 * inter, generator=gen) * 3).to(DEV, dtype)
        gu[1, :inter] = 0.0  # an all-zero row of h: scale 1
        gu[2, inter + inter - 5] = 40.0  # the row's max in its last chunk
        q, s = fp8_kernels.silu_mul_quantize(gu)
        want_q, want_s = silu_mul_quantize(gu)
        assert q.shape == (m, inter) and torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(s, want_s)
        assert s[1].item() == 1.0


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_quantiser_kernel_equals_rms_norm_then_quantize_rows(dtype):
    """fp8_kernels.rms_norm_quantize against kernels.rms_norm followed by quantize_rows (and, rescaling the
    "cublas" GEMM's fp32 accumulator, fp8_kernels.rescale first): every fp8 byte, scale and residual EQUAL, with
    and without a residual and a bias, one row wider than a warp's block (K = 300) and a zero row."""
    gen = torch.Generator().manual_seed(6)
    m, k = 5, 300
    w = (torch.rand(k, generator=gen) + 0.5).to(DEV, dtype)
    x = _rows(gen, m, k).to(DEV, dtype)
    res = (torch.randn(m, k, generator=gen)).to(DEV, dtype)
    acc = torch.randn(m, k, generator=gen).to(DEV) * 300
    xs, ws = (torch.rand(m, 1, generator=gen) * 1e-2).to(DEV), (torch.rand(k, generator=gen) * 1e-3).to(DEV)
    for residual in (None, res):
        q, s, got_res = fp8_kernels.rms_norm_quantize(x, w, 1e-6, residual)
        h, want_res = rms_norm(x, w, 1e-6, residual)
        want_q, want_s = quantize_rows(h)
        assert (
            torch.equal(_bytes(q), _bytes(want_q))
            and torch.equal(s, want_s)
            and torch.equal(got_res, want_res)
        )
    for bias in (None, torch.randn(k, generator=gen).to(DEV, dtype)):
        q, s, got_res = fp8_kernels.rms_norm_quantize(acc, w, 1e-6, res, scales=(xs, ws, bias))
        h, want_res = rms_norm(fp8_kernels.rescale(acc, xs, ws, bias, dtype), w, 1e-6, res)
        want_q, want_s = quantize_rows(h)
        assert (
            torch.equal(_bytes(q), _bytes(want_q))
            and torch.equal(s, want_s)
            and torch.equal(got_res, want_res)
        )
    with pytest.raises(ValueError, match="needs the residual"):
        fp8_kernels.rms_norm_quantize(acc, w, 1e-6, None, scales=(xs, ws, None))


@needs_kernels
def test_weight_refresh_kernel_writes_into_row_slices():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(6, 96, generator=gen).to(DEV)
    q_buf = torch.zeros(10, 96, dtype=fp8.FP8, device=DEV)
    s_buf = torch.zeros(10, device=DEV)
    fp8_kernels.quantize_rows_into(w, q_buf[2:8], s_buf[2:8])
    want_q, want_s = quantize_rows(w)
    assert torch.equal(_bytes(q_buf[2:8]), _bytes(want_q)) and torch.equal(s_buf[2:8], want_s[:, 0])
    assert not _bytes(q_buf[:2]).any() and not _bytes(q_buf[8:]).any() and not s_buf[8:].any()
    with pytest.raises(ValueError, match="quantize_rows_into"):
        fp8_kernels.quantize_rows_into(w, q_buf[:5], s_buf[:5])


@needs_kernels
def test_gpu_path_quantises_through_the_kernels_in_every_grad_mode_without_torch_compile(
    tiny_model, monkeypatch
):
    """The first version torch.compile'd the quantisers, which recompiled per grad mode, batch 1, inference
    tensors and dtype until torch's limit, then ran eager ops for good. The runner's GPU path (pretended here)
    now takes the kernels: no torch.compile call, the same bytes as quantize_rows in every mode and batch."""

    def no_compile(*args, **kwargs):
        raise AssertionError("the fp8 path must not torch.compile")

    refreshed = []

    def refresh_into(
        w, q_out, s_out
    ):  # the refresh kernel is tested above; the interpreter is slow on weights
        refreshed.append(tuple(w.shape))
        q, s = quantize_rows(w)
        q_out.copy_(q)
        s_out.copy_(s[:, 0])

    monkeypatch.setattr(torch, "compile", no_compile)
    monkeypatch.setattr(fp8, "check_device", lambda device: True)
    monkeypatch.setattr(fp8_kernels, "quantize_rows_into", refresh_into)
    runner = FP8Runner(tiny_model.to(DEV).eval(), 64)
    assert len(refreshed) == 7 * len(runner.layers)  # q, k, v, o, gate, up, down: each through the kernel
    assert runner.quant_kernels and not runner.emulate
    qkv = runner.fp8_qkv[0]
    assert qkv is not None and qkv.quantizer is fp8_kernels.quantize_rows
    assert runner.silu_quantize is fp8_kernels.silu_mul_quantize
    gen = torch.Generator().manual_seed(3)
    modes = (torch.enable_grad, torch.no_grad, torch.inference_mode)
    for mode in modes:
        for m in (1, 2, 17):
            x = torch.randn(m, tiny_model.config.hidden_size, generator=gen).to(DEV)
            with mode():
                q, s = qkv.quantizer(x)
            want_q, want_s = quantize_rows(x)
            assert torch.equal(_bytes(q), _bytes(want_q)) and torch.equal(s, want_s)
    lin = runner.fp8_linears()[0]
    assert torch.equal(lin.scale, quantize_rows(torch.cat([m.weight for m in lin.linears]).detach())[1][:, 0])


@needs_kernels
def test_rescale_kernel_and_the_cublas_gemm_path():
    """fp8_kernels.rescale against its torch form (the same fp32 products in the same order: equal), and
    FP8Linear(gemm="cublas") (per-tensor GEMM, fp32 out, then rescale) against the emulation on the same fp8
    operands, in fp32 where this CPU build runs torch._scaled_mm: relative error <= 1e-5 (summation order)."""
    gen = torch.Generator().manual_seed(5)
    acc = torch.randn(5, 300, generator=gen).to(DEV) * 1e4
    xs, ws, b = (torch.rand(5, 1, generator=gen) + 0.1).to(DEV), torch.rand(300, generator=gen).to(DEV), None
    for bias in (None, torch.randn(300, generator=gen).to(DEV)):
        want = acc * xs * ws + (0.0 if bias is None else bias)
        assert torch.equal(fp8_kernels.rescale(acc, xs, ws, bias, torch.float32), want)
        b = bias
    lins = [torch.nn.Linear(64, n, bias=True).to(DEV) for n in (64, 32, 32)]
    cublas, emulated = FP8Linear(lins, emulate=False, gemm="cublas"), FP8Linear(lins, emulate=True)
    x = torch.randn(7, 64, generator=gen).to(DEV)
    try:
        got = cublas(x)
    except (NotImplementedError, RuntimeError) as e:
        pytest.skip(f"torch._scaled_mm (per-tensor, fp32 out) does not run on this build: {e}")
    want = emulated(x)
    assert b is not None and float((got - want).norm() / want.norm()) <= 1e-5
    with pytest.raises(ValueError, match="gemm='cudnn'"):
        FP8Linear(lins, emulate=False, gemm="cudnn")


# ------------------------------------------------------------------------------------------- 7B widths
def _linear(k: int, n: int, bias: bool, gen: torch.Generator) -> torch.nn.Linear:
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():  # the bench model's (and HF's) initialisation: N(0, 0.02)
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen) * 0.02)
    return lin


def _per_token_rel(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    return (got.double() - exact).norm(dim=-1) / exact.norm(dim=-1)


def test_fp8_gemm_error_at_7b_widths_is_e4m3_rounding_per_token():
    gen = torch.Generator().manual_seed(4)
    hidden, kv, inter = 3584, 512, 18944
    cases = {
        "q/k/v": ([_linear(hidden, n, True, gen) for n in (hidden, kv, kv)], hidden),
        "down (K 18944)": ([_linear(inter, 128, False, gen)], inter),
    }
    for name, (lins, k) in cases.items():
        x = torch.randn(2, 8, k, generator=gen)  # [B, T, K]: unit-RMS tokens, as after an RMSNorm
        x[1, 3] *= 100.0  # an outlier token: its scale must not touch the others
        if name.startswith("down"):  # silu(gate) * up: heavy-tailed
            x = F.silu(x * 1.2) * torch.randn(2, 8, k, generator=gen) * 1.2
        lin8 = FP8Linear(lins, emulate=True)
        w = torch.cat([m.weight for m in lins]).detach()
        b = torch.cat([m.bias for m in lins]).detach() if lins[0].bias is not None else None
        row = 0
        for m in lins:  # each stacked block's scales are its own rows' (q/k/v aligned)
            n = m.weight.shape[0]
            amax = m.weight.detach().abs().amax(dim=1)
            assert torch.equal(lin8.scale[row : row + n], amax / fp8.FP8_MAX)
            row += n
        exact = F.linear(x.double(), w.double(), None if b is None else b.double())
        got = lin8(x)
        assert got.shape == (2, 8, w.shape[0])
        err8 = _per_token_rel(got, exact)
        err16 = _per_token_rel(
            F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()), exact
        )
        assert bool((err8 > 0.02).all() and (err8 < 0.05).all()), (name, err8)
        assert bool((err16 < 0.005).all()), (name, err16)
        ratio = float(err8.mean() / err16.mean())
        assert 8 < ratio < 20, (name, ratio)


@needs_kernels
def test_fused_decode_equals_the_per_projection_path(tiny_model, monkeypatch):
    """FP8Runner's fused decode (each norm emits the next projection's fp8 input; o and down through the
    "cublas" GEMM with their scales applied inside the next norm; the final norm in the model dtype for the LM
    head) against the per-projection path with the same GEMMs (quantiser kernels, rescale kernel): logits and
    KV caches EQUAL, on the fp32 tiny model through torch._scaled_mm where this CPU build runs it."""
    monkeypatch.setattr(fp8, "check_device", lambda device: True)
    monkeypatch.setattr(fp8_kernels, "quantize_rows_into", _refresh_into)  # interpreter: slow on weights
    runner = FP8Runner(tiny_model.to(DEV).eval(), 64, kernels=True)
    assert runner.fused and not runner.emulate
    assert [lin.gemm for lin in runner.fp8_linears()[:4]] == ["cublas", "cublas", "cutlass", "cublas"]
    gen = torch.Generator().manual_seed(7)
    bs = 3
    tok = torch.randint(0, tiny_model.config.vocab_size, (bs,), generator=gen).to(DEV)
    pos = torch.tensor([0, 5, 17], device=DEV)
    shape = runner.cache_shape(bs)
    k0, v0 = torch.randn(shape, generator=gen).to(DEV), torch.randn(shape, generator=gen).to(DEV)
    out = {}
    for fused in (True, False):
        runner.fused = fused
        kc, vc = k0.clone(), v0.clone()
        try:
            with torch.no_grad():
                logits = runner.decode(tok, pos, kc, vc, 32, torch.arange(bs, device=DEV))
        except (NotImplementedError, RuntimeError) as e:
            pytest.skip(f"torch._scaled_mm does not run on this build: {e}")
        out[fused] = (logits, kc, vc)
    for got, want in zip(out[True], out[False], strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(out[True][1], k0)  # the step wrote K


def _refresh_into(w, q_out, s_out):
    q, s = quantize_rows(w)
    q_out.copy_(q)
    s_out.copy_(s[:, 0])


def test_cublas_gemm_runs_decode_sized_batches_only(monkeypatch):
    """ "cublas" (fp32 accumulator + scales for the caller) up to fp8.CUBLAS_MAX_ROWS rows; more rows (prefill,
    where cuBLAS + rescale measured slower) take the row-wise GEMM with the scales in its epilogue."""
    gen = torch.Generator().manual_seed(8)
    lin = FP8Linear([torch.nn.Linear(64, 32, bias=False)], emulate=False, gemm="cublas")
    monkeypatch.setattr(fp8, "CUBLAS_MAX_ROWS", 4)
    small, large = (
        quantize_rows(torch.randn(4, 64, generator=gen)),
        quantize_rows(torch.randn(5, 64, generator=gen)),
    )
    try:
        acc, scales = lin.accumulate(*small, torch.float32)
        out, none = lin.accumulate(*large, torch.float32)
    except (NotImplementedError, RuntimeError) as e:
        pytest.skip(f"torch._scaled_mm does not run on this build: {e}")
    assert scales is not None and scales[0] is small[1] and scales[1] is lin.scale and none is None
    scaled_mm = torch._scaled_mm  # pyright: ignore[reportPrivateImportUsage]
    want_acc = scaled_mm(small[0], lin.qweight_t, scale_a=lin.one, scale_b=lin.one, out_dtype=torch.float32)
    want_out = scaled_mm(
        large[0], lin.qweight_t, scale_a=large[1], scale_b=lin.scale_row, out_dtype=torch.float32
    )
    assert torch.equal(acc, want_acc) and torch.equal(out, want_out)
