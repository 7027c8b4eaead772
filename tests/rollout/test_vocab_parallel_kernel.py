"""The vocabulary-parallel sampler's Triton passes (sampling_kernels.sample_shard, vocab_parallel.sample_split's
CUDA default) against its torch ops (sample_split(fast=False)) and the one-GPU sampler (sampling.sample_tokens_ref
on the whole row), on a CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1; skipped
without triton). Ranks: 2 and 4 simulated in threads that take turns (the interpreter is not thread-safe: a
rank runs only while the others wait inside an all-reduce), and real gloo groups of 2 and 4 processes
(marked slow: ~2-4 s each on 2 cores, ranks forked by tests/helpers/rank_spawn.py; so is a TP 2 engine
sampling through the kernels).

Bounds (the TP = 1 kernel's, sampling.py's module doc): tokens equal to both references except where u lies
within BOUNDARY of the fp64 CDF boundary between the two tokens (each side groups its fp32 sums differently:
per rank and per block of 4096 here, per rank and per block of 1024 in the torch split, one running sum in the
one-GPU reference), at most 1 such row per 32 draws; log-probs of equal tokens within 1e-5; greedy rows the
argmax (the first maximum across ranks). Vocabulary 20,003: at TP 2 each rank's slice spans three 4096-entry
blocks (the last a short tail), at TP 4 two, so the cross-block search and the masked tail run on every rank.
GPU twin: test_vocab_parallel_kernel_gpu.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import tp_workers
import vocab_kernel_ranks
from rank_spawn import spawn_ranks
from vocab_kernel_ranks import BOUNDARY, boundary_rows

from relayrl.rollout.base import generate_all
from relayrl.rollout.kernels import usable
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.sampling import sample_tokens_ref
from relayrl.rollout.vocab_parallel import sample_split, vocab_bounds

pytestmark = pytest.mark.skipif(
    not usable(torch.device("cpu")), reason="triton not installed (or no GPU and TRITON_INTERPRET unset)"
)

LP_TOL = 1e-5
"""Log-probs of equal tokens, absolute."""


def turn_run(logits: torch.Tensor, temp: torch.Tensor, u: torch.Tensor, size: int, greedy_only: bool,
             fast: bool) -> list:  # fmt: skip
    """Every simulated rank's sample_split(fast=...) over its slice of `logits`. The ranks are threads that
    hold one lock while they run and drop it only inside the all-reduce, so one rank runs at a time."""
    bounds = vocab_bounds(logits.shape[1], size)
    barrier = threading.Barrier(size)
    turn = threading.Lock()
    parts: list[Any] = [None] * size
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def reduce_for(rank: int):
        def reduce(t: torch.Tensor) -> None:
            parts[rank] = t.clone()
            turn.release()
            try:
                barrier.wait(timeout=120)
                total = parts[0].clone()
                for p in parts[1:]:
                    total += p
                barrier.wait(timeout=120)
            finally:
                turn.acquire()
            t.copy_(total)

        return reduce

    def body(rank: int) -> None:
        lo, hi = bounds[rank], bounds[rank + 1]
        with turn:
            try:
                out[rank] = sample_split(logits[:, lo:hi], temp, u, greedy_only, lo=lo, rank=rank, size=size,
                                         reduce=reduce_for(rank), fast=fast)  # fmt: skip
            except BaseException as e:  # reported by the test thread
                errors.append(e)
                barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return out


def check(logits, temp, u, tok, lp, ref_tok, ref_lp, max_differ: int) -> None:
    n, gaps = boundary_rows(logits, temp, u, tok, ref_tok)
    same = tok == ref_tok
    err = float((lp - ref_lp)[same].abs().max())
    print(f"{n} of {len(tok)} tokens differ (boundary gaps {gaps}); max |logprob diff| {err:.2e}")
    assert n <= max_differ and all(g <= BOUNDARY for g in gaps)
    assert err <= LP_TOL
    greedy = temp <= 0
    assert torch.equal(tok[greedy], logits[greedy].float().argmax(-1))


@pytest.mark.parametrize("size", [2, 4])
def test_kernel_split_samples_what_the_torch_split_and_one_gpu_sample(size):
    logits, temp, u = vocab_kernel_ranks.case(32, 20_003, seed=size)
    b = logits.shape[0]
    ones, zeros = torch.ones(b), torch.zeros(b, dtype=torch.long)
    ref_tok, ref_lp = sample_tokens_ref(logits, temp, ones, zeros, u, "sample")
    kern = turn_run(logits, temp, u, size, greedy_only=False, fast=True)
    split_tok, split_lp = turn_run(logits, temp, u, size, greedy_only=False, fast=False)[0]
    assert len(set(ref_tok[temp > 0].tolist())) > 15  # really sampling
    for tok, lp in kern:  # every rank holds the same result
        assert torch.equal(tok, kern[0][0]) and torch.equal(lp, kern[0][1])
    tok, lp = kern[0]
    check(logits, temp, u, tok, lp, split_tok, split_lp, max_differ=1)
    check(logits, temp, u, tok, lp, ref_tok, ref_lp, max_differ=1)
    zero = torch.zeros(b)
    g_ref, g_lp = sample_tokens_ref(logits, zero, ones, zeros, u, "greedy")
    for g_tok, g_klp in turn_run(logits, zero, u, size, greedy_only=True, fast=True):
        assert torch.equal(g_tok, g_ref)
        torch.testing.assert_close(g_klp, g_lp, atol=LP_TOL, rtol=0)


def test_kernel_split_edge_rows_ties_one_rank_of_minus_inf_and_mass_on_one_rank():
    """Greedy ties across ranks and across blocks go to the first maximum (torch.argmax); a rank whose whole slice is -inf has no
    mass (not NaN) and is never drawn; a row whose mass sits on one entry of the last rank draws it."""
    b, v = 6, 9_000  # TP 2: slices of 4500 (a block and a tail)
    logits, temp, u = vocab_kernel_ranks.case(b, v, seed=9, dtype=torch.float32)
    logits[0] = 0.0
    logits[0, [100, 4600]] = 5.0  # a tie across the two ranks
    logits[1, 4500:] = float("-inf")  # rank 1's whole slice
    logits[2, :4500] = float("-inf")  # rank 0's whole slice
    logits[3, 8999] = 60.0  # all the mass on the last entry
    logits[4, [10, 4200]] = 50.0  # a tie across two blocks of rank 0
    temp[:5] = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    ones, zeros = torch.ones(b), torch.zeros(b, dtype=torch.long)
    ref_tok, ref_lp = sample_tokens_ref(logits, temp, ones, zeros, u, "sample")
    for tok, lp in turn_run(logits, temp, u, 2, greedy_only=False, fast=True):
        assert tok[0] == 100 and tok[1] < 4500 and tok[2] >= 4500 and tok[3] == 8999 and tok[4] == 10
        assert torch.isfinite(lp).all()
        check(logits, temp, u, tok, lp, ref_tok, ref_lp, max_differ=0)
    for tok, _ in turn_run(logits, torch.zeros(b), u, 2, greedy_only=True, fast=True):
        assert tok[0] == 100 and tok[3] == 8999 and tok[4] == 10


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_kernel_split_over_gloo_samples_what_the_torch_split_samples(world, tmp_path):
    """Real gloo groups (dist.all_reduce, the engine's transport on a CPU): every rank gets the torch split's
    tokens (bf16 logits, sampled and greedy) and log-probs within LP_TOL."""
    out = str(tmp_path / "out")
    spawn_ranks(vocab_kernel_ranks.gloo_worker, (world, str(tmp_path / "store"), out), nprocs=world)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    logits, temp, u = vocab_kernel_ranks.case(*vocab_kernel_ranks.GLOO_CASE, seed=world)
    for r in ranks:
        for mode in ("sample", "greedy"):
            k_tok, k_lp = r[mode]["kernel"]
            t_tok, t_lp = r[mode]["torch"]
            assert torch.equal(k_tok, ranks[0][mode]["kernel"][0])
            t = temp if mode == "sample" else torch.zeros_like(temp)
            check(logits, t, u, k_tok, k_lp, t_tok, t_lp, max_differ=1 if mode == "sample" else 0)


@pytest.mark.slow
def test_a_tp2_engine_sampling_through_the_kernels_samples_what_tp1_samples(tmp_path):
    """The engine path (native_state -> VocabParallelHead.sample_tokens -> sample_split -> the kernels, forced
    on in the ranks) over gloo: the TP = 1 engine's tokens (greedy, seeded, top-p / top-k: fp32, vocabulary
    101) and log-probs within LP_TOL."""
    engine = NativeEngine(tp_workers.tiny_model(), **tp_workers.ENGINE)
    try:
        want = tp_workers.outputs(generate_all(engine, tp_workers.requests()))
    finally:
        engine.close()
    out = str(tmp_path / "out")
    spawn_ranks(vocab_kernel_ranks.engine_kernel_worker, (2, str(tmp_path / "store"), out), nprocs=2)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    assert ranks[0]["kernel_calls"] == ranks[1]["kernel_calls"] > 0  # every rank, every greedy / sample step
    got = ranks[0]["outputs"]
    for g_req, w_req in zip(got, want, strict=True):
        for (g_tok, g_lp), (w_tok, w_lp) in zip(g_req, w_req, strict=True):
            assert g_tok == w_tok
            torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=LP_TOL, rtol=0)
