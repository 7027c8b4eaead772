"""Sequence parallelism (Ulysses): the tokens of one packed micro-batch are split over the W ranks of a
sequence-parallel (SP) group, and attention all-to-alls them into whole sequences over a subset of heads.

    set_group(SPGroup(group=pg, size=W, rank=r))     this process's SP group (relayrl.distributed.sequence_parallel
                                                      builds it from dist.sp_size); size() == 1 means off
    lo, hi, padded = local_slice(n)                   this rank's slice of a packed row of n tokens (padded to W)
    seq_to_heads(q)   [1, H, n/W, D] -> [1, H/W, n, D]          before attention (q, k, v)
    heads_to_seq(o)   [1, n, H/W, D] -> [1, n/W, H, D]          after attention
    expand_kv(k, W)   [1, Hkv, t, D] -> [1, lcm(Hkv, W), t, D]  KV heads repeated when Hkv % W != 0
    gather_tokens(x, n)  [n_pad/W, ...] -> [n, ...]             per-token results back to whole rows

How a forward runs (relayrl.models.forward, varlen layout): every rank of the group holds the same micro-batch;
the packed row (n tokens, position ids restarting per sequence, cu_seqlens) is padded with a tail "sequence"
to a multiple of W and each rank embeds its W-th of it, with the GLOBAL position ids of its tokens (rotary
embeddings are per position, so they are right on any slice). In every attention layer, after q / k / v are
projected and rotated, an all-to-all turns [n/W tokens, all H heads] into [all n tokens, H/W heads]; the
model's own attention kernel (flash varlen on a GPU, per-sequence sdpa on a CPU) runs on whole sequences with
the cu_seqlens of the whole padded row; a second all-to-all turns the result back. Everything else in a
decoder layer (norms, projections, MLP) is per token. Log-probs and values are computed on the rank's own
tokens (the LM head, the costly part, runs once per token over the group); their targets are the row's next
tokens, shifted BEFORE the row is split, so the label of a shard's last token (the first token of the next
shard) is right. The [n] results are then all-gathered so every caller sees whole rows, as without SP.

Why Ulysses and not ring attention: it reuses the model's attention kernel unchanged, packed / varlen rows
included (ring attention needs its own causal, variable-length, load-balanced kernel and W rounds of
key/value exchange per layer), and costs two all-to-alls of q/k/v/o per layer whose volume per rank shrinks
with W. Its limits: W must divide the query heads (Qwen2.5-1.5B: 12 heads -> W in 1, 2, 3, 4, 6, 12), and
KV heads fewer than W are repeated (GQA's saving is lost inside attention only).

Gradients (the maths). Every rank of a group computes the SAME loss L of the micro-batch from the gathered
per-token results. `gather_tokens`' backward hands each rank only its own slice of dL/d(results), and the
all-to-alls' backwards are the reverse all-to-alls, so rank r's parameter gradient g_r holds exactly the
chain-rule terms of the computation on its tokens, and sum_r g_r = dL/dtheta. The SP ranks' gradients
must therefore be SUMMED (not averaged) within the group and averaged over data-parallel groups:
relayrl.training.step counts the replicated loss once per group (its all-reduced counts are divided by W).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class SPGroup:
    """This process's sequence-parallel group."""

    group: Any
    """The torch.distributed process group of the W consecutive ranks that share micro-batches."""
    size: int
    """W, its number of ranks (dist.sp_size)."""
    rank: int
    """This process's rank inside the group, in [0, W)."""


_current: SPGroup | None = None


def set_group(group: SPGroup | None) -> None:
    """Make `group` this process's SP group (None: sequence parallelism off)."""
    global _current
    _current = group if group is not None and group.size > 1 else None


def active() -> SPGroup | None:
    """The SP group when sequence parallelism is on (W > 1), else None."""
    return _current


def size() -> int:
    """W (1 when off)."""
    return _current.size if _current is not None else 1


def is_leader() -> bool:
    """True on the group's first rank (the one that reports a group's replicated results), or when off."""
    return _current is None or _current.rank == 0


def check_heads(heads: int, kv_heads: int, sp: int) -> None:
    """ValueError naming dist.sp_size when `sp` does not divide the query heads."""
    if sp > 1 and heads % sp:
        raise ValueError(
            f"dist.sp_size={sp} must divide the model's attention heads ({heads}, KV heads {kv_heads}): "
            f"sequence parallelism splits the heads over the group; pick a divisor of {heads}"
        )


def local_slice(n: int) -> tuple[int, int, int]:
    """(start, stop, padded length) of this rank's tokens of a packed row of n tokens."""
    g = _current
    if g is None:
        return 0, n, n
    padded = -(-n // g.size) * g.size
    per = padded // g.size
    return g.rank * per, (g.rank + 1) * per, padded


def _a2a(x: Tensor, scatter_dim: int, gather_dim: int, g: SPGroup) -> Tensor:
    """Chunk j of `x` along scatter_dim goes to rank j; the chunks received join along gather_dim in rank
    order."""
    inp = torch.stack(x.chunk(g.size, dim=scatter_dim)).contiguous()
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp, group=g.group)
    return torch.cat(out.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, g):
        ctx.dims, ctx.g = (scatter_dim, gather_dim), g
        return _a2a(x, scatter_dim, gather_dim, g)

    @staticmethod
    def backward(ctx, grad):  # pyright: ignore[reportIncompatibleMethodOverride]
        scatter_dim, gather_dim = ctx.dims
        return _a2a(grad, gather_dim, scatter_dim, ctx.g), None, None, None


def seq_to_heads(x: Tensor) -> Tensor:
    """[1, H, n/W, D] (this rank's tokens, every head) -> [1, H/W, n, D] (every token, this rank's heads)."""
    g = _current
    assert g is not None, "seq_to_heads without an SP group"
    return _AllToAll.apply(x, 1, 2, g)  # pyright: ignore[reportReturnType]


def heads_to_seq(x: Tensor) -> Tensor:
    """[1, n, H/W, D] (attention output of this rank's heads) -> [1, n/W, H, D] (this rank's tokens)."""
    g = _current
    assert g is not None, "heads_to_seq without an SP group"
    return _AllToAll.apply(x, 1, 2, g)  # pyright: ignore[reportReturnType]


def expand_kv(kv: Tensor, sp: int) -> Tensor:
    """[1, Hkv, t, D] -> [1, lcm(Hkv, sp), t, D]: each KV head repeated so the heads split evenly over the
    group. Query head h reads KV head h // (H / Hkv); after repeating by m it reads h // (H / (m Hkv)), the
    same head, since floor divisions nest (H divisible by lcm(Hkv, sp) when H is by both)."""
    heads = kv.shape[1]
    if heads % sp == 0:
        return kv
    return kv.repeat_interleave(math.lcm(heads, sp) // heads, dim=1)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g):
        ctx.g, ctx.n = g, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(g.size)]
        dist.all_gather(parts, x.contiguous(), group=g.group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):  # pyright: ignore[reportIncompatibleMethodOverride]
        # every rank's loss is the same function of the gathered tensor: its own slice carries its share
        lo = ctx.g.rank * ctx.n
        return grad[lo : lo + ctx.n].contiguous(), None


def gather_tokens(x: Tensor, n: int) -> Tensor:
    """This rank's per-token results [n_pad / W, ...] -> the whole row's [n, ...] (padding dropped), on
    every rank; differentiable (see the module doc's gradient note)."""
    g = _current
    if g is None:
        return x
    return _GatherTokens.apply(x, g)[:n]  # pyright: ignore[reportIndexIssue]


def pad_to(x: Tensor, padded: int, value: float | int) -> Tensor:
    """`x` [n, ...] extended along dim 0 to `padded` rows of `value`."""
    if x.shape[0] == padded:
        return x
    return torch.cat([x, x.new_full((padded - x.shape[0], *x.shape[1:]), value)])
