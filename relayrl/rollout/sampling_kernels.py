# pyright: reportInvalidTypeForm=false
# (a kernel's `tl.constexpr` parameter annotations are markers for Triton's compiler, not types)
"""The one-GPU sampler (sampling.sample_tokens, modes "greedy" and "sample") as one Triton kernel.

    tok, logprob, ok = sample_rows(logits [B, V], temperature [B], u [B], greedy_only)

The same rule as sampling.sample_tokens_ref (sampling.py's module doc), computed in one read of the row
instead of ~8 full-width fp32 passes (a [B, V] fp32 copy, log_softmax, exp, cumsum, compare, gather): at a
7B decode step (B 256, V 151,936) the torch sampler took ~0.8 ms of GPU time, mostly memory traffic.

One program per row, over blocks of BLOCK entries in vocabulary order:
  pass 1 (the whole row, once): x = logits.float() / T (IEEE division, as torch's; T = 1 for greedy rows),
      per block its max m_c and s_c = sum exp(x - m_c), and the row's first argmax (torch.argmax's rule:
      the first maximum in a block, a later block only when strictly larger);
  combine: M = max m_c, block masses w_c = s_c exp(m_c - M), their running ends E_c, Z = E_last,
      log-prob of token j: (x_j - M) - log Z (log_softmax's order of operations);
  search (sampled rows, one block re-read): target = u Z; the block b = #{c: E_c <= target} (the first block
      whose end passes the target, clamped to the last), then the count of j in that block with
      E_(b-1) + cumsum(exp(x - M))_j <= target: the first index whose running sum exceeds u * total.
Temperature-0 rows take the argmax. Only sums are regrouped (per block, then over blocks) against the
reference's one fp32 cumsum, so a token can differ only where u * total lands within fp32 rounding (~1e-6
relative of the total) of a CDF boundary, and log-probs agree to ~1e-6 (tests/rollout/test_sampling_fast.py
states the bounds). Static shapes, no host sync: captured in the engine's CUDA graphs; it compiles on the
first call (the warm-up before each capture). On a CPU it runs in Triton's interpreter (the tests).
"""

from __future__ import annotations

import torch

from relayrl.rollout.kernels import _jit, _pow2, tl

BLOCK = 4096
"""Vocabulary entries per block (151,936 -> 38 blocks: the per-block statistics stay in registers)."""
MAX_BLOCKS = 1024
"""Blocks per row the kernel holds (a vocabulary of up to 4M entries)."""


@_jit
def _sample_kernel(
    x_ptr, t_ptr, u_ptr, tok_ptr, lp_ptr, n, sx, n_blocks,
    GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * sx
    offs = tl.arange(0, BLOCK)
    bidx = tl.arange(0, NB)
    t = tl.load(t_ptr + row)
    t = tl.where(
        t <= 0, 1.0, t
    )  # (unused when GREEDY_ONLY: no division at all, as the reference's greedy mode)
    bmax = tl.full([NB], float("-inf"), dtype=tl.float32)
    bsum = tl.zeros([NB], dtype=tl.float32)
    best = float("-inf")
    best_i = 0
    for c in range(0, n_blocks):
        cols = c * BLOCK + offs
        x = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
        if not GREEDY_ONLY:
            x = tl.math.div_rn(x, t)  # torch's logits / T: an IEEE division
        cm = tl.max(x, 0)
        ci = tl.argmax(x, 0, tie_break_left=True)
        e = tl.exp(x - tl.where(cm == float("-inf"), 0.0, cm))  # an all -inf block has no mass
        bmax = tl.where(bidx == c, cm, bmax)
        bsum = tl.where(bidx == c, tl.sum(e, 0), bsum)
        upd = cm > best  # pyright: ignore[reportOperatorIssue]
        best_i = tl.where(upd, c * BLOCK + ci, best_i)
        best = tl.where(upd, cm, best)
    mass = bsum * tl.exp(bmax - best)  # unused blocks: 0 * exp(-inf) = 0
    ends = tl.cumsum(mass, 0)
    total = tl.max(ends, 0)  # the last end (the ends do not decrease)
    log_total = tl.log(total)
    tok = best_i
    if not GREEDY_ONLY:
        target = tl.load(u_ptr + row) * total
        blk = tl.minimum(tl.sum(((ends <= target) & (bidx < n_blocks)).to(tl.int32), 0), n_blocks - 1)
        before = tl.sum(tl.where(bidx == blk - 1, ends, 0.0), 0)
        cols = blk * BLOCK + offs
        inside = cols < n
        x = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32)
        run = before + tl.cumsum(tl.exp(tl.math.div_rn(x, t) - best), 0)
        count = blk * BLOCK + tl.sum(((run <= target) & inside).to(tl.int32), 0)
        count = tl.minimum(count, n - 1)
        tok = tl.where(tl.load(t_ptr + row) <= 0, best_i, count)
    x_tok = tl.load(base + tok).to(tl.float32)
    if not GREEDY_ONLY:
        x_tok = tl.math.div_rn(x_tok, t)
    tl.store(tok_ptr + row, tok.to(tl.int64))  # pyright: ignore[reportAttributeAccessIssue]
    tl.store(lp_ptr + row, (x_tok - best) - log_total)


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, greedy_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] int64, logprob [B] fp32) of each row of logits [B, V] (any float dtype, unit stride along
    V) with its temperature [B] (<= 0: argmax) and uniform u [B]: the module doc's kernel. `greedy_only`: every
    row is argmax (temperature and u are not used)."""
    b, n = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_blocks = -(-n // BLOCK)
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"sampling kernel: vocabulary {n} > {MAX_BLOCKS * BLOCK} entries")
    tok = torch.empty(b, dtype=torch.long, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b:
        temp = temperature.to(torch.float32).contiguous()
        uu = u.to(torch.float32).contiguous()
        _sample_kernel[(b,)](
            logits, temp, uu, tok, lp, n, logits.stride(0), n_blocks,
            GREEDY_ONLY=greedy_only, BLOCK=BLOCK, NB=_pow2(n_blocks, 16), num_warps=8,
        )  # fmt: skip
    return tok, lp
