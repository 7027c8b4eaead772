# pyright: reportInvalidTypeForm=false
# (a kernel's `tl.constexpr` parameter annotations are markers for Triton's compiler, not types)
"""Fused Triton kernels for the native engine's decode step, each beside the torch code it replaces.

The decode step of a 7B model at batch 256 spent a quarter of its time in small elementwise kernels and a
sixth in attention over padded KV buckets (docs/rollout.md, "Fused decode kernels"). Four kernels replace them:

    rms_norm(x, weight, eps, residual)   residual add + RMSNorm in one pass: (normed, x + residual)
    silu_mul(gate, up)                   SiLU(gate) * up, reading the fused [gate; up] GEMM output in place
    rope_kv_write(q, k, v, cos, sin, pos, k_cache, v_cache)
                                         rotary embedding of q and k, K and V written into the cache at pos;
                                         returns the rotated q
    decode_attention(q, k_cache, v_cache, pos, scale, kv_len)
                                         one query token per slot over cache positions [0, pos] only
                                         (split-K flash-decoding: the KV range is cut into `splits` chunks
                                         when slots x KV heads alone would leave SMs idle, then combined)

Each has a torch reference (`*_ref`) with the engine's own math (native_model.py), which the tests compare
against. Rounding follows the torch code step by step in the model dtype (HF's RMSNorm: normalise in fp32,
cast, times the weight; SiLU rounded before the product; each rotary product rounded before the sum), so
rms_norm, silu_mul and rope_kv_write match bf16 torch to 1 bf16 ulp (exp / rsqrt approximations may move a
rounding) and fp32 to 1e-6; attention keeps an fp32 online softmax with the probabilities cast to the
model dtype before the PV product (as flash attention does), within bf16 rounding of SDPA.

All shapes are static for a fixed (batch, kv bucket) and nothing syncs with the host (lengths are read from
`pos` on the device), so the kernels are captured in the engine's CUDA graphs (no autotuning: fixed configs;
they compile in the warm-up run before each capture). Where they run: `usable(device)` (triton importable,
and a CUDA device, or TRITON_INTERPRET=1, which the CPU tests set: Triton's interpreter then runs them).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

try:
    import triton  # pyright: ignore[reportMissingImports] (optional: the GPU image has it)
    import triton.language as tl  # pyright: ignore[reportMissingImports]
except ImportError:  # no triton: usable() is False and no kernel is ever launched
    triton = None
    tl: Any = None


def _jit(fn: Any) -> Any:
    return triton.jit(fn) if triton is not None else fn


def usable(device: torch.device) -> bool:
    """True when the kernels can run on `device`: triton imports and the device is CUDA (or Triton's CPU
    interpreter is on: TRITON_INTERPRET=1)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


# ------------------------------------------------------------------------------------- residual + RMSNorm
@_jit
def _add_rms_norm(
    x, r_ptr, w_ptr, res_ptr, row, cols, m, n_cols, eps, sr, sres, HAS_RES: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """Row `row` of the delta x (loaded, 0 past n_cols) -> RMSNorm(s) * weight in fp32, not yet rounded, with s =
    x + residual rounded to the model dtype (res_ptr's) and stored at res_ptr (HAS_RES; else s = x). Shared by
    `_rms_norm_kernel` and fp8_kernels.py's norm + quantiser."""
    if HAS_RES:  # the residual stream in the model dtype, as `x = x + delta` rounds it
        r = tl.load(r_ptr + row * sr + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * sres + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = xf * rstd
    if ROUND:  # HF: weight * normed.to(dtype), the product in the model dtype
        y = y.to(res_ptr.dtype.element_ty).to(tl.float32)
    return y * w


@_jit
def _rms_norm_kernel(
    x_ptr, r_ptr, w_ptr, out_ptr, res_ptr, n_cols, eps, sx, sr, so, sres,
    HAS_RES: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n_cols
    x = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0)
    y = _add_rms_norm(x, r_ptr, w_ptr, res_ptr, row, cols, m, n_cols, eps, sr, sres, HAS_RES, ROUND)
    tl.store(out_ptr + row * so + cols, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(s) * weight, s) with s = x + residual (or x): one read and one write of the hidden state."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(x2)
    res = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, x.shape[-1]) if residual is not None else x2
    n = x2.shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, res, n, eps, x2.stride(0), r2.stride(0), out.stride(0), res.stride(0),
        HAS_RES=residual is not None, ROUND=x.dtype != torch.float32, BLOCK=_pow2(n),
        num_warps=8 if n >= 2048 else 4,
    )  # fmt: skip
    return out.view(x.shape), res.view(x.shape)


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's torch path (native_model._norm_fn after `x = x + residual`)."""
    s = x + residual if residual is not None else x
    if s.dtype == torch.float32:
        return torch.nn.functional.rms_norm(s, weight.shape, weight, eps), s
    return weight * torch.nn.functional.rms_norm(s.float(), weight.shape, eps=eps).to(s.dtype), s


# ------------------------------------------------------------------------------------------ SiLU(gate) * up
@_jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n_cols, sg, su, so, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < n_cols
    g = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu, rounded as torch's
    tl.store(out_ptr + row * so + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up; gate and up may be column slices of one [.., 2I] tensor (the fused GEMM's output)."""
    n = gate.shape[-1]
    g2, u2 = gate.flatten(0, -2) if gate.dim() > 2 else gate, up.flatten(0, -2) if up.dim() > 2 else up
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        g2, u2 = g2.contiguous(), u2.contiguous()
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, _pow2(n))
    _silu_mul_kernel[(g2.shape[0], -(-n // block))](
        g2, u2, out, n, g2.stride(0), u2.stride(0), out.stride(0), BLOCK=block, num_warps=4
    )
    return out.view(*gate.shape)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The engine's torch path (native_model._mlp_fn): silu in the model dtype, then the product."""
    h = torch.nn.functional.silu(gate)
    h *= up
    return h


# ------------------------------------------------------------------------------- rotary + KV-cache write
@_jit
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr,
    sqb, sqh, skb, skh, svb, svh, sct, scb, sch, scp, n_heads, n_kv, half,
    BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + b)
    i = tl.arange(0, BLOCK)
    m = i < half
    if h < n_heads + n_kv:  # q or k: x * cos + roll(x) * signed_sin, each product rounded as torch's
        if h < n_heads:
            src = q_ptr + b * sqb + h * sqh
        else:
            src = k_ptr + b * skb + (h - n_heads) * skh
        x1 = tl.load(src + i, mask=m, other=0.0)
        x2 = tl.load(src + half + i, mask=m, other=0.0)
        dt = x1.dtype
        c1 = tl.load(cos_ptr + p * sct + i, mask=m, other=0.0)
        c2 = tl.load(cos_ptr + p * sct + half + i, mask=m, other=0.0)
        s1 = tl.load(sin_ptr + p * sct + i, mask=m, other=0.0)
        s2 = tl.load(sin_ptr + p * sct + half + i, mask=m, other=0.0)
        o1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s1).to(dt).to(tl.float32)
        o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        if h < n_heads:
            dst = qo_ptr + (b * n_heads + h) * 2 * half
        else:
            dst = kc_ptr + b * scb + (h - n_heads) * sch + p * scp
        tl.store(dst + i, o1.to(dt), mask=m)
        tl.store(dst + half + i, o2.to(dt), mask=m)
    else:  # v: copied into the cache
        src = v_ptr + b * svb + (h - n_heads - n_kv) * svh
        dst = vc_ptr + b * scb + (h - n_heads - n_kv) * sch + p * scp
        tl.store(dst + i, tl.load(src + i, mask=m), mask=m)
        tl.store(dst + half + i, tl.load(src + half + i, mask=m), mask=m)


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """q [bs, H, D], k/v [bs, Hkv, D] (any row strides, last dim contiguous) of slots [0, bs) at positions
    pos [bs]; cos / signed sin [max_len, D] (native_model.DecoderRunner._rope_table); one layer's caches
    [slots, Hkv, max_len, D]. Writes rotated k and v at [b, :, pos[b]]; returns rotated q [bs, H, D]."""
    bs, n_heads, d = q.shape
    n_kv = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and k_cache.stride(-1) == 1 and d % 2 == 0
    q_out = torch.empty((bs, n_heads, d), dtype=q.dtype, device=q.device)
    _rope_kv_kernel[(bs, n_heads + 2 * n_kv)](
        q, k, v, cos, sin, pos, q_out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), n_heads, n_kv, d // 2,
        BLOCK=_pow2(d // 2), num_warps=1,
    )  # fmt: skip
    return q_out


def rope_kv_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """The engine's torch path (native_model.DecoderRunner.decode): one rotary pass over cat(q, k), then the
    cache writes."""
    bs, n_heads, d = q.shape
    c, s = cos[pos][:, None], sin[pos][:, None]
    x = torch.cat((q, k), dim=1)
    x = x * c + x.roll(d // 2, -1) * s
    rows = torch.arange(bs, device=q.device)
    k_cache[rows, :, pos] = x[:, n_heads:]
    v_cache[rows, :, pos] = v
    return x[:, :n_heads]


# ----------------------------------------------------------------------------- attention over [0, pos]
@_jit
def _decode_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, pos_ptr, o_ptr, ml_ptr, acc_ptr, scale, sqb, sqh, scb, sch, scp, sob, soh,
    head_dim, n_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(pos_ptr + b) + 1
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, length)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm, dm = g < GROUP, d < head_dim
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * sqb + heads[:, None] * sqh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0
    )
    if UPCAST:  # fp32 models, and Triton's CPU interpreter (its low-precision dot is not reliable)
        q = q.to(tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    k_base = kc_ptr + b * scb + kvh * sch
    v_base = vc_ptr + b * scb + kvh * sch
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        nm = n < hi
        kv_off = n[:, None] * scp + d[None, :]
        kv_m = nm[:, None] & dm[None, :]
        k = tl.load(k_base + kv_off, mask=kv_m, other=0.0)
        v = tl.load(v_base + kv_off, mask=kv_m, other=0.0)
        p_dt = v.dtype
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(p_dt)  # flash attention's rounding of the probabilities before the PV product
        if UPCAST:
            p = p.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new
    om = gm[:, None] & dm[None, :]
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(o_ptr + b * sob + heads[:, None] * soh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=om)
    else:  # partial (max, sum, acc) per split; _attention_combine_kernel merges them
        part = (b * n_heads + heads) * SPLITS + sp
        tl.store(ml_ptr + part * 2, m_i, mask=gm)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=gm)
        tl.store(acc_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=om)


@_jit
def _attention_combine_kernel(
    ml_ptr, acc_ptr, o_ptr, sob, soh, head_dim, n_heads, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    part = (b * n_heads + h) * SPLITS + s
    m = tl.load(ml_ptr + part * 2)
    l_s = tl.load(ml_ptr + part * 2 + 1)
    w = tl.exp(m - tl.max(m, 0))  # an empty split has m = -inf: weight 0 (split 0 always holds position 0)
    acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    tl.store(o_ptr + b * sob + h * soh + d, out.to(o_ptr.dtype.element_ty), mask=d < head_dim)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def attention_splits(batch: int, kv_heads: int, kv_len: int, device: torch.device) -> int:
    """KV chunks per (slot, KV head): enough programs for two waves over the SMs, each chunk >= 128 keys."""
    sms = _sm_count(device)
    splits = 1
    while splits < 16 and batch * kv_heads * splits < 2 * sms and kv_len >= 256 * splits:
        splits *= 2
    return splits


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    kv_len: int,
    splits: int | None = None,
) -> torch.Tensor:
    """Slot b's query q[b] [H, D] over its cache k/v_cache[b] [Hkv, max_len, D] at positions [0, pos[b]] (GQA:
    H / Hkv query heads per KV head); `kv_len` (the step's bucket) only sizes the split; returns [bs, H, D]."""
    bs, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    group = n_heads // n_kv
    splits = splits or attention_splits(bs, n_kv, kv_len, q.device)
    out = torch.empty((bs, n_heads, d), dtype=q.dtype, device=q.device)
    block_d = _pow2(d, 16)
    ml = torch.empty((bs * n_heads * splits * 2 if splits > 1 else 1,), dtype=torch.float32, device=q.device)
    acc = torch.empty((bs * n_heads * splits * block_d if splits > 1 else 1,), dtype=torch.float32,
                      device=q.device)  # fmt: skip
    upcast = q.dtype == torch.float32 or q.device.type == "cpu"
    _decode_attention_kernel[(bs, n_kv, splits)](
        q, k_cache, v_cache, pos, out, ml, acc, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0), out.stride(1), d, n_heads,
        GROUP=group, BLOCK_G=_pow2(group, 16), BLOCK_D=block_d, BLOCK_N=64, SPLITS=splits, UPCAST=upcast,
        PREC="ieee" if upcast else "tf32",  # fp32 operands: exact products (tf32 is ignored for bf16 / fp16)
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _attention_combine_kernel[(bs, n_heads)](
            ml,
            acc,
            out,
            out.stride(0),
            out.stride(1),
            d,
            n_heads,
            SPLITS=splits,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    kv_len: int,
) -> torch.Tensor:
    """Masked attention over the whole bucket [0, kv_len) in fp32 (positions > pos hidden)."""
    bs, n_heads, _ = q.shape
    n_kv = k_cache.shape[1]
    k = k_cache[:bs, :, :kv_len].float().repeat_interleave(n_heads // n_kv, 1)
    v = v_cache[:bs, :, :kv_len].float().repeat_interleave(n_heads // n_kv, 1)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), k) * scale
    hidden = torch.arange(kv_len, device=q.device)[None, None, :] > pos[:, None, None]
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    return torch.einsum("bht,bhtd->bhd", probs, v).to(q.dtype)
