"""The arithmetic tasks: disjoint, unstructured train/test splits and the exact-match reward."""

from __future__ import annotations

import pytest

from relayrl.tasks import get_task


def test_add2_split_is_disjoint_and_not_structured_by_the_answer():
    task = get_task("add2")
    train, test = set(task._pairs("train")), set(task._pairs("test"))
    assert not train & test
    assert len(train) + len(test) == 90 * 90
    # about 20% held out (8100 pairs: 1620 expected, std ~36)
    assert 1450 < len(test) < 1790
    # a split by a linear hash of (a, b) mod 10 held out only sums ending in 0 or 9: every last digit of the
    # sum must occur in both splits, with roughly the same frequency
    for split in (train, test):
        last = [(a + b) % 10 for a, b in split]
        counts = [last.count(d) / len(last) for d in range(10)]
        assert min(counts) > 0.05, counts


def test_add2_rows_and_reward():
    task = get_task("add2")
    rows = task.make_rows("test", 5, seed=1)
    assert rows == task.make_rows("test", 5, seed=1)
    for row in rows:
        a, b = (int(x) for x in row["input"].rstrip("=").split("+"))
        assert row["label"] == str(a + b) == row["output"]
        assert task.reward(f" {a + b} ", row["label"]) == 1.0
        assert task.reward(str(a + b + 1), row["label"]) == 0.0
    with pytest.raises(ValueError, match="only"):
        task.make_rows("test", 10_000, seed=0)
    with pytest.raises(ValueError, match="split"):
        task.make_rows("dev", 1, seed=0)
