"""Token-budget micro-batching shared by SFT, RM/DPO and RL.

`plan_token_budget(lengths, max_tokens)` groups sequences into micro-batches of at most `max_tokens` tokens
(first-fit-decreasing); a sequence longer than the budget gets a micro-batch of its own.
`chunk_by_count(n, size)` cuts n items into consecutive chunks of `size`.

How a micro-batch's sequences then run through the model (one packed row with variable-length attention on
a GPU, length-bucketed padded rows on a CPU; never a dense block-causal mask) is relayrl.models.forward's job.
"""

from __future__ import annotations

from collections.abc import Sequence


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


def chunk_by_count(n: int, size: int) -> list[list[int]]:
    """[[0..size-1], [size..2size-1], ...] over n items (the last chunk may be shorter)."""
    if size <= 0:
        raise ValueError(f"micro-batch size must be > 0, got {size}")
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]
