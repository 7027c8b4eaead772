"""Sample packing, padded batching and token-budget micro-batching (shared by SFT, RM/DPO and RL).

Two layouts of a list of variable-length token sequences, both described by one record, `TokenBatch`:

    packed  rows [R, T] (one row by default, or rows of <= row_len tokens): sequences concatenated;
            position_ids restart at 0 for each sequence and attention_mask is None. transformers 5 then derives a block-causal mask from the position
            resets (masking_utils.find_packed_sequence_indices; eager / sdpa / flex build it, flash-attention
            uses varlen), so attention never crosses sample boundaries. Needs `use_cache=False` (a cache
            disables the detection); `TokenBatch.model_inputs()` passes it.
    padded  one row per sequence [B, T_max], right-padded, attention_mask 1/0, position_ids 0..L-1.

Per-token side data (SFT labels, RL advantages / old log-probs / loss weights ...) travels in `fields`,
laid out exactly like input_ids, so a loss never needs to know which layout it got. `seq_ids` [B, T] maps
each token back to its sequence (-1 on padding) and `unbatch` splits any [B, T] tensor back per sequence.

`plan_token_budget(lengths, max_tokens)` groups sequences into micro-batches of at most `max_tokens` tokens
(first-fit-decreasing); a sequence longer than the budget gets a micro-batch of its own.

`shift_for_next_token(ids, mask)` turns one sample (input_ids, loss_mask over target tokens) into
next-token labels *within the sample* (the last token has no target), so a packed row never trains one
sample's first token from the previous sample's last token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100


@dataclass(kw_only=True, slots=True)
class TokenBatch:
    """A micro-batch of token sequences in the packed or padded layout."""

    input_ids: torch.Tensor
    """[B, T] int64 token ids (pad id on padding)."""
    position_ids: torch.Tensor
    """[B, T] int64: 0..L-1 within each sequence (padding continues as its own 0..k-1 run)."""
    attention_mask: torch.Tensor | None
    """[B, T] int64 1 = real token, 0 = padding (padded layout); None in the packed layout."""
    seq_ids: torch.Tensor
    """[B, T] int64: index into the input sequence list of each token's sequence; -1 on padding."""
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-token side data, each [B, T] in the same layout (padding filled with that field's pad value)."""
    num_tokens: int = 0
    """Real (non-padding) tokens in the batch."""
    num_sequences: int = 0
    """Sequences in the batch."""

    @property
    def packed(self) -> bool:
        return self.attention_mask is None

    def model_inputs(self) -> dict[str, torch.Tensor | bool | None]:
        """Keyword arguments for an HF model forward (no cache, so packed detection works)."""
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
            "use_cache": False,
        }


def _field_pad_values(fields: Mapping[str, Sequence[Sequence]], pad_values: Mapping[str, float] | None):
    pads = dict(pad_values or {})
    return {name: pads.get(name, 0) for name in fields}


def _check_fields(seqs: Sequence[Sequence[int]], fields: Mapping[str, Sequence[Sequence]]) -> None:
    for name, values in fields.items():
        if len(values) != len(seqs):
            raise ValueError(
                f"field {name!r} has {len(values)} sequences but there are {len(seqs)} token sequences"
            )
        for i, (s, v) in enumerate(zip(seqs, values, strict=True)):
            if len(v) != len(s):
                raise ValueError(f"field {name!r} of sequence {i} has length {len(v)}, its tokens {len(s)}")


def _dtype_of(values: Sequence[Sequence]) -> torch.dtype:
    for v in values:
        for x in v:
            if isinstance(x, bool):
                return torch.bool
            return torch.int64 if isinstance(x, int) else torch.float32
    return torch.float32


def pack(
    seqs: Sequence[Sequence[int]],
    fields: Mapping[str, Sequence[Sequence]] | None = None,
    *,
    pad_id: int = 0,
    pad_values: Mapping[str, float] | None = None,
    pad_to_multiple_of: int = 1,
    row_len: int | None = None,
) -> TokenBatch:
    """Pack `seqs` into rows without cross-sample attention: [1, T] by default.

    row_len: pack into several rows of at most row_len tokens (first-fit-decreasing over the sequences; a
    longer sequence gets a row of its own), stacked as [R, T] with T the fullest row. Rows as long as the
    longest sample keep attention cost at the padded layout's level (attention is quadratic in the row
    length) with far less padding, in one forward pass. Tokens keep input order inside each row.
    """
    fields = dict(fields or {})
    _check_fields(seqs, fields)
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pack needs at least one sequence and no empty sequences")
    lengths = [len(s) for s in seqs]
    rows = plan_token_budget(lengths, row_len) if row_len else [list(range(len(seqs)))]
    longest_row = max(sum(lengths[i] for i in row) for row in rows)
    total = -(-longest_row // pad_to_multiple_of) * pad_to_multiple_of
    shape = (len(rows), total)
    ids = torch.full(shape, pad_id, dtype=torch.int64)
    pos = torch.zeros(shape, dtype=torch.int64)
    sid = torch.full(shape, -1, dtype=torch.int64)
    pads = _field_pad_values(fields, pad_values)
    out_fields = {k: torch.full(shape, pads[k], dtype=_dtype_of(v)) for k, v in fields.items()}
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            end = at + lengths[i]
            ids[r, at:end] = torch.as_tensor(list(seqs[i]), dtype=torch.int64)
            pos[r, at:end] = torch.arange(lengths[i])
            sid[r, at:end] = i
            for k, v in fields.items():
                out_fields[k][r, at:end] = torch.as_tensor(list(v[i]), dtype=out_fields[k].dtype)
            at = end
        pos[r, at:] = torch.arange(total - at)  # the padding tail is a separate "sequence"
    return TokenBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=None,
        seq_ids=sid,
        fields=out_fields,
        num_tokens=sum(lengths),
        num_sequences=len(seqs),
    )


def pad(
    seqs: Sequence[Sequence[int]],
    fields: Mapping[str, Sequence[Sequence]] | None = None,
    *,
    pad_id: int = 0,
    pad_values: Mapping[str, float] | None = None,
    pad_to_multiple_of: int = 1,
) -> TokenBatch:
    """One right-padded row per sequence [B, T_max] with an attention mask."""
    fields = dict(fields or {})
    _check_fields(seqs, fields)
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("pad needs at least one sequence and no empty sequences")
    longest = max(len(s) for s in seqs)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    b = len(seqs)
    ids = torch.full((b, width), pad_id, dtype=torch.int64)
    mask = torch.zeros((b, width), dtype=torch.int64)
    sid = torch.full((b, width), -1, dtype=torch.int64)
    pads = _field_pad_values(fields, pad_values)
    out_fields = {k: torch.full((b, width), pads[k], dtype=_dtype_of(v)) for k, v in fields.items()}
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.int64)
        mask[i, : len(s)] = 1
        sid[i, : len(s)] = i
        for k, v in fields.items():
            out_fields[k][i, : len(s)] = torch.as_tensor(list(v[i]), dtype=out_fields[k].dtype)
    pos = torch.arange(width).expand(b, width).clone()
    return TokenBatch(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask,
        seq_ids=sid,
        fields=out_fields,
        num_tokens=int(mask.sum()),
        num_sequences=b,
    )


def unbatch(batch: TokenBatch, values: torch.Tensor) -> list[torch.Tensor]:
    """Split a [B, T, ...] tensor laid out like `batch` into one tensor per sequence (input order)."""
    flat_ids = batch.seq_ids.reshape(-1)
    flat = values.reshape(flat_ids.numel(), *values.shape[2:])
    return [flat[flat_ids == i] for i in range(batch.num_sequences)]


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


def shift_for_next_token(input_ids: Sequence[int], loss_mask: Sequence[int | bool]) -> list[int]:
    """Next-token labels of one sample: labels[t] = input_ids[t+1] if loss_mask[t+1] else IGNORE_INDEX.

    The last position gets IGNORE_INDEX. Example: ids [5, 6, 7], mask [0, 1, 1] -> labels [6, 7, -100].
    """
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"loss_mask has length {len(loss_mask)}, input_ids {len(input_ids)}")
    labels = [int(tok) if m else IGNORE_INDEX for tok, m in zip(input_ids[1:], loss_mask[1:], strict=True)]
    return [*labels, IGNORE_INDEX]
