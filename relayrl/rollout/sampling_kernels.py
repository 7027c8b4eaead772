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

The vocabulary-parallel sampler (vocab_parallel.sample_split, TP > 1: each rank holds the logits of a
contiguous slice [lo, lo + n) of the vocabulary) through the same two steps, `sample_shard`:
  `_shard_block_kernel`: pass 1 over the rank's slice, one program per (row, block) (`_block_stat`, the
      one-GPU kernel's block step; one program per row leaves the GPU's memory idle at B = 256);
  `_shard_stats_kernel`, one program per row: the blocks combined as above (the same values: the slice's
      max m_r, its first argmax, the block ends, s_r = sum exp(x - m_r)); the block ends and the argmax stay
      in scratch; (m_r, s_r) go into the rank's row of stats [TP, B, 2], zeros into the others';
  one all-reduce (sum) of stats: every rank holds every rank's (m_r, s_r), bit for bit the same;
  `_shard_pick_kernel`: every rank combines them as sample_split's torch ops do, in rank (= vocabulary)
      order: M = max m_r, rank masses s_r exp(m_r - M), their running ends, Z, target = u Z; the winner is
      the first rank whose end passes the target (clamped to the last rank with mass; greedy rows: the first
      rank holding M, torch.argmax's rule); the winner alone re-reads one block (`_block_search`, its target
      (target - its start) / exp(m_r - M) in its own units) and writes (lo + token, x_tok - M - log Z) into
      out [2, B], the other ranks zeros;
  a second all-reduce of out: every rank holds the token and its log-prob.
So a step reads each rank's slice once plus one block, in 3 kernels and 2 all-reduces of [TP, B, 2] and
[2, B] fp32 (the torch ops: ~15 kernels, several full-width fp32 passes). Tolerance as for the one-GPU
kernel: the sums are grouped per rank and per block of 4096 (the torch split: per rank and per block of 1024;
the one-GPU reference: one running sum), so a token differs only where u lands within fp32 rounding of a CDF
boundary, log-probs agree to ~1e-6 (tests/rollout/test_vocab_parallel_kernel.py, its GPU twin *_gpu.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relayrl.rollout.kernels import _jit, _pow2, tl

BLOCK = 4096
"""Vocabulary entries per block (151,936 -> 38 blocks: the per-block statistics stay in registers)."""
MAX_BLOCKS = 1024
"""Blocks per row the kernel holds (a vocabulary of up to 4M entries)."""


@_jit
def _block_stat(base, n, c, t, GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr):
    """Block c of a row: its max, the index (in the row) of its first maximum, and sum exp(x - max)."""
    cols = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    if not GREEDY_ONLY:
        x = tl.math.div_rn(x, t)  # torch's logits / T: an IEEE division
    cm = tl.max(x, 0)
    ci = tl.argmax(x, 0, tie_break_left=True)
    e = tl.exp(x - tl.where(cm == float("-inf"), 0.0, cm))  # an all -inf block has no mass
    return cm, c * BLOCK + ci, tl.sum(e, 0)


@_jit
def _row_blocks(base, n, n_blocks, t, GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr):
    """Pass 1 over one row (module doc): per block its max and sum of exp(x - block max) ([NB] each, unused
    blocks -inf / 0), and the row's first maximum and its index."""
    bidx = tl.arange(0, NB)
    bmax = tl.full([NB], float("-inf"), dtype=tl.float32)
    bsum = tl.zeros([NB], dtype=tl.float32)
    best = float("-inf")
    best_i = 0
    for c in range(0, n_blocks):
        cm, ci, cs = _block_stat(base, n, c, t, GREEDY_ONLY, BLOCK)
        bmax = tl.where(bidx == c, cm, bmax)
        bsum = tl.where(bidx == c, cs, bsum)
        upd = cm > best  # pyright: ignore[reportOperatorIssue]
        best_i = tl.where(upd, ci, best_i)
        best = tl.where(upd, cm, best)
    return bmax, bsum, best, best_i


@_jit
def _block_search(base, n, n_blocks, ends, target, t, shift, limit, BLOCK: tl.constexpr, NB: tl.constexpr):
    """The search (module doc): the number of j with running sum of exp(x / t - shift) <= target, clamped to
    n - 1, from the block ends [NB] (running sums at each block's end) and one re-read block; entries at and
    past `limit` are not read (limit n: all; 0: none, the result then meaningless)."""
    offs = tl.arange(0, BLOCK)
    bidx = tl.arange(0, NB)
    blk = tl.minimum(tl.sum(((ends <= target) & (bidx < n_blocks)).to(tl.int32), 0), n_blocks - 1)
    before = tl.sum(tl.where(bidx == blk - 1, ends, 0.0), 0)
    cols = blk * BLOCK + offs
    inside = cols < n
    x = tl.load(base + cols, mask=cols < limit, other=float("-inf")).to(tl.float32)
    run = before + tl.cumsum(tl.exp(tl.math.div_rn(x, t) - shift), 0)
    count = blk * BLOCK + tl.sum(((run <= target) & inside).to(tl.int32), 0)
    return tl.minimum(count, n - 1)


@_jit
def _sample_kernel(
    x_ptr, t_ptr, u_ptr, tok_ptr, lp_ptr, n, sx, n_blocks,
    GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * sx
    t = tl.load(t_ptr + row)
    t = tl.where(
        t <= 0, 1.0, t
    )  # (unused when GREEDY_ONLY: no division at all, as the reference's greedy mode)
    bmax, bsum, best, best_i = _row_blocks(base, n, n_blocks, t, GREEDY_ONLY, BLOCK, NB)
    mass = bsum * tl.exp(bmax - best)  # unused blocks: 0 * exp(-inf) = 0
    ends = tl.cumsum(mass, 0)
    total = tl.max(ends, 0)  # the last end (the ends do not decrease)
    log_total = tl.log(total)
    tok = best_i
    if not GREEDY_ONLY:
        target = tl.load(u_ptr + row) * total
        count = _block_search(base, n, n_blocks, ends, target, t, best, n, BLOCK, NB)
        tok = tl.where(tl.load(t_ptr + row) <= 0, best_i, count)
    x_tok = tl.load(base + tok).to(tl.float32)
    if not GREEDY_ONLY:
        x_tok = tl.math.div_rn(x_tok, t)
    tl.store(tok_ptr + row, tok.to(tl.int64))  # pyright: ignore[reportAttributeAccessIssue]
    tl.store(lp_ptr + row, (x_tok - best) - log_total)


def _kernel_rows(logits: torch.Tensor, what: str) -> tuple[torch.Tensor, int]:
    """`logits` [B, n] with unit stride along n (a copy only when it has none) and its BLOCK count; a row longer
    than MAX_BLOCKS blocks is refused naming `what`."""
    n = logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_blocks = -(-n // BLOCK)
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"sampling kernel: {what} {n} > {MAX_BLOCKS * BLOCK} entries")
    return logits, n_blocks


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, greedy_only: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [B] int64, logprob [B] fp32) of each row of logits [B, V] (any float dtype, unit stride along
    V) with its temperature [B] (<= 0: argmax) and uniform u [B]: the module doc's kernel. `greedy_only`: every
    row is argmax (temperature and u are not used)."""
    logits, n_blocks = _kernel_rows(logits, "vocabulary")
    b, n = logits.shape
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


# ------------------------------------------------------------------ the vocabulary-parallel sampler's passes
@_jit
def _shard_block_kernel(
    x_ptr, t_ptr, bmax_ptr, bsum_ptr, barg_ptr, n, sx,
    GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """Pass 1, one program per (row, block) of this rank's slice (a row alone in one program left the GPU's
    memory idle: B = 256 programs): the block's `_block_stat` into [B, NB] scratch."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(t_ptr + row)
    t = tl.where(t <= 0, 1.0, t)
    cm, ci, cs = _block_stat(x_ptr + row * sx, n, c, t, GREEDY_ONLY, BLOCK)
    tl.store(bmax_ptr + row * NB + c, cm)
    tl.store(bsum_ptr + row * NB + c, cs)
    tl.store(barg_ptr + row * NB + c, ci)


@_jit
def _shard_stats_kernel(
    bmax_ptr, bsum_ptr, barg_ptr, stats_ptr, ends_ptr, arg_ptr, n_blocks, b, rank,
    SIZE: tl.constexpr, GREEDY_ONLY: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """The slice's blocks combined as `_row_blocks` + `_sample_kernel` combine them (the same values): the
    block ends and the first argmax kept here, (max, sum of exp(x - max)) written to this rank's entry of
    stats [SIZE, B, 2] and zeros to the others' (the all-reduce that follows is then an all-gather)."""
    row = tl.program_id(0).to(tl.int64)
    bidx = tl.arange(0, NB)
    valid = bidx < n_blocks
    bmax = tl.load(bmax_ptr + row * NB + bidx, mask=valid, other=float("-inf"))
    bsum = tl.load(bsum_ptr + row * NB + bidx, mask=valid, other=0.0)
    best = tl.max(bmax, 0)
    first = tl.min(tl.where(valid & (bmax == best), bidx, NB), 0)  # the first block holding the max
    best_i = tl.sum(tl.where(bidx == first, tl.load(barg_ptr + row * NB + bidx, mask=valid, other=0), 0), 0)
    shift = tl.where(best == float("-inf"), 0.0, best)  # a slice of -inf only: no mass, not NaN
    ends = tl.cumsum(bsum * tl.exp(bmax - shift), 0)
    if not GREEDY_ONLY:
        tl.store(ends_ptr + row * NB + bidx, ends)
    tl.store(arg_ptr + row, best_i)
    for r in tl.static_range(SIZE):  # pyright: ignore[reportGeneralTypeIssues]
        mine = rank == r
        tl.store(stats_ptr + (r * b + row) * 2, tl.where(mine, best, 0.0))
        tl.store(stats_ptr + (r * b + row) * 2 + 1, tl.where(mine, tl.max(ends, 0), 0.0))


@_jit
def _shard_pick_kernel(
    x_ptr, t_ptr, u_ptr, stats_ptr, ends_ptr, arg_ptr, out_ptr, n, sx, n_blocks, b, rank, lo,
    SIZE: tl.constexpr, SP: tl.constexpr, GREEDY_ONLY: tl.constexpr, BLOCK: tl.constexpr, NB: tl.constexpr,
):  # fmt: skip
    """After the stats' all-reduce: every rank combines the ranks' (max, sum) in rank (= vocabulary) order, as
    vocab_parallel.sample_split does; the winning rank searches its slice and writes (global token, log-prob)
    to out [2, B], the others zeros (the all-reduce that follows hands every rank the winner's)."""
    row = tl.program_id(0).to(tl.int64)
    top = float("-inf")
    for r in tl.static_range(SIZE):  # pyright: ignore[reportGeneralTypeIssues]
        top = tl.maximum(top, tl.load(stats_ptr + (r * b + row) * 2))
    ridx = tl.arange(0, SP)
    rank_ends = tl.full([SP], float("inf"), dtype=tl.float32)  # the ranks' running ends (padding: never <=)
    total = 0.0
    first = -1  # the first rank holding the max (greedy rows: torch.argmax's first maximum)
    last = -1  # the last rank with mass
    mine_end = 0.0
    mine_mass = 0.0
    mine_scale = 0.0
    for r in tl.static_range(SIZE):  # pyright: ignore[reportGeneralTypeIssues]
        m_r = tl.load(stats_ptr + (r * b + row) * 2)
        scale = tl.exp(m_r - top)
        mass = tl.load(stats_ptr + (r * b + row) * 2 + 1) * scale
        total = total + mass  # rank r's running end: the cumsum over the ranks, in rank order
        rank_ends = tl.where(ridx == r, total, rank_ends)
        first = tl.where((first < 0) & (m_r == top), r, first)
        last = tl.where(mass > 0, r, last)
        mine_end = tl.where(rank == r, total, mine_end)
        mine_mass = tl.where(rank == r, mass, mine_mass)
        mine_scale = tl.where(rank == r, scale, mine_scale)
    win = first
    t_raw = tl.load(t_ptr + row)
    t = tl.where(t_raw <= 0, 1.0, t_raw)
    base = x_ptr + row * sx
    tok = tl.load(arg_ptr + row)
    if not GREEDY_ONLY:
        target = tl.load(u_ptr + row) * total
        below = tl.sum((rank_ends <= target).to(tl.int32), 0)  # the first rank whose end passes the target
        w = tl.minimum(below, tl.where(last < 0, SIZE - 1, last))  # (past the total by rounding: the last)
        win = tl.where(t_raw <= 0, first, w)
        bidx = tl.arange(0, NB)
        ends = tl.load(ends_ptr + row * NB + bidx, mask=bidx < n_blocks, other=0.0)
        local = tl.math.div_rn(target - (mine_end - mine_mass), mine_scale)  # in this slice's own units
        shift = tl.load(stats_ptr + (rank * b + row) * 2)
        limit = tl.where((win == rank) & (t_raw > 0), n, 0)  # only the winner re-reads its block
        count = _block_search(base, n, n_blocks, ends, local, t, shift, limit, BLOCK, NB)
        tok = tl.where(t_raw <= 0, tok, count)
    mine = win == rank
    x_tok = tl.load(base + tok).to(tl.float32)  # (tok is in [0, n) on every rank; only the winner's is kept)
    if not GREEDY_ONLY:
        x_tok = tl.math.div_rn(x_tok, t)
    lp = (x_tok - top) - tl.log(total)
    tl.store(out_ptr + row, tl.where(mine, (tok + lo).to(tl.float32), 0.0))
    tl.store(out_ptr + b + row, tl.where(mine, lp, 0.0))


def sample_shard(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    greedy_only: bool,
    *,
    lo: int,
    rank: int,
    size: int,
    reduce: Callable[[torch.Tensor], None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """vocab_parallel.sample_split through the three kernels above (module doc): this rank's logits slice
    [B, n] (vocabulary rows [lo, lo + n), unit stride along n), every rank of the group calling it with the
    same temperature / u [B]; `reduce` sums a tensor in place over the group (called twice, by every rank,
    even for B = 0). Returns (token [B] int64, logprob [B] fp32), the same on every rank."""
    logits, n_blocks = _kernel_rows(logits, "vocabulary slice")
    b, n = logits.shape
    nb = _pow2(n_blocks, 16)
    dev = logits.device
    stats = torch.empty((size, b, 2), dtype=torch.float32, device=dev)
    out = torch.empty((2, b), dtype=torch.float32, device=dev)
    bmax, bsum, ends = torch.empty((3, b, nb), dtype=torch.float32, device=dev)
    barg = torch.empty((b, nb), dtype=torch.int32, device=dev)
    arg = torch.empty(b, dtype=torch.int32, device=dev)
    temp = temperature.to(torch.float32).contiguous()
    uu = u.to(torch.float32).contiguous()
    if b:
        _shard_block_kernel[(b, n_blocks)](logits, temp, bmax, bsum, barg, n, logits.stride(0),
                                           GREEDY_ONLY=greedy_only, BLOCK=BLOCK, NB=nb, num_warps=4)  # fmt: skip
        _shard_stats_kernel[(b,)](bmax, bsum, barg, stats, ends, arg, n_blocks, b, rank, SIZE=size,
                                  GREEDY_ONLY=greedy_only, NB=nb, num_warps=1)  # fmt: skip
    reduce(stats)  # every rank's (max, sum)
    if b:
        _shard_pick_kernel[(b,)](logits, temp, uu, stats, ends, arg, out, n, logits.stride(0), n_blocks, b,
                                 rank, lo, SIZE=size, SP=_pow2(size, 2), GREEDY_ONLY=greedy_only, BLOCK=BLOCK,
                                 NB=nb, num_warps=8)  # fmt: skip
    reduce(out)  # the winner's (token, log-prob)
    return out[0].long(), out[1]
