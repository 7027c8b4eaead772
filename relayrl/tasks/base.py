"""The task seam: data generator + verifiable reward + evaluation.

A task produces rows in relayrl's standard data format (`{"input", "output", "label"}` keys), so the demo and
tests go through the same data loader as users' files. `reward` scores one decoded response against the
row's label; the RL loop calls it through the reward-source layer, never parsing text itself.

This module holds the protocol and shared helpers only; the table of tasks is registry.py.
"""

from __future__ import annotations

import hashlib
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


def is_held_out(key: str, fraction: float = 0.2) -> bool:
    """Deterministic train/test assignment of an item by a hash of its key (blake2b, not Python's salted
    `hash()`): about `fraction` of keys are held out, with no arithmetic structure (a linear hash such as
    `(7919 a + 104729 b) mod 10` would hold out only sums ending in one or two digits)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction
