"""The vocabulary-parallel lm_head and its sampling (relayrl/rollout/vocab_parallel.py).

`sample_split` over TP = 2, 3, 4 simulated ranks (threads, the all-reduce a summed exchange) against the
one-GPU sampler on the full logits, fp32: the same tokens (greedy and seeded sampling, every row) and
log-probs within 5e-6 of its fp32 ones and 1e-6 of the fp64 value (the split only regroups the fp32 sums of the softmax denominator and of the CDF: a
vocabulary of 5003 makes each rank's search run over 1024-entry blocks and a tail). The engine-level
check (TP = 2 / 4 engines, tied and untied heads, against TP = 1) is in test_native_tp.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import tp_workers

from relayrl.rollout.native_tp import shard_model, tp_slice
from relayrl.rollout.sampling import sample_tokens, uniform
from relayrl.rollout.vocab_parallel import (
    VocabParallelHead,
    block_ends,
    count_below,
    sample_split,
    vocab_bounds,
)

ATOL = 5e-6
"""Log-probs against the one-GPU sampler's fp32 log_softmax, which is itself up to ~2.3e-6 off the fp64 value
over a 5003-entry row; against the fp64 value the split ones stay within EXACT."""
EXACT = 1e-6


def exact_logprob(logits: torch.Tensor, temp: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    t = torch.where(temp > 0, temp, 1.0).double()[:, None]
    return torch.log_softmax(logits.double() / t, -1).gather(-1, tok[:, None]).squeeze(-1).float()


def split_run(logits: torch.Tensor, temp: torch.Tensor, u: torch.Tensor, size: int, greedy_only: bool):
    """Every simulated rank's (tokens, logprobs) from its slice of `logits`."""
    bounds = vocab_bounds(logits.shape[1], size)
    barrier = threading.Barrier(size)
    parts: list[Any] = [None] * size
    out: list[Any] = [None] * size

    def reduce_for(rank: int):
        def reduce(t: torch.Tensor) -> None:
            parts[rank] = t.clone()
            barrier.wait()
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            barrier.wait()
            t.copy_(total)

        return reduce

    def body(rank: int) -> None:
        lo, hi = bounds[rank], bounds[rank + 1]
        out[rank] = sample_split(logits[:, lo:hi], temp, u, greedy_only, lo=lo, rank=rank, size=size,
                                 reduce=reduce_for(rank))  # fmt: skip

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return out


def test_vocab_bounds_cut_as_tensor_split():
    assert vocab_bounds(101, 4) == [0, 26, 51, 76, 101]
    for v, s in ((101, 4), (152064, 2), (10, 3)):
        pieces = torch.arange(v).tensor_split(s)
        assert vocab_bounds(v, s)[:-1] == [int(p[0]) for p in pieces]


def test_blocked_count_is_the_flat_inverse_cdf_count():
    g = torch.Generator().manual_seed(0)
    e = torch.rand(64, 101, generator=g) ** 4
    e[3, 40:] = 0.0  # trailing zeros: a target past the mass lands on the last entry, clamped
    t = torch.rand(64, generator=g) * e.sum(-1)
    t[3] = e[3].sum() * 2
    want = (e.cumsum(-1) <= t[:, None]).sum(-1).clamp(max=100)
    for block in (8, 10, 101, 1024):  # blocks and a tail, one whole block, only a tail
        ends = block_ends(e, block)
        assert torch.equal(count_below(e, ends, t, block), want), block
        torch.testing.assert_close(ends[:, -1], e.sum(-1), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [101, 5003])
def test_split_sampling_draws_the_one_gpu_samples(size, dtype, v):
    g = torch.Generator().manual_seed(size)
    b = 96
    logits = (torch.randn(b, v, generator=g) * 3).to(dtype)
    logits[5, 70] = logits[5].max() + 8  # a row whose mass sits on one rank's slice
    temp = torch.tensor([0.0, 0.7, 1.0, 1.3] * (b // 4))
    u = uniform(torch.arange(b)[:, None] * 7 + 3, torch.arange(1)[None, :] + 17)[:, 0]
    want_tok, want_lp = sample_tokens(
        logits, temp, torch.ones(b), torch.zeros(b, dtype=torch.long), u, "sample"
    )
    ranks = split_run(logits, temp, u, size, greedy_only=False)
    assert len(set(want_tok[1::4].tolist())) > 10  # really sampling
    for tok, lp in ranks:  # every rank agrees with the one-GPU sampler
        assert torch.equal(tok, want_tok)
        torch.testing.assert_close(lp, want_lp, atol=ATOL, rtol=0)
        torch.testing.assert_close(lp, exact_logprob(logits, temp, tok), atol=EXACT, rtol=0)
    zero = torch.zeros(b)
    g_tok, g_lp = sample_tokens(logits, zero, torch.ones(b), torch.zeros(b, dtype=torch.long), u, "greedy")
    for tok, lp in split_run(logits, zero, u, size, greedy_only=True):
        assert torch.equal(tok, g_tok)
        torch.testing.assert_close(lp, g_lp, atol=ATOL, rtol=0)
        torch.testing.assert_close(lp, exact_logprob(logits, zero, tok), atol=EXACT, rtol=0)


def test_greedy_ties_take_the_first_maximum_across_ranks():
    logits = torch.zeros(2, 8)
    logits[0, [2, 6]] = 5.0  # tie across the 2 ranks' slices: the first wins, as torch.argmax
    logits[1, [5, 7]] = 5.0  # tie inside the second rank
    temp, u = torch.zeros(2), torch.full((2,), 0.5)
    for tok, _ in split_run(logits, temp, u, 2, greedy_only=True):
        assert tok.tolist() == [2, 5]


def test_shard_splits_the_head_untied_by_rows_tied_as_a_view_of_the_embedding():
    tied = tp_workers.tiny_model()  # vocab 101, tied embeddings
    shard: Any = shard_model(tied, rank=1, size=4, group=None)
    head, embed = shard.lm_head, shard.model.embed_tokens.weight
    assert isinstance(head, VocabParallelHead) and (head.lo, head.out_features) == (26, 25)
    assert embed.shape[0] == 101 and head.weight.data_ptr() == embed[26].data_ptr()  # a view, no copy
    with torch.no_grad():
        embed[30].fill_(3.0)  # a refresh of the embedding refreshes the head
    assert bool((head.weight[4] == 3.0).all())
    untied: Any = tp_workers.untied_model()
    full = untied.lm_head.weight
    shard = shard_model(untied, rank=3, size=4, group=None)
    assert torch.equal(shard.lm_head.weight, full[76:]) and shard.model.embed_tokens.weight.shape[0] == 101
    assert torch.equal(tp_slice("lm_head.weight", full, 3, 4), full[76:])
    assert tp_slice("lm_head.weight", full, 3, 4, vocab_parallel=False) is full
    plain: Any = shard_model(untied, rank=3, size=4, group=None, vocab_parallel=False)
    assert type(plain.lm_head) is torch.nn.Linear and torch.equal(plain.lm_head.weight, full)
