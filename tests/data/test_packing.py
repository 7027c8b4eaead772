"""Token-budget planning of micro-batches (the forward layouts are tested in tests/models/test_forward.py)."""

from __future__ import annotations

from relayrl.data.packing import chunk_by_count, plan_token_budget


def test_plan_token_budget_first_fit_decreasing():
    # lengths 5,4,3,3,2,1 budget 7, longest first: 5 -> A; 4 -> B; 3 -> B (full); 3 -> C; 2 -> A; 1 -> C
    bins = plan_token_budget([5, 4, 3, 3, 2, 1], 7)
    assert bins == [[0, 4], [1, 2], [3, 5]]
    assert all(sum([5, 4, 3, 3, 2, 1][i] for i in b) <= 7 for b in bins)
    # an over-long sequence gets its own bin
    assert plan_token_budget([10, 2, 2], 4) == [[0], [1, 2]]
    assert chunk_by_count(5, 2) == [[0, 1], [2, 3], [4]]
