# pyright: reportInvalidTypeForm=false
# (a kernel's `tl.constexpr` parameter annotations are markers for Triton's compiler, not types)
"""Triton kernels of the fp8 rollout path (rollout/fp8.py): the per-row e4m3 quantiser, bit for bit the torch
functions they replace, as plain kernel launches.

    quantize_rows(x [M, K]) -> (x_q [M, K] e4m3fn, s [M, 1] fp32)     = fp8.quantize_rows
    silu_mul_quantize(gu [M, 2I]) -> (h_q [M, I], s [M, 1])          = fp8.silu_mul_quantize (two kernels over
                                                                     column chunks: rows of 18944 at 7B)
    rms_norm_quantize(x, w, eps, residual, scales) -> (h_q, s, x + residual)
                                                                     = quantize_rows(kernels.rms_norm(..)[0]):
                                                                     the decode step's norms emit the next
                                                                     projection's fp8 input (and, `scales`, undo
                                                                     the "cublas" GEMM's unit scales first)
    quantize_rows_into(w [N, K], q_out [N, K], s_out [N])            the weight refresh: straight into the
                                                                     engine's fp8 buffers, no temporaries
    rescale(acc [M, N] fp32, s_x [M, 1], s_w [N], bias, dtype)        acc * s_x * s_w + bias in `dtype`: the
                                                                     epilogue of fp8.py's "cublas" GEMM (cuBLAS's
                                                                     per-tensor fp8 GEMM has no row-wise scales)

Why kernels and not torch.compile (the first version compiled the torch functions with dynamic shapes):
Dynamo guards every compiled function on the grad mode, the 0/1 size of M (decode batch 1), inference
tensors, the dtype; the engine is built with grad on and runs under no_grad, captures batch 1 and prefills,
and a trainer process builds engines in several such states, so the functions recompiled per state until
torch's recompile limit (8 per function, process-wide) raised `FailOnRecompileLimitHit` (fullgraph=True) and
every later call in the process ran the ~8 eager ops (fp32 temporaries of every activation) instead of one
kernel; a recompile reached inside a CUDA graph capture can also fail that capture, and a failed capture
makes that decode shape run without a graph (rollout/native_state.py GraphCache). A Triton kernel has none
of this: one launch per call, the same compiled binary for every batch size (the row length is a runtime
argument), compiled in the warm-up run before each capture as kernels.py's are.

quantize_rows: each program quantises one row, the absolute maximum then x / s rounded to e4m3's grid, from
registers when the row fits ONE_PASS_MAX columns, else in two passes (the second re-reads it, from L2 at decode
sizes); silu_mul_quantize: chunks of CHUNK columns per program, the row's maximum across them through a second
kernel (the quantised values are the same bytes; the max is order-free); rms_norm_quantize: one row per program,
held in registers as kernels.rms_norm's. Rounding: x / s is computed with IEEE division
(`div_rn`, as torch's), clamped to +-448, then rounded to nearest-even on e4m3's grid in fp32 (adding and
subtracting 1.5 * 2^(p + 23), p the exponent of the grid step at |v|: 2^(e - 3) for a normal |v| in
[2^e, 2^(e+1)), 2^-9 below 2^-6) and only then cast, so the cast is exact whatever its own rounding
(Triton's CPU interpreter, which the CPU tests run, mis-rounds fp32 -> fp8 casts just below a power of two).
silu(gate) * up is rounded to the model dtype step by step as torch's bf16 ops do (kernels.py's silu_mul);
its exp is an approximation, so a value at an e4m3 rounding boundary may land one step away (tested).
"""

from __future__ import annotations

import torch

from relayrl.rollout.kernels import _add_rms_norm, _jit, _pow2, tl, usable

FP8 = torch.float8_e4m3fn

__all__ = [
    "quantize_rows", "quantize_rows_into", "rescale", "rms_norm_quantize", "silu_mul_quantize", "usable",
]  # fmt: skip
CHUNK = 1024
"""Columns per program of the chunked quantiser (silu_mul_quantize: rows of 18944 at 7B)."""
ONE_PASS_MAX = 4096
"""quantize_rows reads a row this long or shorter once (held in registers; 3584 at 7B), a longer one twice."""


@_jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to nearest-even on e4m3fn's grid, still fp32 (module doc)."""
    a = tl.abs(v)
    exp = (a.to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2 a) for a normal fp32; -127 for 0
    step = tl.maximum(exp, -6) - 3  # e4m3: 3 mantissa bits; subnormal step 2^-9 below 2^-6
    magic = (((step + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 * 2^(step + 23)
    r = (a + magic) - magic
    # v's sign bit copied onto r (r >= 0): not `-r`, which Triton compiles as 0 - r and so turns a negative
    # value that rounds to zero into +0.0 where torch's cast keeps -0.0 (seen on an H200, 2026-11-27)
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@_jit
def _load_row(x_ptr, row, cols, m, n_cols, sx, SILU: tl.constexpr):
    """Columns `cols` of row `row` in fp32: x, or silu(gate) * up (gate at [0, n_cols), up at [n_cols,
    2 n_cols) of the row), each step rounded to the input dtype as torch computes it."""
    if SILU:
        g = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + row * sx + n_cols + cols, mask=m, other=0.0).to(tl.float32)
        s = (
            tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(x_ptr.dtype.element_ty).to(tl.float32)
        )  # torch: IEEE division
        return (s * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    return tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)


@_jit
def _row_scale(amax):
    """A row's scale from its max |x|: amax / 448 (IEEE division, as torch's), 1 for an all-zero row."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)  # pyright: ignore[reportOperatorIssue]


@_jit
def _store_quantized(q_ptr, row, sq, cols, m, v, scale):
    """Columns `cols` of row `row` (fp32 values v): round_e4m3(clamp(v / scale)) stored as e4m3fn."""
    v = tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0)
    tl.store(q_ptr + row * sq + cols, _round_e4m3(v).to(q_ptr.dtype.element_ty), mask=m)


@_jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, n_cols, sx, sq, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    if ONE_PASS:  # the row fits one block: read once, held in registers
        cols = tl.arange(0, BLOCK)
        m = cols < n_cols
        x = _load_row(x_ptr, row, cols, m, n_cols, sx, False)
        scale = _row_scale(tl.max(tl.abs(x), 0))
        tl.store(s_ptr + row, scale)
        _store_quantized(q_ptr, row, sq, cols, m, x, scale)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < n_cols
            acc = tl.maximum(acc, tl.abs(_load_row(x_ptr, row, cols, m, n_cols, sx, False)))
        scale = _row_scale(tl.max(acc, 0))
        tl.store(s_ptr + row, scale)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            m = cols < n_cols
            _store_quantized(
                q_ptr, row, sq, cols, m, _load_row(x_ptr, row, cols, m, n_cols, sx, False), scale
            )


def _launch(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, n_cols: int) -> None:
    block = _pow2(n_cols, 16)
    one_pass = block <= ONE_PASS_MAX
    block = block if one_pass else 2048
    _quantize_rows_kernel[(x.shape[0],)](
        x, q, s, n_cols, x.stride(0), q.stride(0), BLOCK=block, ONE_PASS=one_pass,
        num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip


def _rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"fp8 quantiser: expected rows [M, K], got shape {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] float8_e4m3fn, scale [M, 1] fp32): fp8.quantize_rows in one kernel."""
    x = _rows(x)
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    s = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _launch(x, q, s, x.shape[1])
    return q, s


@_jit
def _chunk_amax_kernel(x_ptr, h_ptr, part_ptr, n_cols, sx, sh, n_chunks, BLOCK: tl.constexpr):
    """Chunk program_id(1) of row program_id(0): h = silu(gate) * up stored in the model dtype (exact: it is
    rounded to it already) and max |h| into part[row, chunk]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    v = _load_row(x_ptr, row, cols, m, n_cols, sx, True)
    tl.store(h_ptr + row * sh + cols, v.to(h_ptr.dtype.element_ty), mask=m)
    tl.store(part_ptr + row * n_chunks + chunk, tl.max(tl.abs(v), 0))


@_jit
def _chunk_quantize_kernel(
    h_ptr, part_ptr, q_ptr, s_ptr, n_cols, sh, sq, n_chunks, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """Chunk program_id(1) of row program_id(0) of h quantised with the row's scale (the max of its chunks')."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    parts = tl.arange(0, CHUNKS)
    scale = _row_scale(
        tl.max(tl.load(part_ptr + row * n_chunks + parts, mask=parts < n_chunks, other=0.0), 0)
    )
    if chunk == 0:
        tl.store(s_ptr + row, scale)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    _store_quantized(
        q_ptr, row, sq, cols, m, tl.load(h_ptr + row * sh + cols, mask=m, other=0.0).to(tl.float32), scale
    )


def silu_mul_quantize(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu [M, 2I] (gate | up) -> quantize_rows(silu(gate) * up) [M, I]: fp8.silu_mul_quantize in two kernels
    over chunks of CHUNK columns (M x I / CHUNK programs each, not M: a row of 18944 is too long for one
    program to stream at the card's bandwidth): h = silu(gate) * up and each chunk's max |h|, then each chunk
    of h quantised with its row's scale (the max of its chunks' maxima: exact, whatever the order)."""
    gu = _rows(gu)
    m, inter = gu.shape[0], gu.shape[1] // 2
    q = torch.empty((m, inter), dtype=FP8, device=gu.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=gu.device)
    if m:
        chunks = -(-inter // CHUNK)
        h = torch.empty((m, inter), dtype=gu.dtype, device=gu.device)
        part = torch.empty((m, chunks), dtype=torch.float32, device=gu.device)
        _chunk_amax_kernel[(m, chunks)](
            gu, h, part, inter, gu.stride(0), h.stride(0), chunks, BLOCK=CHUNK, num_warps=4
        )
        _chunk_quantize_kernel[(m, chunks)](
            h, part, q, s, inter, h.stride(0), q.stride(0), chunks, BLOCK=CHUNK, CHUNKS=_pow2(chunks, 16), num_warps=4,
        )  # fmt: skip
    return q, s


@_jit
def _rms_norm_quant_kernel(
    x_ptr, xs_ptr, ws_ptr, b_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_ptr, n_cols, eps, sx, sr, sq, sres,
    RESCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    if RESCALE:  # the fp32 accumulator of the "cublas" GEMM: (acc * s_x) * s_w + bias in the model dtype
        x = x * tl.load(xs_ptr + row) * tl.load(ws_ptr + cols, mask=m, other=0.0)
        if HAS_BIAS:
            x += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        x = x.to(res_ptr.dtype.element_ty)
    y = _add_rms_norm(x, r_ptr, w_ptr, res_ptr, row, cols, m, n_cols, eps, sr, sres, HAS_RES, ROUND)
    y = y.to(res_ptr.dtype.element_ty).to(tl.float32)  # the normed row in the model dtype, as rms_norm's
    scale = _row_scale(tl.max(tl.abs(y), 0))
    tl.store(s_ptr + row, scale)
    _store_quantized(q_ptr, row, sq, cols, m, y, scale)


def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kernels.rms_norm and quantize_rows of its output in one kernel: x [M, K] (the delta, in the model dtype;
    or, with `scales` = (s_x [M, 1], s_w [K], bias [K] or None), the fp32 accumulator of fp8.py's "cublas" GEMM,
    rescaled first as `rescale` does) -> (h_q [M, K] e4m3fn, s [M, 1] fp32, s_res [M, K]): the same bytes as
    quantize_rows(rms_norm(d, weight, eps, residual)[0]) with d = x or rescale(x, *scales, residual's dtype),
    and s_res = d + residual (or x) in the model dtype. The next projection's input comes out quantised: no
    bf16 normed row is written or read back."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm_quantize: expected contiguous rows [M, K], got {tuple(x.shape)}")
    if scales is not None and residual is None:
        raise ValueError("rms_norm_quantize: a rescaled accumulator needs the residual (the model dtype)")
    m, n = x.shape
    q = torch.empty((m, n), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    res = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else x
    r = residual if residual is not None else x
    xs, ws, bias = scales if scales is not None else (x, x, None)
    if m:
        _rms_norm_quant_kernel[(m,)](
            x, xs, ws, x if bias is None else bias, r, weight, q, s, res, n, eps, x.stride(0), r.stride(0),
            q.stride(0), res.stride(0), RESCALE=scales is not None, HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, ROUND=res.dtype != torch.float32, BLOCK=_pow2(n),
            num_warps=8 if n >= 2048 else 4,
        )  # fmt: skip
    return q, s, res


def quantize_rows_into(w: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor) -> None:
    """quantize_rows(w [N, K]) written into q_out [N, K] fp8 (unit column stride) and s_out [N] fp32 (the
    engine's buffers, or row slices of them): the weight refresh without temporaries."""
    w = _rows(w)
    if (
        q_out.shape != w.shape
        or q_out.stride(-1) != 1
        or s_out.shape != (w.shape[0],)
        or s_out.stride(0) != 1
    ):
        raise ValueError(
            f"fp8 quantize_rows_into: weight {tuple(w.shape)} into q {tuple(q_out.shape)} (stride "
            f"{q_out.stride()}), s {tuple(s_out.shape)}: want q of the weight's shape and s [rows], contiguous"
        )
    if w.shape[0]:
        _launch(w, q_out, s_out, w.shape[1])


@_jit
def _rescale_kernel(
    acc_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, n_cols, sa, so, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    acc = tl.load(acc_ptr + row * sa + cols, mask=m, other=0.0)
    y = (
        acc * tl.load(sx_ptr + row) * tl.load(sw_ptr + cols, mask=m, other=0.0)
    )  # (acc * s_x) * s_w: CUTLASS's
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def rescale(
    acc: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """acc [M, N] fp32 (x_q @ W_q^T) -> (acc * s_x [M, 1] * s_w [N] + bias [N]) in `dtype`, one kernel (the torch
    ops where the kernels cannot run)."""
    if not usable(acc.device):
        y = acc * xs * ws
        return (y if bias is None else y + bias.float()).to(dtype)
    out = torch.empty(acc.shape, dtype=dtype, device=acc.device)
    n = acc.shape[1]
    block = min(1024, _pow2(n, 16))
    if acc.shape[0]:
        _rescale_kernel[(acc.shape[0], -(-n // block))](
            acc, xs, ws, acc if bias is None else bias, out, n, acc.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out
