"""THE micro-batch planner, shared by SFT, RM/DPO/KTO/KD/PRM and the RL workers.

    plan_token_budget(lengths, max_tokens)          bins of <= max_tokens tokens (first-fit-decreasing)
    plan_micro_batches(lengths, budget, layout)     the layout-aware token budget: varlen -> plan_token_budget,
                                                    padded -> length-sorted runs with rows * longest <= budget
    chunk_by_count(n, size)                         consecutive chunks of `size` items (eval / scoring passes)
    MicroBatching.of(train, layout).groups(sizes)   one optimizer step's samples -> index groups, per the train
                                                    section (packing + token budget, else micro_batch_size)
    balance_by_tokens(sizes, parts)                 samples -> `parts` groups of nearly equal tokens (longest first)
    count_ranges(counts)                            each rank's range of a RankBatches list from its counts
    make_collate(samples, train, layout, to_batch, parts=R)
                                                    step indices -> micro-batch records (`to_batch` per group); with
                                                    R data-parallel ranks and a token budget: RankBatches, each
                                                    rank's own micro-batches packed from its token-balanced share

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


def balance_by_tokens(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of `sizes` in `parts` groups of nearly equal total size: longest first (ties: lower index), each
    to the group with the least total so far (ties: the lower group). Every group's total is within the largest
    size of every other's (greedy longest-processing-time). Indices ascending inside a group; a group is empty
    only when there are fewer items than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        g = min(range(parts), key=lambda k: (load[k], k))
        groups[g].append(i)
        load[g] += sizes[i]
    return [sorted(g) for g in groups]


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


class RankBatches(list):
    """One optimizer step's micro-batches planned per data-parallel rank: rank 0's first, then rank 1's, ...;
    `counts[r]` of them are rank r's (0: the rank runs a padding pass, relayrl.training.step.padded_passes)."""

    def __init__(self, batches: Sequence[Any] = (), counts: Sequence[int] = ()) -> None:
        super().__init__(batches)
        if sum(counts) != len(self):
            raise ValueError(f"RankBatches: counts {list(counts)} do not add up to {len(self)} micro-batches")
        self.counts: list[int] = list(counts)
        """Micro-batches of each rank, in rank order."""


def count_ranges(counts: Sequence[int]) -> list[range]:
    """Each rank's range of a RankBatches list from its `counts` (rank r's micro-batches follow the earlier
    ranks')."""
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def make_collate(
    samples: Sequence[Any],
    train: TrainConfig,
    layout: str,
    to_batch: Callable[[list[Any], str], Any],
    size: Callable[[Any], int] = lambda s: s.num_tokens,
    parts: int = 1,
) -> Callable[[list[int]], list[Any]]:
    """step indices -> micro-batches (each `to_batch` of its samples; `size` a sample's token count).

    `parts` > 1 data-parallel ranks with a token budget (train.packing and max_tokens_per_micro_batch > 0): the
    step's samples are first split over the ranks by tokens (`balance_by_tokens`: every rank within one
    sample of every other), then each rank's share is packed on its own, and the result is a RankBatches.
    Packing the whole step first and handing out whole packs instead leaves the ranks a pack apart (16k
    tokens at 4 ranks of ~34k each) and the short ranks re-run a pack as padding. The loss is normalised by
    the step's global count either way, so the update is the same up to fp32 summation order."""
    batching = MicroBatching.of(train, layout)
    per_rank = parts > 1 and batching.packing and batching.max_tokens > 0

    def collate(indices: list[int]) -> list[Any]:
        chosen = [samples[i] for i in indices]
        sizes = [size(s) for s in chosen]
        if not per_rank:
            return [to_batch([chosen[i] for i in g], layout) for g in batching.groups(sizes)]
        batches, counts = [], []
        for share in balance_by_tokens(sizes, parts):
            groups = batching.groups([sizes[i] for i in share])
            batches += [to_batch([chosen[share[j]] for j in g], layout) for g in groups]
            counts.append(len(groups))
        return RankBatches(batches, counts)

    return collate
