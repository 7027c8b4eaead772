# pyright: reportInvalidTypeForm=false
# (a kernel's `tl.constexpr` parameter annotations are markers for Triton's compiler, not types)
"""Batch-invariant Triton kernels for exact on-policy mode on CUDA (relayrl/rollout/exact.py's GPU path).

Batch invariance needs only that each output element's reduction order does not depend on how many rows
the call has or where the row sits. Each kernel gets it by construction, with ONE compiled configuration for
every call on a given weight or head shape (tiles fixed by the shape, no autotuning, no split-K; the
row/query counts are `do_not_specialize`, so the same binary runs a 1-row decode and a 5,000-row trainer
micro-batch):

    matmul(x [M, K], w [N, K], bias)    x @ w.T (+ bias) as [64 x BN] output tiles, BN = 128, 64 or 32 by
                                        the weight's row count N only (`mm_tile_n`: enough programs for a
                                        decode step's single row tile), K reduced in blocks of 64 from k = 0
                                        upwards (fp32 accumulator, bias added to it, one rounding to x's
                                        dtype). A row's value does not depend on M or on the other rows of
                                        its tile (the MMA computes each output element from its own row and
                                        column).
    attention(q, k, v, q_pos, scale)    each query (one tile row per (query, head) pair of a KV head's group)
                                        over key blocks of 64 anchored at position 0, fp32 online softmax,
                                        probabilities cast to v's dtype before the PV product (flash style).
                                        A key block after the query's position is an exact no-op (max
                                        unchanged, rescale exp(0) = 1, adds 0), so a token's output is the
                                        same in a prefill of many queries, a decode of one, or a training
                                        sequence -- whatever the key length (the cache bucket) past it.
    rms_norm                            kernels.rms_norm: one program per row over the whole row.
    rope                                rotary embedding in fp32 per token (elementwise; one launch for all
                                        heads instead of torch's gather / cat / products).

Each has an autograd Function for the trainer's update: the forward is the kernel (the values the engine
computes); the backward is an ordinary formulation (torch matmuls for the GEMM; for attention, RMSNorm and
rotary the torch reference recomputed and differentiated: SDPA with the positions' mask for attention), which
only needs to be the gradient, not bit-equal. Everything else in exact mode (SiLU x up, residual adds, log-softmax) is
elementwise or per-row torch code, batch-invariant as it is.

The torch references (`*_ref`) are what the CPU tests compare against (Triton's interpreter,
TRITON_INTERPRET=1, runs the kernels there; fp32 operands with exact products, as `UPCAST` does on a CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from relayrl.rollout.kernels import rms_norm as _rms_norm_kernel

try:
    import triton  # pyright: ignore[reportMissingImports] (optional: the GPU image has it)
    import triton.language as tl  # pyright: ignore[reportMissingImports]
except ImportError:  # no triton: exact.py never calls in here (kernels.usable is False)
    triton = None
    tl: Any = None

MM_BLOCK_M, MM_BLOCK_N, MM_BLOCK_K = 64, 128, 64
"""The matmul tile: 64 rows x (up to) 128 columns, K in steps of 64 (a Hopper warpgroup MMA per step)."""
MM_MIN_PROGRAMS = 64
"""`mm_tile_n`'s target: column tiles per weight, so a decode step's one row tile still spreads a projection
over this many programs (an H100 has 132 SMs; a 896-column projection in 128-column tiles ran on 7)."""
MM_TILES = "shape"
""""shape": the column tile per weight shape (`mm_tile_n`); "fixed": 128 for every weight (the first GPU
version; bench/exact_mode.py times both)."""
ATTN_BLOCK_M, ATTN_BLOCK_N = 64, 64
"""Attention: 64 (query, head) rows per program, 64 keys per online-softmax step (anchored at position 0)."""


def _jit(**kw: Any) -> Callable[[Any], Any]:
    def wrap(fn: Any) -> Any:
        return triton.jit(**kw)(fn) if triton is not None else fn

    return wrap


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


def _upcast(t: torch.Tensor) -> bool:
    """fp32 operands in the dot: fp32 tensors, and any dtype on a CPU (Triton's interpreter: its
    low-precision dot is not reliable)."""
    return t.dtype == torch.float32 or t.device.type == "cpu"


# --------------------------------------------------------------------------------------------- matmul
@_jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr, w_ptr, b_ptr, c_ptr, M, N, K, sam, swn, scm,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mm, nm = rm < M, rn < N
    acc = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, K, BK):
        km = k0 + rk < K
        a = tl.load(a_ptr + rm[:, None] * sam + (k0 + rk)[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * swn + (k0 + rk)[:, None], mask=km[:, None] & nm[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    tl.store(
        c_ptr + rm[:, None] * scm + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=mm[:, None] & nm[None, :],
    )


def mm_tile_n(n: int) -> int:
    """Output columns per program for a weight of n rows: the widest of 128 / 64 / 32 that still gives
    MM_MIN_PROGRAMS column tiles (else 32). A function of the weight's shape ONLY, never of the row count: a
    weight meets one configuration (one reduction order) in every call, the engine's 1-row decode and the
    trainer's 5,000-row micro-batch alike, which is all batch invariance asks."""
    if MM_TILES == "fixed":
        return MM_BLOCK_N
    return next((bn for bn in (128, 64) if _cdiv(n, bn) >= MM_MIN_PROGRAMS), 32)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (+ bias [N]) -> [M, N] in x's dtype (w and bias already in it)."""
    x, w = x.contiguous(), w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    up = _upcast(x)
    bn = mm_tile_n(n)
    grid = (_cdiv(m, MM_BLOCK_M), _cdiv(n, bn))
    _matmul_kernel[grid](
        x, w, bias if bias is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, UPCAST=up, PREC="ieee" if up else "tf32",
        BM=MM_BLOCK_M, BN=bn, BK=MM_BLOCK_K, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


class _Linear(torch.autograd.Function):
    """Forward: the kernel; backward: torch matmuls (gradients need not be bit-equal to anything)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = bias is not None
        return matmul(x, w, bias)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (g,) = grads
        x, w = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.t() @ x if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """exact.linear on the GPU: x [..., K] @ weight.T (+ bias), weight and bias cast to x's dtype (a bf16
    engine copy and fp32 master weights under autocast give the same operands), differentiable."""
    w = weight.to(x.dtype)
    b = bias.to(x.dtype) if bias is not None else None
    out = _Linear.apply(x.reshape(-1, x.shape[-1]), w, b)
    return out.view(*x.shape[:-1], w.shape[0])


# ------------------------------------------------------------------------------------------ attention
@_jit(do_not_specialize=["n_q", "length", "spr"])  # (spr: 0 for a prefill's expanded positions, 1 in decode)
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, scale, n_q, length, n_kv, head_dim,
    sqr, sqq, sqh, skr, skh, skl, svr, svh, svl, spr, sor, soq, soh,
    GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    rk = tl.program_id(0)
    r, kvh = (rk // n_kv).to(tl.int64), rk % n_kv
    i = tl.program_id(1) * BM + tl.arange(0, BM)  # tile rows: (query, head of the group) pairs
    valid = i < n_q * GROUP
    qi, head = i // GROUP, kvh * GROUP + i % GROUP
    d = tl.arange(0, BD)
    dm = d < head_dim
    p_q = tl.load(pos_ptr + r * spr + qi, mask=valid, other=0)
    qm = valid[:, None] & dm[None, :]
    q = tl.load(q_ptr + r * sqr + qi[:, None] * sqq + head[:, None] * sqh + d[None, :], mask=qm, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    hi = tl.minimum(tl.max(p_q, 0) + 1, length)  # keys past every query's position are never read
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    k_base, v_base = k_ptr + r * skr + kvh * skh, v_ptr + r * svr + kvh * svh
    for start in range(0, hi, BN):  # anchored at 0: the same blocks for a query whatever the call
        n = start + tl.arange(0, BN)
        km = (n < hi)[:, None] & dm[None, :]
        k = tl.load(k_base + n[:, None] * skl + d[None, :], mask=km, other=0.0)
        v = tl.load(v_base + n[:, None] * svl + d[None, :], mask=km, other=0.0)
        p_dt = v.dtype
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(n[None, :] <= p_q[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(p_dt)
        if UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new
    out = acc / l_i[:, None]
    o = o_ptr + r * sor + qi[:, None] * soq + head[:, None] * soh + d[None, :]
    tl.store(o, out.to(o_ptr.dtype.element_ty), mask=qm)


def attention_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [R, Qn, H, D] at positions q_pos [R, Qn] over k/v [R, Hkv, L, D] (key j at position j, any strides
    with a contiguous last dim; keys after a query's position are never used) -> [R, Qn, H, D]."""
    r, qn, h, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    pos = q_pos if q_pos.stride(-1) == 1 or qn == 1 else q_pos.contiguous()  # (an expand: row stride 0)
    out = torch.empty((r, qn, h, d), dtype=q.dtype, device=q.device)
    group = h // hkv
    up = _upcast(q)
    grid = (r * hkv, _cdiv(qn * group, ATTN_BLOCK_M))
    _attention_kernel[grid](
        q, k, v, pos, out, scale, qn, length, hkv, d,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), pos.stride(0), out.stride(0), out.stride(1), out.stride(2),
        GROUP=group, BM=ATTN_BLOCK_M, BN=ATTN_BLOCK_N, BD=_pow2(d), UPCAST=up, PREC="ieee" if up else "tf32",
        num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, causal: bool = False
) -> torch.Tensor:
    """The same attention as SDPA with the positions' mask (differentiable; the backward's formulation).
    `causal`: the caller's promise that q_pos is 0..Qn-1 in every row over Qn keys (the trainer's sequences):
    SDPA's causal flag instead of the mask (its flash kernel)."""
    g = q.shape[2] // k.shape[1]
    mask = None
    if not causal:
        mask = (torch.arange(k.shape[2], device=q.device)[None, None, :] <= q_pos[:, :, None])[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.repeat_interleave(g, 1),
        v.repeat_interleave(g, 1),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
    )
    return out.transpose(1, 2)


class _Recomputed(torch.autograd.Function):
    """Forward: `kernel(*inputs)`; backward: autograd through `reference(*inputs)` recomputed (the gradient of
    the same function; its forward values are not kept)."""

    @staticmethod
    def forward(ctx: Any, kernel: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                *inputs: torch.Tensor) -> torch.Tensor:  # fmt: skip
        ctx.reference = reference
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:],
                                                                       strict=True)]  # fmt: skip
        wanted = [t for t in inputs if t.requires_grad]
        with torch.enable_grad():
            out = ctx.reference(*inputs)
        got = iter(torch.autograd.grad(out, wanted, grads[0]) if wanted else ())
        return None, None, *(next(got) if t.requires_grad else None for t in inputs)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, causal: bool = False
) -> torch.Tensor:
    """exact.attention on the GPU (same contract), differentiable in q, k and v (`causal`: see attention_ref;
    it only picks the backward's formulation, the forward values are the kernel's either way)."""
    if not (q.requires_grad or k.requires_grad or v.requires_grad):
        return attention_kernel(q, k, v, q_pos, scale)

    def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_kernel(q, k, v, q_pos, scale)

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attention_ref(q, k, v, q_pos, scale, causal)

    return _Recomputed.apply(kernel, reference, q, k, v)


# -------------------------------------------------------------------------------------------- rotary
@_jit()
def _rope_kernel(
    x_ptr, pos_ptr, cos_ptr, sin_ptr, o_ptr, n_heads, half, sxt, sxh, spt, sct,
    BH: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)  # one token, all its heads
    h, i = tl.arange(0, BH), tl.arange(0, BD)
    m = (h < n_heads)[:, None] & (i < half)[None, :]
    p = tl.load(pos_ptr + t * spt)
    src = x_ptr + t * sxt + h[:, None] * sxh + i[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
    im = i < half
    c1 = tl.load(cos_ptr + p * sct + i, mask=im, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + p * sct + half + i, mask=im, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + p * sct + i, mask=im, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + p * sct + half + i, mask=im, other=0.0)[None, :]
    dst = o_ptr + (t * n_heads + h[:, None]) * 2 * half + i[None, :]
    tl.store(dst, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=m)
    tl.store(dst + half, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=m)


def rope_ref(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary in fp32, cast back: x [R, Qn, heads, D] at positions pos [R, Qn], fp32 tables [max_len, D]."""
    c, s = cos[pos][:, :, None], sin[pos][:, :, None]
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * c + rot * s).to(x.dtype)


def _rope_rows(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r, qn, heads, d = x.shape
    x3 = x.reshape(r * qn, heads, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    p = pos.reshape(-1)
    out = torch.empty((r, qn, heads, d), dtype=x.dtype, device=x.device)
    _rope_kernel[(r * qn,)](
        x3, p, cos, sin, out, heads, d // 2, x3.stride(0), x3.stride(1), p.stride(0), cos.stride(0),
        BH=_pow2(heads, 1), BD=_pow2(d // 2, 1), num_warps=1 if heads * d <= 1024 else 4,
    )  # fmt: skip
    return out


def rope(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rope_ref as one elementwise kernel (per token: no reduction, so batch-invariant as it stands; the
    rounding is the kernel's own, the same on both sides), differentiable in x."""
    if not x.requires_grad:
        return _rope_rows(x, pos, cos, sin)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return _rope_rows(x, pos, cos, sin)

    def reference(x: torch.Tensor) -> torch.Tensor:
        return rope_ref(x, pos, cos, sin)

    return _Recomputed.apply(kernel, reference, x)


# ------------------------------------------------------------------------------------------- RMSNorm
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (exact.rms_norm's torch path): normalise in fp32, cast back, times the weight."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """exact.rms_norm on the GPU: one program per row (kernels.rms_norm), weight cast to x's dtype;
    differentiable in x and the weight."""
    w = weight.to(x.dtype)
    kernel = functools.partial(_norm_rows, eps=eps)
    if not (x.requires_grad or w.requires_grad):
        return kernel(x, w)
    return _Recomputed.apply(kernel, functools.partial(rms_norm_ref, eps=eps), x, w)


def _norm_rows(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_kernel(x.contiguous(), w.contiguous(), eps)[0]
