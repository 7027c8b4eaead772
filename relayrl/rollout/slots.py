"""The native engine's slot pool and prefix cache: which KV-cache rows are free, and which finished ones still
hold a sequence's K/V worth reusing.

    pool = SlotPool(max_slots, prefix_cache=True, min_prefix_tokens=8)
    pool.available()            slots a request may take now (empty + parked)
    pool.take()                 an empty slot (lowest id first), else the least recently parked one
    pool.match(prompt)          (parked slot, m): the slot holds K/V of prompt[:m] (longest indexed prefix,
                                min_prefix_tokens <= m <= len(prompt) - 1), or None; `claim(slot)` then takes it
    pool.park(slot, tokens)     a finished slot keeps K/V of `tokens` (positions [0, len)); when the cache is
                                off or the sequence is short, it is simply freed
    pool.release(slot)          back to the empty slots (cancelled, aborted, or K/V not worth keeping)
    pool.swap_free(taken, freed) the engine moved samples from slots `freed` into empty slots `taken`
    pool.drop_parked()          forget every parked sequence (new weights, sleep)

Index: for each parked sequence, its prefix hashes at every PREFIX_STRIDE-th length from min_prefix_tokens
and at its full length map to the slot. A lookup computes the prompt's prefix hashes once, probes each length
from the longest down and compares the candidate's tokens (hashes can collide). So a next turn of a
multi-turn episode (its prompt extends the whole parked sequence) reuses all of it, and a repeated prompt
reuses all but at most PREFIX_STRIDE of its tokens.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

PREFIX_STRIDE = 8
"""Indexed prefix lengths of a parked sequence are every 8th one (and the full length)."""


def prefix_hashes(tokens: list[int], upto: int) -> list[int]:
    """h[L] = polynomial hash of tokens[:L] for L in [0, upto] (one pass)."""
    out, h = [0], 0
    for t in tokens[:upto]:
        h = (h * 1_000_003 + t + 1) & 0xFFFFFFFFFFFFFFF
        out.append(h)
    return out


class SlotPool:
    """Free and parked slots of the native engine (see module doc)."""

    def __init__(self, max_slots: int, *, prefix_cache: bool = True, min_prefix_tokens: int = 8) -> None:
        self.free: list[int] = list(range(max_slots))
        """Empty slots, a heap (lowest id first keeps decode batches short)."""
        self.enabled = prefix_cache
        self.min_tokens = max(1, min_prefix_tokens)
        self.parked: OrderedDict[int, list[int]] = OrderedDict()
        """slot -> the tokens whose K/V it holds at positions [0, len), least recently parked first."""
        self.index: dict[tuple[int, int], set[int]] = {}
        """(prefix length, prefix hash) -> parked slots holding that prefix."""

    def available(self) -> int:
        return len(self.free) + len(self.parked)

    def take(self) -> int:
        if self.free:
            return heapq.heappop(self.free)
        slot = next(iter(self.parked))
        self.claim(slot)
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)

    def swap_free(self, taken: list[int], freed: list[int]) -> None:
        """Empty slots `taken` are now in use and slots `freed` are empty (the engine moved samples)."""
        gone = set(taken)
        self.free = [s for s in self.free if s not in gone] + list(freed)
        heapq.heapify(self.free)

    def _lengths(self, n: int) -> list[int]:
        lo = self.min_tokens
        return sorted({*range(lo, n + 1, PREFIX_STRIDE), n}) if n >= lo else []

    def match(self, prompt: list[int]) -> tuple[int, int] | None:
        if not self.parked:
            return None
        hashes = prefix_hashes(prompt, len(prompt) - 1)
        for m in range(len(prompt) - 1, self.min_tokens - 1, -1):
            for slot in self.index.get((m, hashes[m]), ()):
                if self.parked[slot][:m] == prompt[:m]:
                    return slot, m
        return None

    def park(self, slot: int, tokens: list[int]) -> None:
        if not self.enabled or len(tokens) < self.min_tokens:
            self.release(slot)
            return
        self.parked[slot] = tokens
        hashes = prefix_hashes(tokens, len(tokens))
        for n in self._lengths(len(tokens)):
            self.index.setdefault((n, hashes[n]), set()).add(slot)

    def claim(self, slot: int) -> None:
        """Take parked `slot` out of the cache (its K/V are about to be reused or overwritten)."""
        tokens = self.parked.pop(slot)
        hashes = prefix_hashes(tokens, len(tokens))
        for n in self._lengths(len(tokens)):
            key = (n, hashes[n])
            self.index[key].discard(slot)
            if not self.index[key]:
                del self.index[key]

    def drop_parked(self) -> None:
        for slot in list(self.parked):
            self.claim(slot)
            self.release(slot)
