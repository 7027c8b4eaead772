"""Rank shares and result merging of a data-parallel role (relayrl.distributed.group), without Ray.

- `shares(weights, parts)`: contiguous ranges that cover every item exactly once in order, every range non-empty
  when there are at least `parts` items (trailing ones empty otherwise), balanced by weight (no range heavier
  than total / parts plus one item), deterministic; outside a process group `my_share` is everything.
- `merge_results`: how a worker method's per-rank results combine, as its `@merged(...)` says: "concat" joins
  lists / tensors (dim 0) in rank order, "max" takes the maximum, undecorated methods give rank 0's result.
"""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
import torch

from relayrl.distributed.group import in_group, merge_results, merged, my_share, rank, shares, world


def _check_partition(parts: list[range], n: int) -> None:
    """Contiguous ranges with step 1, in order, covering 0..n-1 exactly once."""
    assert parts[0].start == 0 and parts[-1].stop == n
    for a, b in pairwise(parts):
        assert a.stop == b.start
    assert all(r.step == 1 and r.start <= r.stop for r in parts)
    assert [i for r in parts for i in r] == list(range(n))


def _weight(weights: list[float], r: range) -> float:
    return sum(max(0.0, weights[i]) for i in r)


CASES = [
    [1.0] * 8,
    [7, 12, 5, 9, 14, 6, 8, 11],
    [100, 1, 1, 1],  # one heavy head
    [1, 1, 1, 100],  # one heavy tail
    [1, 1, 100, 1, 1],
    [0, 0, 0, 0, 0],  # no weight: split by count
    [3, -2, 5, 0, 4],  # negative weights count as 0
    [5],
]


@pytest.mark.parametrize("weights", CASES)
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_shares_partition_nonempty_balanced(weights, parts):
    n = len(weights)
    got = shares(weights, parts)
    assert len(got) == parts
    _check_partition(got, n)
    if n >= parts:
        assert all(len(r) > 0 for r in got), got
    else:
        assert all(len(r) == 1 for r in got[:n]) and all(len(r) == 0 for r in got[n:]), got
    total = _weight(weights, range(n))
    heaviest = max((max(0.0, w) for w in weights), default=0.0)
    if total > 0:
        for r in got:
            assert _weight(weights, r) <= total / parts + heaviest + 1e-9, (got, r)
    else:  # no weight at all: nearly equal counts
        assert max(map(len, got)) - min(map(len, got)) <= 1, got
    assert shares(list(weights), parts) == got  # deterministic (and no state kept between calls)


def test_shares_random_properties():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 40)
        parts = rng.randint(1, 9)
        weights = [rng.choice([rng.uniform(0, 50), float(rng.randint(1, 200)), 0.0]) for _ in range(n)]
        got = shares(weights, parts)
        assert len(got) == parts
        if n:
            _check_partition(got, n)
        else:
            assert all(len(r) == 0 for r in got)
        if n >= parts:
            assert all(len(r) > 0 for r in got), (weights, parts, got)
        else:
            assert [len(r) for r in got] == [1] * n + [0] * (parts - n), (weights, parts, got)
        total = sum(weights)
        heaviest = max(weights, default=0.0)
        if total > 0:
            for r in got:
                assert _weight(weights, r) <= total / parts + heaviest + 1e-9, (weights, parts, got)
        assert shares(weights, parts) == got


def test_shares_balance_by_weight_not_count():
    # 2 long + 12 short items: an equal-count split (7 / 7) would put both long ones on rank 0
    weights = [6, 6] + [1] * 12
    assert shares(weights, 2) == [range(0, 2), range(2, 14)]
    assert shares([1.0] * 8, 2) == [range(0, 4), range(4, 8)]
    assert shares([1.0] * 9, 3) == [range(0, 3), range(3, 6), range(6, 9)]


def test_shares_fewer_items_than_parts():
    assert shares([1, 2], 4) == [range(0, 1), range(1, 2), range(2, 2), range(2, 2)]
    assert shares([3], 2) == [range(0, 1), range(1, 1)]
    assert shares([], 3) == [range(0, 0)] * 3


def test_shares_rejects_zero_parts():
    with pytest.raises(ValueError, match="parts"):
        shares([1, 2, 3], 0)


def test_outside_a_group_one_rank_takes_everything():
    assert not in_group() and rank() == 0 and world() == 1
    assert my_share([4, 5, 6]) == range(0, 3)


class _Worker:
    @merged("concat")
    def pieces(self):
        return None

    @merged("max")
    def canary(self):
        return None

    @merged("first")
    def explicit_first(self):
        return None

    def facts(self):
        return None


def test_merge_results_concat_lists_in_rank_order():
    assert merge_results(_Worker, "pieces", [[1, 2], [], [3]]) == [1, 2, 3]


def test_merge_results_concat_tensors_along_dim0():
    a, b = torch.arange(6.0).reshape(2, 3), torch.arange(6.0, 9.0).reshape(1, 3)
    out = merge_results(_Worker, "pieces", [a, b])
    assert out.shape == (3, 3) and torch.equal(out, torch.cat([a, b]))
    flat = merge_results(_Worker, "pieces", [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)])
    assert torch.equal(flat, torch.tensor([1, 2]))


def test_merge_results_max_first_and_default():
    assert merge_results(_Worker, "canary", [0.0, 0.5, 0.25]) == 0.5
    assert merge_results(_Worker, "explicit_first", ["r0", "r1"]) == "r0"
    assert merge_results(_Worker, "facts", [{"rank": 0}, {"rank": 1}]) == {"rank": 0}
    assert merge_results(_Worker, "no_such_method", [None, 1]) is None  # unknown -> first


def test_merged_rejects_unknown_mode():
    with pytest.raises(ValueError, match="merge must be one of"):
        merged("sum")
