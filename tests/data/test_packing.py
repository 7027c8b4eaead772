"""THE micro-batch planner: token budgets, the layout-aware plan, count chunks, a step's groups and the collate
(the forward layouts themselves are tested in tests/models/test_forward.py)."""

from __future__ import annotations

import pytest
import torch

from relayrl.config.components import TrainConfig
from relayrl.data.packing import (
    LAYOUTS,
    MicroBatching,
    RankBatches,
    balance_by_tokens,
    chunk_by_count,
    make_collate,
    plan_micro_batches,
    plan_token_budget,
)


def test_plan_token_budget_first_fit_decreasing():
    # lengths 5,4,3,3,2,1 budget 7, longest first: 5 -> A; 4 -> B; 3 -> B (full); 3 -> C; 2 -> A; 1 -> C
    bins = plan_token_budget([5, 4, 3, 3, 2, 1], 7)
    assert bins == [[0, 4], [1, 2], [3, 5]]
    assert all(sum([5, 4, 3, 3, 2, 1][i] for i in b) <= 7 for b in bins)
    # an over-long sequence gets its own bin
    assert plan_token_budget([10, 2, 2], 4) == [[0], [1, 2]]
    assert chunk_by_count(5, 2) == [[0, 1], [2, 3], [4]]


def test_plan_micro_batches_hand_example():
    lengths = [40, 10, 10, 10, 10, 10]
    assert plan_micro_batches(lengths, 60, "varlen") == [[0, 1, 2], [3, 4, 5]]  # 60 real tokens each
    assert plan_micro_batches(lengths, 60, "padded") == [[0], [1, 2, 3, 4, 5]]  # 2 x 40 > 60; 5 x 10
    assert plan_micro_batches([5, 100, 7], 64, "padded") == [[1], [0, 2]]  # a too-long row is alone


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_micro_batches_properties(layout):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 120, (200,), generator=gen).tolist()
    budget = 256
    bins = plan_micro_batches(lengths, budget, layout)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b == sorted(b) for b in bins)
    for b in bins:
        cost = sum(lengths[i] for i in b) if layout == "varlen" else len(b) * max(lengths[i] for i in b)
        assert cost <= budget or len(b) == 1
    long_row = plan_micro_batches([*lengths[:10], 999], budget, layout)
    assert [10] in long_row
    with pytest.raises(ValueError, match="token budget must be > 0"):
        plan_micro_batches([3], 0, "padded")
    with pytest.raises(ValueError, match="layout must be one of"):
        plan_micro_batches([3], 8, "packed")


def test_micro_batching_by_tokens_only_when_packing_with_a_budget():
    sizes = [40, 10, 10, 10, 10, 10]
    by_tokens = MicroBatching(layout="varlen", packing=True, micro_batch_size=2, max_tokens=60)
    assert by_tokens.groups(sizes) == plan_micro_batches(sizes, 60, "varlen") == [[0, 1, 2], [3, 4, 5]]
    no_budget = MicroBatching(layout="varlen", packing=True, micro_batch_size=4, max_tokens=0)
    assert no_budget.groups(sizes) == [[0, 1, 2, 3], [4, 5]]  # packing without a budget: by count
    not_packing = MicroBatching(layout="padded", packing=False, micro_batch_size=4, max_tokens=60)
    assert not_packing.groups(sizes) == [[0, 1, 2, 3], [4, 5]]


def test_micro_batching_of_a_train_section():
    train = TrainConfig(batch_size=4, micro_batch_size=2, packing=True, max_tokens_per_micro_batch=30)
    assert MicroBatching.of(train, "padded") == MicroBatching(
        layout="padded", packing=True, micro_batch_size=2, max_tokens=30
    )


def test_make_collate_groups_the_chosen_samples_of_a_step():
    samples = [list(range(n)) for n in (5, 1, 4, 2)]
    train = TrainConfig(batch_size=4, micro_batch_size=1, packing=True, max_tokens_per_micro_batch=6)
    collate = make_collate(samples, train, "varlen", lambda group, layout: (layout, group), size=len)
    # indices 0, 2, 3 (sizes 5, 4, 2): 5 alone (5 + 4 > 6), then 4 + 2
    assert collate([0, 2, 3]) == [("varlen", [samples[0]]), ("varlen", [samples[2], samples[3]])]


def test_balance_by_tokens_hand_example_and_bound():
    # longest first to the lightest part: 9 -> A, 7 -> B, 5 -> B (7 < 9), 4 -> A, 3 -> B (12 < 13), 1 -> A
    assert balance_by_tokens([5, 9, 1, 7, 4, 3], 2) == [[1, 2, 4], [0, 3, 5]]
    assert balance_by_tokens([3, 1], 3) == [[0], [1], []]
    g = torch.Generator().manual_seed(0)
    for parts in (2, 3, 4):
        sizes = torch.randint(64, 1001, (64 * parts,), generator=g).tolist()
        groups = balance_by_tokens(sizes, parts)
        assert sorted(i for grp in groups for i in grp) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in grp) for grp in groups]
        assert max(loads) - min(loads) <= max(sizes), (parts, loads)
    with pytest.raises(ValueError, match="parts"):
        balance_by_tokens([1], 0)


def test_make_collate_per_rank_packs_each_ranks_token_balanced_share():
    """With ranks and a token budget each rank's samples are balanced by tokens and packed on their own; the
    old plan (the whole step packed, then whole packs handed out) leaves the ranks a pack apart."""
    g = torch.Generator().manual_seed(0)
    sizes = torch.randint(64, 1001, (256,), generator=g).tolist()
    samples = [list(range(n)) for n in sizes]
    train = TrainConfig(batch_size=256, micro_batch_size=1, packing=True, max_tokens_per_micro_batch=16384)
    collate = make_collate(samples, train, "varlen", lambda group, layout: group, size=len, parts=4)
    out = collate(list(range(256)))
    assert isinstance(out, RankBatches) and len(out.counts) == 4
    starts = [sum(out.counts[:r]) for r in range(4)]
    per_rank = [out[a : a + c] for a, c in zip(starts, out.counts, strict=True)]
    assert sorted(len(s) for mbs in per_rank for mb in mbs for s in mb) == sorted(sizes)  # each sample once
    assert all(sum(len(s) for s in mb) <= 16384 for mb in out)
    loads = [sum(len(s) for mb in mbs for s in mb) for mbs in per_rank]
    assert max(loads) - min(loads) <= max(sizes)
    assert len(set(out.counts)) == 1  # every rank runs as many passes: no padding pass
    # one rank (or no budget): the plain list of before
    one = make_collate(samples, train, "varlen", lambda group, layout: group, size=len)
    assert type(one(list(range(256)))) is list
    with pytest.raises(ValueError, match="do not add up"):
        RankBatches([1, 2], [1])
