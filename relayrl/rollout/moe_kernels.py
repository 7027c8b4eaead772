# pyright: reportInvalidTypeForm=false
# (a kernel's `tl.constexpr` parameter annotations are markers for Triton's compiler, not types)
"""Fused Triton kernels for the routed experts of a mixture-of-experts layer at decode (small token counts).

At decode the grouped path (native_moe._grouped) spends most of a layer in small kernels: a stable argsort of
the N k (token, expert) pairs, counts, offsets, a gather of x, two grouped GEMMs, SiLU and the product, casts,
the weights' gather, the inverse permutation and the sum over k (about 20 launches a layer, each with a floor
of a few microseconds, and CUTLASS's grouped GEMM reading the experts' weights at well under the card's
bandwidth when each expert holds a handful of tokens). Here three kernels do it, with no sort at all:

    fused_experts(x [N, H], idx [N, k], weights fp32 [N, k], gate_up [E, 2I, H], down [E, H, I])
      1. _gate_up_kernel   program (expert e, column block n of I): finds e's pairs itself (the positions of e
                           in idx, in order: a cumulative sum over the N k ids, which sit in L2), then for
                           each chunk of BLOCK_M of them gathers their rows of x and multiplies them by e's gate
                           AND up tiles (one read of each weight tile per chunk; experts with no token return at
                           once); writes SiLU(gate) * up [N k, I] at each pair's row
      2. _down_kernel      the same over the hidden columns, down-projecting those rows: y [N k, H]
      3. _combine_kernel   out[t] = sum_j weights[t, j] * y[t k + j] in fp32, j in order (no atomics), one cast
    select_experts(logits fp32 [N, E], top_k, normalize) -> (weights fp32 [N, k], idx long [N, k])
                           softmax + top-k + renormalisation in one kernel (a program per token)

The grid is static ((E, column blocks): a step with them is captured in a CUDA graph; nothing syncs with the
host) and each weight tile is read once per chunk of BLOCK_M tokens of its expert: the standard "fused MoE"
design (vLLM's fused_moe, SGLang's), without the separate alignment kernel (each program finds its pairs).

Rounding follows the torch path (native_moe._grouped) step by step: the GEMM outputs rounded to the model dtype,
SiLU rounded before the product, the weighted sum over k in fp32, one cast at the end; the GEMMs' own
summation order differs (bf16: within a bf16 ulp of each product; fp32: ~1e-6). The top-k picks the largest
probabilities, ties to the lower expert id (torch.topk leaves ties unspecified); its softmax's exp and sum
differ from torch's by fp32 rounding, so weights agree to ~1e-7 and the chosen experts are torch's except
where two probabilities are equal to the last bit.

Used by native_moe.MoEForward at decode when the engine's fused kernels are on (`usable`, kernels.py) and
`fits` (at most MAX_PAIRS pairs; prefill keeps the grouped GEMMs, which suit many tokens per expert).
"""

from __future__ import annotations

from typing import Any

import torch

from relayrl.rollout.kernels import usable

try:
    import triton  # pyright: ignore[reportMissingImports] (optional: the GPU image has it)
    import triton.language as tl  # pyright: ignore[reportMissingImports]
except ImportError:  # no triton: usable() is False and no kernel is ever launched
    triton = None
    tl: Any = None

__all__ = ["CONFIG", "MAX_PAIRS", "fits", "fused_experts", "select_experts", "supports", "usable"]

MAX_PAIRS = 4096
"""Most (token, expert) pairs a call runs through the kernels (each program scans all pair ids); larger calls
(prefill) use the grouped GEMMs."""

CONFIG: dict[str, dict[str, int]] = {
    "gate_up": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3),
    "down": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    "scan": dict(CHUNK=256),
}
"""Tile sizes and launch settings of the two GEMM kernels (fixed: no autotuning inside a captured graph;
bench/moe.py --sweep times others; BLOCK_N of gate_up counts columns of each of gate and up), and how many
pair ids a program scans at a time to find its expert's pairs."""


def _jit(fn: Any) -> Any:
    return triton.jit(fn) if triton is not None else fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


def supports(experts: Any) -> bool:
    """The experts module's activation is SiLU (the kernels hard-code SiLU(gate) * up) and its weights are the
    3-D layout (native_moe.is_sparse_block) with contiguous rows."""
    act = type(getattr(experts, "act_fn", None)).__name__
    w1, w2 = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor)):
        return False
    return act in ("SiLU", "SiLUActivation") and w1.stride(-1) == 1 and w2.stride(-1) == 1


def fits(x: torch.Tensor, gate_up: torch.Tensor, top_k: int) -> bool:
    """The kernels run this call: few enough pairs, x and the weights in one dtype, on a device they run on."""
    return (
        x.shape[0] * top_k <= MAX_PAIRS
        and x.dtype == gate_up.dtype
        and not torch.is_autocast_enabled(x.device.type)
        and usable(x.device)
    )


# ------------------------------------------------------------------------------- an expert's pairs
@_jit
def _expert_count(idx_ptr, n_pairs, e, CHUNK: tl.constexpr):
    """How many of the flat expert ids [n_pairs] are e."""
    count = tl.full([], 0, tl.int32)
    for c in range(0, n_pairs, CHUNK):
        p = c + tl.arange(0, CHUNK)
        count += tl.sum((tl.load(idx_ptr + p, mask=p < n_pairs, other=-1) == e).to(tl.int32), 0)
    return count


@_jit
def _expert_pairs(idx_ptr, n_pairs, e, start, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """(pair ids [BLOCK_M], valid [BLOCK_M]): expert e's pairs number start .. start + BLOCK_M - 1, in pair
    order, among the flat expert ids [n_pairs] (read CHUNK at a time: registers stay [BLOCK_M, CHUNK])."""
    r = start + tl.arange(0, BLOCK_M)
    pair = tl.zeros((BLOCK_M,), tl.int32)
    found = tl.zeros((BLOCK_M,), tl.int32)
    before = tl.full([], 0, tl.int32)  # e's pairs in earlier chunks
    for c in range(0, n_pairs, CHUNK):
        p = c + tl.arange(0, CHUNK)
        hit = (tl.load(idx_ptr + p, mask=p < n_pairs, other=-1) == e).to(tl.int32)
        rank = before + tl.cumsum(hit, 0) - 1
        sel = (hit[None, :] > 0) & (rank[None, :] == r[:, None])
        pair += tl.sum(tl.where(sel, p[None, :], 0), 1)
        found += tl.sum(sel.to(tl.int32), 1)
        before += tl.sum(hit, 0)
    return pair, found > 0


# ----------------------------------------------------------------- 1. SiLU(x W_gate^T) * (x W_up^T)
@_jit
def _gate_up_kernel(
    x_ptr, idx_ptr, w_ptr, h_ptr, n_pairs, hidden, inter, sx, swe, swn, sh,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    count = _expert_count(idx_ptr, n_pairs, e, CHUNK)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < inter
    w_e = w_ptr + e.to(tl.int64) * swe
    for start in range(0, count, BLOCK_M):
        pair, valid = _expert_pairs(idx_ptr, n_pairs, e, start, BLOCK_M, CHUNK)
        tok = (pair // TOP_K).to(tl.int64)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < hidden
            a = tl.load(x_ptr + tok[:, None] * sx + k[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            wm = km[:, None] & nm[None, :]
            bg = tl.load(w_e + n[None, :] * swn + k[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
            bu = tl.load(w_e + (n + inter)[None, :] * swn + k[:, None], mask=wm, other=0.0)
            if UPCAST:
                a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PREC)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PREC)
        dt = h_ptr.dtype.element_ty
        g = acc_g.to(dt).to(tl.float32)  # the GEMM output in the model dtype, as grouped_mm returns it
        u = acc_u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # silu, rounded as torch's
        out = h_ptr + pair.to(tl.int64)[:, None] * sh + n[None, :]
        tl.store(out, (s * u).to(dt), mask=valid[:, None] & nm[None, :])


# ------------------------------------------------------------------------------------- 2. h W_down^T
@_jit
def _down_kernel(
    h_ptr, idx_ptr, w_ptr, y_ptr, n_pairs, hidden, inter, sh, swe, swn, sy,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0)
    count = _expert_count(idx_ptr, n_pairs, e, CHUNK)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < hidden
    w_e = w_ptr + e.to(tl.int64) * swe
    for start in range(0, count, BLOCK_M):
        pair, valid = _expert_pairs(idx_ptr, n_pairs, e, start, BLOCK_M, CHUNK)
        rows = pair.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < inter
            a = tl.load(h_ptr + rows[:, None] * sh + k[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            b = tl.load(w_e + n[None, :] * swn + k[:, None], mask=km[:, None] & nm[None, :], other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        tl.store(y_ptr + rows[:, None] * sy + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=valid[:, None] & nm[None, :])  # fmt: skip


# ------------------------------------------------------------------------------- 3. weighted sum over k
@_jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, hidden, sy, so, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):  # in order: the torch path's sum over k
        w = tl.load(w_ptr + t * TOP_K + j)
        acc += w * tl.load(y_ptr + (t * TOP_K + j) * sy + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * so + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def _rows_per_tile(cfg: dict[str, int], mean_pairs: float, auto: bool) -> dict[str, int]:
    """The default BLOCK_M (16) while experts hold <= 8 pairs on average (decode up to ~128 slots at 8 of 128
    experts); 32 / 64 above (fewer re-reads of a weight tile per expert); an explicit config is kept."""
    if not auto or mean_pairs <= 8:
        return cfg
    return {**cfg, "BLOCK_M": 32 if mean_pairs <= 24 else 64}


def fused_experts(
    x: torch.Tensor,
    idx: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    config: dict[str, dict[str, int]] | None = None,
) -> torch.Tensor:
    """sum_j weights[:, j] * expert_{idx[:, j]}(x), expert(x) = down(SiLU(gate x) * up x), for x [N, H]; gate_up
    [E, 2I, H] (gate rows first), down [E, H, I]; returned in x's dtype (native_moe.experts_forward's math)."""
    cfg = config or CONFIG
    n_tok, hidden = x.shape
    top_k = idx.shape[1]
    n_exp, two_i, _ = gate_up.shape
    inter = two_i // 2
    assert x.stride(-1) == 1 and gate_up.stride(-1) == 1 and down.stride(-1) == 1
    n_pairs = n_tok * top_k
    ids = idx.reshape(-1)  # int64 (or int32) as the router gives it: no cast
    w = weights.reshape(-1).to(torch.float32).contiguous()
    h = torch.empty((n_pairs, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((n_pairs, hidden), dtype=x.dtype, device=x.device)
    out = torch.empty((n_tok, hidden), dtype=x.dtype, device=x.device)
    upcast = x.dtype == torch.float32 or x.device.type == "cpu"
    common = dict(
        CHUNK=min(cfg["scan"]["CHUNK"], _pow2(n_pairs, 16)), UPCAST=upcast, PREC="ieee" if upcast else "tf32"
    )
    c1, c2 = (_rows_per_tile(cfg[k], n_pairs / n_exp, config is None) for k in ("gate_up", "down"))
    _gate_up_kernel[(n_exp, _cdiv(inter, c1["BLOCK_N"]))](
        x, ids, gate_up, h, n_pairs, hidden, inter, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        h.stride(0), TOP_K=top_k, **common, **c1,
    )  # fmt: skip
    _down_kernel[(n_exp, _cdiv(hidden, c2["BLOCK_N"]))](
        h, ids, down, y, n_pairs, hidden, inter, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        **common, **c2,
    )  # fmt: skip
    block = min(1024, _pow2(hidden))
    _combine_kernel[(n_tok, _cdiv(hidden, block))](
        y, w, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out


# ------------------------------------------------------------------------ softmax + top-k + renormalise
@_jit
def _select_kernel(
    logits_ptr, w_ptr, idx_ptr, n_exp, sl,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    em = e < n_exp
    logit = tl.load(logits_ptr + t * sl + e, mask=em, other=float("-inf"))
    z = tl.exp(logit - tl.max(logit, 0))
    left = tl.where(em, z / tl.sum(z, 0), -1.0)  # the probabilities; -1: no expert
    kk = tl.arange(0, BLOCK_K)
    ws = tl.zeros((BLOCK_K,), tl.float32)
    picks = tl.zeros((BLOCK_K,), tl.int32)
    for j in tl.static_range(TOP_K):  # largest first, ties to the lower id
        best = tl.max(left, 0)
        pick = tl.min(tl.where(left == best, e, BLOCK_E), 0)
        ws = tl.where(kk == j, best, ws)
        picks = tl.where(kk == j, pick, picks)
        left = tl.where(e == pick, -2.0, left)
    if NORMALIZE:
        ws = ws / tl.sum(ws, 0)
    km = kk < TOP_K
    tl.store(w_ptr + t * TOP_K + kk, ws, mask=km)
    tl.store(idx_ptr + t * TOP_K + kk, picks.to(tl.int64), mask=km)


def select_experts(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """native_moe.select_experts without forced routes, in one kernel: (weights fp32 [N, k], idx long [N, k])."""
    n_tok, n_exp = logits.shape
    weights = torch.empty((n_tok, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((n_tok, top_k), dtype=torch.long, device=logits.device)
    _select_kernel[(n_tok,)](
        logits, weights, idx, n_exp, logits.stride(0), TOP_K=top_k, NORMALIZE=normalize,
        BLOCK_E=_pow2(n_exp, 16), BLOCK_K=_pow2(top_k), num_warps=1 if n_exp <= 256 else 4,
    )  # fmt: skip
    return weights, idx
