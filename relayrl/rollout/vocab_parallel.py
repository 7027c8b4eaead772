"""The vocabulary-parallel lm_head of the tensor-parallel native engine (native_tp.py) and sampling over it
without gathering the logits.

Split: TP rank r holds lm_head rows [lo_r, lo_r + n_r) as `torch.tensor_split` cuts the vocabulary (the
first V % TP ranks hold one row more; `vocab_bounds`), computes its slice of the logits, local [B, n_r].
A tied head (tie_word_embeddings) is a view of those rows of the replicated embedding: no extra memory,
and the embedding's refresh refreshes it.

Sampling (`sample_split`): the SAME rule and the SAME per-slot uniforms as the one-GPU sampler
(sampling.py: inverse CDF over softmax(logits / T) in vocabulary order, argmax when T = 0), evaluated
piecewise. Each rank scales its logits x = logits / T (T = 1 for greedy rows) and computes its local max
m_r and e_r = exp(x - m_r) with its sum s_r. ONE all-reduce of [TP, B, 2] (each rank fills its row: an
all-gather) hands every rank every (m_r, s_r); each rank then computes the same global max M = max m_r, the
rank masses s_r' = s_r exp(m_r - M), their running ends, the total Z and target = u Z, so every rank agrees
on the winning rank: for a sampled row the first rank whose mass ends past the target (ranks ordered by
vocabulary), for a greedy row the first rank holding M (torch.argmax's first-maximum rule). The winner counts
the entries of its running sum of e_r that are <= (target - its offset) / exp(m_r - M) (`count_below`: block
sums first, then a scan of the one block the target falls in, not of the whole slice; greedy: its local
argmax); a second all-reduce of [B, 2] (the token id and its x, zeros from the other ranks) hands every rank
the token and its log-prob x[tok] - M - log Z = log_softmax(logits / T)[tok].

Guarantee: the samples and log-probs of one-GPU sampling up to fp32 rounding: the sums are grouped per slice
and per block instead of one running sum, so a token can differ only where u lands within rounding (~1e-7
relative) of a CDF boundary; log-probs are within 1e-6 of the fp64 value (the one-GPU fp32 log_softmax is
itself a few 1e-6 off it over a large row). Deterministic given the seeds and independent of the batch, as
one-GPU sampling; independent of the TP size up to that rounding. Nothing is gathered but 2 x [B, 2] (x TP)
floats per step; the per-rank passes (scale, max, argmax, exp, block sums) cover 1/TP of the vocabulary, with
no full-width scan, and the lm_head GEMM is divided by TP.

Two implementations of the per-rank passes: the torch ops of `sample_split` (the reference, the CPU path and
`fast=False`) and, on CUDA by default (sampling.fast_default), sampling_kernels.sample_shard: the same rule,
the same two all-reduces, in three Triton kernels that read the slice once plus one 4096-entry block (the torch
ops took ~0.35-0.4 ms of a 7B TP 2 decode step at batch 256); tokens equal up to the same fp32-rounding cases.

Top-p / top-k (mode "truncate"): the ranks all-gather the logits ([B, V] on every rank) and run
sampling.sample_tokens on them, so truncation keeps its one-GPU semantics exactly; only steps in that mode
pay the gather. Stop ids, lengths and flags are handled by the caller (native_state.SlotState.advance) on
the token every rank agrees on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from relayrl.rollout import sampling, sampling_kernels

Reduce = Callable[[torch.Tensor], None]
"""An in-place sum over the TP group (dist.all_reduce)."""

MAX_VOCAB = 1 << 24
"""Token ids travel as fp32 in the second all-reduce: exact below 2^24."""


def vocab_bounds(vocab: int, size: int) -> list[int]:
    """First vocabulary row of each of `size` ranks, then `vocab` (torch.tensor_split's cut)."""
    q, rem = divmod(vocab, size)
    return [r * q + min(r, rem) for r in range(size)] + [vocab]


BLOCK = 1024
"""Entries per block of the two-level inverse-CDF search (`block_ends`, `count_below`)."""


def block_ends(e: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Running sums of e [B, n] at the end of each block of `block` entries (a last short block for the
    tail): [B, ceil(n / block)], the last column the row sums. One reduction pass over e."""
    n = e.shape[1]
    nb = n // block
    sums = e[:, : nb * block].unflatten(1, (nb, block)).sum(-1)  # a view, no copy
    if n > nb * block:
        sums = torch.cat((sums, e[:, nb * block :].sum(-1, keepdim=True)), dim=-1)
    return sums.cumsum(-1)


def count_below(e: torch.Tensor, ends: torch.Tensor, t: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """For e [B, n] >= 0, its `block_ends` and t [B]: the number of j with cumsum(e)[j] <= t, clamped to n - 1
    (sampling.py's `_inverse_cdf` count, the sums grouped by block: equal up to fp32 rounding), scanning only
    the block where the running sum passes t."""
    n = e.shape[1]
    blk = (ends <= t[:, None]).sum(-1).clamp_(max=ends.shape[1] - 1)  # blocks wholly at or below t
    before = torch.where(blk > 0, ends.gather(-1, (blk - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)
    cols = blk[:, None] * block + torch.arange(block, device=e.device)
    inside = cols < n
    vals = e.gather(-1, cols.clamp(max=n - 1)) * inside
    running = before[:, None] + vals.cumsum(-1)
    count = blk * block + ((running <= t[:, None]) & inside).sum(-1)
    return count.clamp_(max=n - 1)


def sample_split(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    u: torch.Tensor,
    greedy_only: bool,
    *,
    lo: int,
    rank: int,
    size: int,
    reduce: Reduce,
    fast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from this rank's logits slice [B, n] (vocabulary rows [lo, lo + n)), every
    rank of the group calling it with its own slice and the same temperature / u [B]; returns (token [B]
    int64, logprob [B] fp32), the same on every rank (module doc). `greedy_only`: every row has T = 0.
    `fast`: the per-rank passes as sampling_kernels.sample_shard's Triton kernels (None:
    sampling.fast_default, on CUDA; True on a CPU needs TRITON_INTERPRET=1), False: the torch ops below (the
    reference). Every rank of the group must pass the same choice (the collectives must match)."""
    if sampling.fast_default(logits) if fast is None else fast:
        return sampling_kernels.sample_shard(
            logits, temperature, u, greedy_only, lo=lo, rank=rank, size=size, reduce=reduce
        )
    b = logits.shape[0]
    greedy = temperature <= 0
    t_eff = torch.where(greedy, 1.0, temperature)
    # bf16 / fp32 promotes to fp32: the cast and the scaling in one pass, the values of sampling.py's
    x = logits.to(torch.float32, copy=True) if greedy_only else logits / t_eff[:, None]
    m = x.amax(-1)
    arg = x.argmax(-1)
    e = x.sub_(m[:, None]).exp_()  # in place: x[tok] is recomputed from logits below
    ends_e = None if greedy_only else block_ends(e)
    stats = torch.zeros((size, b, 2), dtype=torch.float32, device=x.device)
    stats[rank, :, 0] = m
    stats[rank, :, 1] = e.sum(-1) if ends_e is None else ends_e[:, -1]
    reduce(stats)  # every rank's (max, sum)
    maxes = stats[..., 0]
    top = maxes.amax(0)  # [B] global max M
    scale = torch.exp(maxes - top)  # [TP, B]
    mass = stats[..., 1] * scale
    ends = mass.cumsum(0)
    total = ends[-1]
    win = (maxes == top).int().argmax(0)  # greedy: the first rank holding the max
    idx = arg
    if ends_e is not None:
        target = u * total
        w = (ends <= target).sum(0)  # the first rank whose mass ends past the target
        last = size - 1 - (mass > 0).flip(0).int().argmax(0)  # (target >= Z by rounding: the last with mass)
        w = torch.minimum(w, last)
        count = count_below(e, ends_e, (target - (ends[rank] - mass[rank])) / scale[rank])
        win = torch.where(greedy, win, w)
        idx = torch.where(greedy, arg, count)
    mine = win == rank
    out = torch.zeros((b, 2), dtype=torch.float32, device=x.device)
    out[:, 0] = torch.where(mine, idx + lo, 0).float()
    picked = logits.gather(-1, idx[:, None]).squeeze(-1).float() / t_eff  # = x[tok] before the exp
    out[:, 1] = torch.where(mine, picked, 0.0)
    reduce(out)  # the winner's token and its scaled logit
    return out[:, 0].long(), (out[:, 1] - top) - torch.log(total)


class VocabParallelHead(torch.nn.Linear):
    """lm_head rows [lo, lo + out_features) of the vocabulary (module doc): forward gives this rank's logits
    slice; `sample_tokens` samples with the other ranks of `group` (sampling.sample_tokens' signature)."""

    group: Any = None
    """The TP process group."""
    rank: int = 0
    size: int = 1
    vocab: int = 0
    """The full vocabulary size."""
    lo: int = 0
    """First vocabulary row held here."""

    def setup(self, group: Any, rank: int, size: int, vocab: int) -> None:
        if vocab >= MAX_VOCAB:
            raise ValueError(f"vocab-parallel lm_head: vocabulary {vocab} >= 2^24 (token ids travel as fp32)")
        self.group, self.rank, self.size, self.vocab = group, rank, size, vocab
        self.lo = vocab_bounds(vocab, size)[rank]

    def _reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits from every rank's slice [B, n_r] (padded to the largest slice for the all-gather)."""
        bounds = vocab_bounds(self.vocab, self.size)
        width = bounds[1] - bounds[0]  # the first rank's slice is the widest
        local = logits.new_zeros((logits.shape[0], width))
        local[:, : logits.shape[1]] = logits
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat([p[:, : bounds[r + 1] - bounds[r]] for r, p in enumerate(parts)], dim=-1)

    def sample_tokens(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        u: torch.Tensor,
        mode: str,
        *,
        fast: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """sampling.sample_tokens over the vocabulary split across the group (module doc); `fast` as in
        `sample_split` (and sampling.sample_tokens for the gathered logits of "truncate" steps)."""
        if mode == "truncate":
            return sampling.sample_tokens(self.gather(logits), temperature, top_p, top_k, u, mode, fast=fast)
        if mode not in ("greedy", "sample"):
            raise ValueError(f"sampling mode must be greedy, sample or truncate, got {mode!r}")
        return sample_split(logits, temperature, u, mode == "greedy", lo=self.lo, rank=self.rank,
                            size=self.size, reduce=self._reduce, fast=fast)  # fmt: skip
