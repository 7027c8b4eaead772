"""The task table: a plain dict of factories (no registration by import side effect), fresh tasks per call."""

from __future__ import annotations

import pytest

from relayrl.tasks import TASKS, get_task
from relayrl.tasks.arith import Addition
from relayrl.tasks.guess import GuessNumber


def test_table_names_every_builtin_task_and_builds_fresh_ones():
    assert sorted(TASKS) == ["add2", "add3", "guess", "image_digit"]
    assert get_task("add3") == Addition(digits=3, name="add3")
    assert isinstance(get_task("guess"), GuessNumber)
    assert get_task("add2") is not get_task("add2")


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown task 'add4'; known tasks: \['add2', 'add3', 'guess', 'image_digit'\]"
    ):
        get_task("add4")


def test_image_digit_rows_are_disjoint_pictures_with_one_image_each():
    from relayrl.tasks.image_digit import ImageDigit

    task = get_task("image_digit")
    train, test = task.make_rows("train", 200, 0), task.make_rows("test", 100, 0)
    assert all(r["input"] == "<image>digit?" and r["label"] == r["output"] for r in train + test)
    assert all(len(r["images"]) == 1 and r["images"][0].startswith("data:image/png;base64,") for r in train)
    assert {r["label"] for r in train} == set("0123456789")
    train_items, test_items = set(ImageDigit()._items("train")), set(ImageDigit()._items("test"))
    assert train_items and test_items and not train_items & test_items
    assert task.reward(" 7 ", "7") == 1.0 and task.reward("1", "7") == 0.0
