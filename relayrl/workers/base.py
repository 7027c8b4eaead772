"""Records passed between the RL controller and the role workers, and the collation of trajectories.

    trajs: list[Trajectory]  --collate-->  SequenceBatch  --workers-->  Experience  --policy / critic update-->

Token alignment (one convention everywhere): every per-token tensor is [B, T] and lines up with `input_ids`;
position t holds the quantity *of token t* given the tokens before it: `logprobs[b, t] = log pi(x_t | x_<t)`,
`values[b, t] = V(x_<t)` (the state in which token t was chosen), `action_mask[b, t]` = token t was generated
by the policy. Column 0 never is an action (a prompt has >= 1 token). Rows are right-padded with the pad id;
padding has attention_mask False and action_mask False. The n samples of one prompt are contiguous rows (the
controller keeps groups together), which is what the group advantage estimators expect.

These records are plain tensors in slotted dataclasses, so they cross a Ray actor boundary by pickling.

What a worker method reads is a `Rows[...]` source: the record itself (local mode), or, on Ray, the record
stored one row per object (relayrl.distributed.launch.rows.StoredRows), from which each rank fetches only the
rows it reads. Workers pick their rows from `lengths` alone (`my_update_parts`; model_ops.my_rows), then `select`
them.

The one-model recipes' micro-batches come as an `Items[...]` source the same way: the list itself (local
mode), or its records in Ray's object store one per object (relayrl.distributed.launch.rows.StoredItems);
`as_items(x)` gives either as Items, and a rank `take`s only the records of its share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from relayrl.agents.base import Trajectory
from relayrl.distributed.group import my_data_share
from relayrl.rollout.media import ImageInputs

T_co = TypeVar("T_co", covariant=True)
T = TypeVar("T")


@dataclass(kw_only=True, slots=True)
class SequenceBatch:
    """Right-padded token tensors of B trajectories."""

    input_ids: Tensor
    """[B, T] long: prompt + response (+ env feedback) tokens, pad id after the end."""
    attention_mask: Tensor
    """[B, T] bool: True on real tokens."""
    action_mask: Tensor
    """[B, T] bool: True on tokens the policy generated (the loss positions)."""
    rollout_logprobs: Tensor
    """[B, T] float32: the engine's log-prob of each action token (0 elsewhere)."""
    routes: Tensor | None = None
    """[B, T, MoE layers, k] int16: the experts the engine routed each token to (routing replay), -1 where
    not recorded (the trainer routes those itself); None when routes were not recorded."""
    images: list[ImageInputs | None] | None = None
    """[B] each row's images (vision-language models, in token order), None when no row has any."""

    @property
    def lengths(self) -> list[int]:
        """Real length of each row."""
        return self.attention_mask.sum(1).tolist()

    @property
    def width(self) -> int:
        """T, the padded width."""
        return self.input_ids.shape[1]

    def select(self, rows: list[int] | Tensor) -> SequenceBatch:
        """The sub-batch of `rows`, trimmed to its longest row."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        width = int(self.attention_mask[idx].sum(1).max()) if len(idx) else 0
        images = None if self.images is None else [self.images[int(r)] for r in idx]
        return SequenceBatch(
            input_ids=self.input_ids[idx, :width],
            attention_mask=self.attention_mask[idx, :width],
            action_mask=self.action_mask[idx, :width],
            rollout_logprobs=self.rollout_logprobs[idx, :width],
            routes=None if self.routes is None else self.routes[idx, :width],
            images=images,
        )

    def flat_routes(self, rows: list[int]) -> Tensor | None:
        """The routes of `rows`' real tokens, concatenated in row order: [sum of lengths, layers, k]."""
        if self.routes is None:
            return None
        lengths = self.lengths
        return torch.cat([self.routes[r, : lengths[r]] for r in rows])


@dataclass(kw_only=True, slots=True)
class Experience:
    """What the update needs for one step's trajectories: SequenceBatch plus per-token training signals."""

    tokens: SequenceBatch
    """The sequences."""
    advantages: Tensor
    """[B, T] float32: advantage of each action token (0 elsewhere)."""
    rewards: Tensor
    """[B] float32: scalar reward per sequence after shaping."""
    old_logprobs: Tensor | None = None
    """[B, T] float32: log-probs of the policy that sampled, recomputed by the trainer before the update;
    None when the update is exactly on-policy (the update then uses its own detached log-probs)."""
    ref_logprobs: Tensor | None = None
    """[B, T] float32: reference-model log-probs (only when a KL term is on)."""
    values: Tensor | None = None
    """[B, T] float32: critic values V(x_<t) (gae only)."""
    returns: Tensor | None = None
    """[B, T] float32: value targets (gae only)."""

    @property
    def lengths(self) -> list[int]:
        """Real length of each row."""
        return self.tokens.lengths

    @property
    def width(self) -> int:
        """T, the padded width."""
        return self.tokens.width

    def select(self, rows: list[int] | Tensor) -> Experience:
        """The sub-experience of `rows`, trimmed to its longest row."""
        tokens = self.tokens.select(rows)
        idx = torch.as_tensor(rows, dtype=torch.long)
        width = tokens.input_ids.shape[1]

        def take(x: Tensor) -> Tensor:
            return x[idx] if x.dim() == 1 else x[idx, :width]

        def cut(x: Tensor | None) -> Tensor | None:
            return None if x is None else take(x)

        return Experience(
            tokens=tokens,
            old_logprobs=cut(self.old_logprobs),
            advantages=take(self.advantages),
            rewards=take(self.rewards),
            ref_logprobs=cut(self.ref_logprobs),
            values=cut(self.values),
            returns=cut(self.returns),
        )


def collate(trajs: list[Trajectory], pad_id: int) -> SequenceBatch:
    """Right-pad trajectories into a SequenceBatch (see module doc for the alignment)."""
    if not trajs:
        raise ValueError("collate: no trajectories to batch")
    lengths = [len(t.token_ids) for t in trajs]
    for t, n in zip(trajs, lengths, strict=True):
        if len(t.action_mask) != n or len(t.rollout_logprobs) != n:
            raise ValueError(
                f"trajectory of sample {t.sample.index}: token_ids ({n}), action_mask ({len(t.action_mask)}) "
                f"and rollout_logprobs ({len(t.rollout_logprobs)}) must have the same length"
            )
    width = max(lengths)
    b = len(trajs)
    # one tensor per field from the concatenated lists, scattered into the real positions (row-major order):
    # a tensor per row and field cost the driver ~3 x B small tensors a step
    attn = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    ids[attn] = _flat(trajs, "token_ids", np.int64, sum(lengths))
    act = torch.zeros((b, width), dtype=torch.bool)
    act[attn] = _flat(trajs, "action_mask", np.bool_, sum(lengths))
    lp = torch.zeros((b, width), dtype=torch.float32)
    lp[attn] = _flat(trajs, "rollout_logprobs", np.float32, sum(lengths))
    act[:, 0] = False
    images = [t.images for t in trajs] if any(t.images is not None for t in trajs) else None
    return SequenceBatch(
        input_ids=ids,
        attention_mask=attn,
        action_mask=act,
        rollout_logprobs=lp,
        routes=_routes(trajs, width),
        images=images,
    )


def _flat(trajs: list[Trajectory], name: str, dtype: Any, count: int) -> Tensor:
    """The trajectories' per-token lists `name` end to end, as one [count] tensor of numpy `dtype`: read
    straight from the lists by np.fromiter, ~4x faster than torch.tensor(list(...)) (2,048 rows of ~130
    tokens: 4 ms against 15 ms a field on a CPU core), with the same values (float32: each Python float
    rounded to nearest, as torch.tensor does)."""
    values = chain.from_iterable(getattr(t, name) for t in trajs)
    return torch.from_numpy(np.fromiter(values, dtype=dtype, count=count))


def _routes(trajs: list[Trajectory], width: int) -> Tensor | None:
    """[B, width, layers, k] int16 routes (-1 where none), when every trajectory carries some."""
    if not trajs or any(t.routes is None for t in trajs):
        return None
    first = trajs[0].routes
    out = torch.full((len(trajs), width, *first.shape[1:]), -1, dtype=torch.int16)
    for i, t in enumerate(trajs):
        out[i, : t.routes.shape[0]] = t.routes
    return out


def split_rows(num_rows: int, parts: int) -> list[list[int]]:
    """Split rows 0..num_rows-1 into `parts` contiguous, nearly equal chunks (mini-batches); empty ones dropped."""
    parts = max(1, min(parts, num_rows))
    base, extra = divmod(num_rows, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return [o for o in out if o]


class Rows(Protocol[T_co]):
    """A batch of rows (SequenceBatch / Experience) that a worker reads only part of: the record itself, or
    its rows in Ray's object store (relayrl.distributed.launch.rows.StoredRows)."""

    @property
    def lengths(self) -> list[int]:
        """Real length of every row of the whole batch."""
        ...

    @property
    def width(self) -> int:
        """The whole batch's padded width T."""
        ...

    def select(self, rows: list[int]) -> T_co:
        """The record of `rows` (global indices), trimmed to its longest row, as the record's own `select`."""
        ...


class Items(Protocol[T]):
    """A list of records (one step's micro-batches) that a rank reads only part of: a plain list (ListItems),
    or its records in Ray's object store (relayrl.distributed.launch.rows.StoredItems)."""

    @property
    def sizes(self) -> list[int]:
        """Each record's weight in the ranks' shares: its num_tokens (1 when it has none)."""
        ...

    @property
    def tokens(self) -> list[int]:
        """Each record's num_tokens (0 when it has none)."""
        ...

    def __len__(self) -> int: ...

    def take(self, indices: Sequence[int]) -> list[T]:
        """The records at `indices`, in that order."""
        ...


class ListItems:
    """A plain list of records as Items (local mode, and the callers that pass the list itself)."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items
        self.sizes: list[int] = [getattr(m, "num_tokens", 1) for m in items]
        self.tokens: list[int] = [int(getattr(m, "num_tokens", 0)) for m in items]

    def __len__(self) -> int:
        return len(self.items)

    def take(self, indices: Sequence[int]) -> list[Any]:
        return [self.items[i] for i in indices]


def as_items(source: Sequence[Any] | Items[Any]) -> Items[Any]:
    """`source` as Items: a list (or tuple) is wrapped in ListItems, stored items are returned as they are."""
    return ListItems(source) if isinstance(source, Sequence) else source


class Selectable(Protocol):
    """A record that selects its own rows (SequenceBatch, Experience)."""

    def select(self, rows: list[int]) -> Selectable: ...


S = TypeVar("S", bound=Selectable)


def take(source: Rows[S], groups: list[list[int]]) -> list[S]:
    """The records of several row groups of `source`, fetched together once (from Ray's object store: only
    these rows); each equals `source.select(group)`."""
    union = sorted({r for g in groups for r in g})
    if not union:
        return []
    whole = source.select(union)
    pos = {r: i for i, r in enumerate(union)}
    return [whole.select([pos[r] for r in g]) for g in groups]  # type: ignore[misc]  (S.select -> S)


def my_update_parts(exp: Rows[S], mini_batches: int) -> list[tuple[S, bool]]:
    """(this rank's rows of the mini-batch, real) for each mini-batch of an update (split_rows; this rank's
    data-parallel share of each, distributed.group.my_data_share), fetched together once. A rank left without
    rows of a mini-batch gets its first row as a padding pass (real False: weight 0, run to keep the ranks'
    collectives in step)."""
    lengths = exp.lengths
    groups: list[list[int]] = []
    real: list[bool] = []
    for mb in split_rows(len(lengths), mini_batches):
        mine = [mb[i] for i in my_data_share([lengths[r] for r in mb])]
        groups.append(mine or mb[:1])
        real.append(bool(mine))
    return list(zip(take(exp, groups), real, strict=True))
