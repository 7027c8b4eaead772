"""The task table: a plain dict of factories (no registration by import side effect), fresh tasks per call."""

from __future__ import annotations

import pytest

from relayrl.tasks import TASKS, get_task
from relayrl.tasks.arith import Addition
from relayrl.tasks.guess import GuessNumber


def test_table_names_every_builtin_task_and_builds_fresh_ones():
    assert sorted(TASKS) == ["add2", "add3", "guess"]
    assert get_task("add3") == Addition(digits=3, name="add3")
    assert isinstance(get_task("guess"), GuessNumber)
    assert get_task("add2") is not get_task("add2")


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown task 'add4'; known tasks: \['add2', 'add3', 'guess'\]"):
        get_task("add4")
