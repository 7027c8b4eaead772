"""The table of built-in tasks: name -> factory, a plain dict (no registration by import side effect).

    task = get_task("add2")          Addition(digits=2); a clear error lists the known names

A new task is one module beside arith.py / guess.py plus one line here.
"""

from __future__ import annotations

from collections.abc import Callable

from relayrl.tasks.arith import Addition
from relayrl.tasks.base import Task
from relayrl.tasks.guess import GuessNumber
from relayrl.tasks.image_digit import ImageDigit

TASKS: dict[str, Callable[[], Task]] = {
    "add2": lambda: Addition(digits=2, name="add2"),
    "add3": lambda: Addition(digits=3, name="add3"),
    "guess": lambda: GuessNumber(),
    "image_digit": lambda: ImageDigit(),
}
"""Task name -> a factory of a fresh task object."""


def get_task(name: str) -> Task:
    """The task registered as `name`; a clear error lists the known ones."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name]()
