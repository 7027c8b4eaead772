"""The task seam: data generator + verifiable reward + evaluation.

A task produces rows in relayrl's standard data format (`{"input", "output", "label"}` keys), so the demo and
tests go through the same data loader as users' files. `reward` scores one decoded response against the
row's label; the RL loop calls it through the reward-source layer, never parsing text itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Protocol


class Task(Protocol):
    """A built-in task."""

    name: str

    def make_rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        """`n` rows `{"input": prompt text, "output": reference answer, "label": ground truth}` for `split`
        ("train" / "test"); train and test rows never share a prompt."""
        ...

    def reward(self, response: str, label: Any) -> float:
        """Reward in [0, 1] for one decoded response (stop token stripped)."""
        ...


TASKS: dict[str, Callable[[], Task]] = {}


def is_held_out(key: str, fraction: float = 0.2) -> bool:
    """Deterministic train/test assignment of an item by a hash of its key (blake2b, not Python's salted
    `hash()`): about `fraction` of keys are held out, with no arithmetic structure (a linear hash such as
    `(7919 a + 104729 b) mod 10` would hold out only sums ending in one or two digits)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def register_task(name: str) -> Callable[[Callable[[], Task]], Callable[[], Task]]:
    """Decorator: register a task factory under `name`."""

    def deco(factory: Callable[[], Task]) -> Callable[[], Task]:
        TASKS[name] = factory
        return factory

    return deco


def get_task(name: str) -> Task:
    """The task registered as `name`; a clear error lists the known ones."""
    _load_builtin()
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {sorted(TASKS)}")
    return TASKS[name]()


def _load_builtin() -> None:
    from relayrl.tasks import (
        arith,  # noqa: F401  (registers on import)
        guess,  # noqa: F401  (registers on import)
    )
