"""THE micro-batch planner, shared by SFT, RM/DPO/KTO/KD/PRM and the RL workers.

    plan_token_budget(lengths, max_tokens)          bins of <= max_tokens tokens (first-fit-decreasing)
    plan_micro_batches(lengths, budget, layout)     the layout-aware token budget: varlen -> plan_token_budget,
                                                    padded -> length-sorted runs with rows * longest <= budget
    chunk_by_count(n, size)                         consecutive chunks of `size` items (eval / scoring passes)
    MicroBatching.of(train, layout).groups(sizes)   one optimizer step's samples -> index groups, per the train
                                                    section (packing + token budget, else micro_batch_size)
    make_collate(samples, train, layout, to_batch)  step indices -> micro-batch records (`to_batch` per group)

Every planner returns lists of indices: each index exactly once, ascending inside a group. How a
micro-batch's sequences then run through the model (one packed row with variable-length attention on a GPU,
length-bucketed padded rows on a CPU; never a dense block-causal mask) is relayrl.models.forward's job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from relayrl.config.components import TrainConfig

LAYOUTS = ("varlen", "padded", "exact")
"""Attention layouts of a micro-batch (relayrl.models.forward runs them): one packed row, padded rows, or the
exact on-policy mode's batch-invariant forward (relayrl/rollout/exact.py; batched like padded)."""


def check_layout(layout: str) -> None:
    """ValueError naming the known layouts."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def plan_token_budget(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group indices of `lengths` into bins of total length <= max_tokens (first-fit-decreasing).

    Bins come out in order of their first (longest) member; indices inside a bin are ascending. A length
    above the budget gets a bin of its own (it still has to be trained on).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def plan_micro_batches(lengths: Sequence[int], budget: int, layout: str) -> list[list[int]]:
    """Row indices of each micro-batch (every index exactly once; ascending inside a bin).

    varlen: bins of at most `budget` real tokens, first-fit-decreasing (`plan_token_budget`).
    padded: rows sorted by length (descending, stable), cut into consecutive runs with
    rows * longest <= budget, so rows of similar length share a bin and padding stays small.
    Either way a row longer than the budget gets a bin of its own.
    """
    check_layout(layout)
    if budget <= 0:
        raise ValueError(f"token budget must be > 0, got {budget}")
    if layout == "varlen":
        return plan_token_budget(lengths, budget)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    for i in order:
        if bins and (len(bins[-1]) + 1) * lengths[bins[-1][0]] <= budget:
            bins[-1].append(i)
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def chunk_by_count(n: int, size: int) -> list[list[int]]:
    """[[0..size-1], [size..2size-1], ...] over n items (the last chunk may be shorter)."""
    if size <= 0:
        raise ValueError(f"micro-batch size must be > 0, got {size}")
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


@dataclass(frozen=True, kw_only=True, slots=True)
class MicroBatching:
    """How one optimizer step's samples are cut into micro-batches."""

    layout: str = "padded"
    """Attention layout of the forward (LAYOUTS): decides how a token budget is spent."""
    packing: bool = False
    """Group by token budget (with max_tokens > 0), else by count."""
    micro_batch_size: int = 1
    """Samples per micro-batch when not grouping by tokens."""
    max_tokens: int = 0
    """Token budget of a micro-batch when packing (0: by count)."""

    @classmethod
    def of(cls, train: TrainConfig, layout: str) -> MicroBatching:
        """From a train section: train.packing, train.micro_batch_size, train.max_tokens_per_micro_batch."""
        return cls(
            layout=layout,
            packing=train.packing,
            micro_batch_size=train.micro_batch_size,
            max_tokens=train.max_tokens_per_micro_batch,
        )

    def groups(self, sizes: Sequence[int]) -> list[list[int]]:
        """Index groups of one step's samples (`sizes`: their token counts): by token budget when packing
        with max_tokens > 0 (`plan_micro_batches`), else consecutive chunks of micro_batch_size."""
        if self.packing and self.max_tokens > 0:
            return plan_micro_batches(list(sizes), self.max_tokens, self.layout)
        return chunk_by_count(len(sizes), self.micro_batch_size)


def make_collate(
    samples: Sequence[Any],
    train: TrainConfig,
    layout: str,
    to_batch: Callable[[list[Any], str], Any],
    size: Callable[[Any], int] = lambda s: s.num_tokens,
) -> Callable[[list[int]], list[Any]]:
    """step indices -> micro-batches (each `to_batch` of its samples; `size` a sample's token count)."""
    batching = MicroBatching.of(train, layout)

    def collate(indices: list[int]) -> list[Any]:
        chosen = [samples[i] for i in indices]
        groups = batching.groups([size(s) for s in chosen])
        return [to_batch([chosen[i] for i in g], layout) for g in groups]

    return collate
