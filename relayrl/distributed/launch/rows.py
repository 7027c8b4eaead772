"""Batches to Ray ranks without sending every rank every row: the driver puts a record (SequenceBatch,
Experience: slotted dataclasses of [B, ...] tensors) into Ray's object store in at most 64 BLOCKS OF
CONSECUTIVE ROWS (one row per object up to 64 rows, at least 1 MiB of rows per object; `block_rows`), once per
step, and hands the ranks a small `StoredRows` (row lengths, width, object refs); each rank fetches only the
blocks holding the rows it reads (its share, relayrl.workers.base.my_update_parts / model_ops.my_rows:
contiguous ranges, so at most one partial block more at each end). One object per row made the driver's puts grow with the global batch: ~2,000
`ray.put` calls a step at 1,024 samples, 0.7 s on a 2-core CPU host (bench/driver_step.py), then 130 (64
blocks a record), now about one per MiB of rows (`MIN_BLOCK_BYTES`: 4 blocks at 276-token rows).

    store = RowStore()                     on the driver (Roles owns one in ray mode)
    batch_rows = store.put(batch)          every row of the step's SequenceBatch serialised once ...
    exp_rows = store.put(exp)              ... and reused inside the Experience (only its own fields are new)
    policy.submit(PolicyWorker.update, exp_rows, kl)      # the ranks: exp_rows.select(my_rows) -> Experience

Before this, `RayRole.submit` put each call's whole argument once and every rank deserialised all of it: a
step serialised the batch for each of up to three log-prob / value passes and the experience for each of two
updates (~5x the experience), and each of N ranks read all of it. Now the driver serialises the experience
once per step (the object refs and lengths besides), and each rank reads ~1/N of it
(tests/distributed/test_transfer.py counts both).

`select(rows)` returns exactly what the record's own `select(rows)` returns (same rows, trimmed to the
longest), so the numerics do not depend on the transport. Each block is stored at the batch's full width as ONE
bytes object: each field's rows' raw bytes, field after field (a copy of the rows, bit for bit), the layout
(names, dtypes, row shapes) kept once in the StoredRows; raw bytes skip pickling, so the store holds the data and
little else (a small torch tensor pickles with ~300 bytes of header; a tensor view would pickle its whole
storage). The blocks' object refs travel as ONE object (put once per record), so a call's argument is one ref
plus the row lengths, not B refs. Ray is imported in the functions (optional dependency).

The one-model recipes (sft, rm, prm, dpo, kto, kd) send each optimizer step's micro-batches (a list of
records: SFTBatch, PairBatch, ...) the same way, ONE MICRO-BATCH PER OBJECT:

    items = StoredItems(micro_batches)     on the driver (relayrl.trainers.recipe.RemoteStep, ray mode)
    model.call(ModelWorker.step, items)    the ranks: items.take(my share of items.sizes) -> their records

Before, `RayRole.submit` put the step's whole list as one pickled object (each small tensor with ~300 bytes
of torch's pickle header: 1.6x the tensors' bytes for a step of ~100-token samples) and every rank
deserialised all of it. Each micro-batch is now ONE bytes object: a pickle of the record whose tensors are
left out (`pack`: a persistent id naming offset, dtype and shape) followed by the tensors' raw bytes, so the
driver serialises about the tensors' bytes once and each rank fetches only its share. `unpack(pack(x))`
equals x field by field, bit for bit (tensors come back contiguous, each with its own storage).
"""

from __future__ import annotations

import io
import pickle
import time
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import torch

T = TypeVar("T")

FETCH = {"seconds": 0.0, "rows": 0.0, "items": 0.0, "bytes": 0.0}
"""This process's running totals of fetches (seconds in `StoredRows.select` and `StoredItems.take`, rows and
items asked for, bytes of row blocks fetched): the transfer time of relayrl.distributed.launch.profile."""

MAX_BLOCKS = 64
"""Most objects one record's rows are put as (`block_rows`)."""

MIN_BLOCK_BYTES = 2**20
"""Fewest bytes of rows per stored object (`block_rows`; 0: no floor): a record of B bytes is put as at most
max(1, B // MIN_BLOCK_BYTES) objects. The fixed cost of a `ray.put` (~0.45 ms on a 2-core CPU host, whatever
the size) outweighs copying 1 MiB: the 4 MB batch of a 1,024-sample step (276 tokens wide) took 29 ms as 64
objects and 3.4 ms as 4 (bench/driver_step.py --min-block-bytes 0 against the default)."""


def block_rows(rows: int, max_blocks: int = 0, row_bytes: int = 0) -> int:
    """Rows per stored object of a record of `rows` rows of `row_bytes` bytes each: one object per row up to
    `max_blocks` rows, then ceil(rows / max_blocks) consecutive rows per object, and no fewer than
    MIN_BLOCK_BYTES of rows per object. Every `ray.put` costs the driver a fixed ~50-700 us (the object's
    registration, whatever its size: bench/driver_step.py), so a step of 2,048 rows put row by row spent more
    on the puts than on the bytes. A rank reads contiguous ranges of rows (its data-parallel share of each
    mini-batch), so it fetches at most one partial block at each end of a range: <= 2 blocks, 1/32 of the
    batch (or 2 MiB, when blocks are at their floor), more than its rows. `max_blocks` 0: MAX_BLOCKS;
    `row_bytes` 0: no byte floor."""
    blocks = max_blocks or MAX_BLOCKS
    if MIN_BLOCK_BYTES > 0 and row_bytes > 0:
        blocks = min(blocks, max(1, rows * row_bytes // MIN_BLOCK_BYTES))
    return max(1, -(-rows // blocks))


def _block(record: Any, names: list[str], start: int, stop: int) -> bytes:
    """Rows start..stop-1 of the named tensor fields of `record` (those not None) as one bytes object: each
    field's rows (C order), field after field."""
    return b"".join(getattr(record, n)[start:stop].numpy().tobytes() for n in names)


def _schema(record: Any, names: list[str]) -> list[tuple[str, np.dtype, tuple[int, ...]] | None]:
    """(name, numpy dtype, shape of one row) of each named field; None for a field that is None."""
    out: list[tuple[str, np.dtype, tuple[int, ...]] | None] = []
    for n in names:
        x = getattr(record, n)
        if x is not None and not isinstance(x, torch.Tensor):  # e.g. a VLM batch's images (docs/vlm.md)
            raise TypeError(
                f"{type(record).__name__}.{n} cannot cross Ray's row store; run VLMs in local mode"
            )
        out.append(None if x is None else (n, x[:1].numpy().dtype, tuple(x.shape[1:])))
    return out


class StoredRows(Generic[T]):
    """A record in Ray's object store, in blocks of consecutive rows (see module doc). Satisfies
    relayrl.workers.base.Rows[T]: `lengths`, `width`, `select(rows)`."""

    def __init__(self, record: T, nested: dict[str, StoredRows[Any]]) -> None:
        """Put `record`'s own tensor fields in blocks of consecutive rows; its dataclass fields are `nested` stores (put
        already)."""
        import ray

        if not is_dataclass(record):
            raise TypeError(f"StoredRows holds a dataclass record of [B, ...] tensors, got {type(record)}")
        self.cls = type(record)
        self.lengths: list[int] = list(getattr(record, "lengths"))  # noqa: B009  (every record has it)
        self.width: int = int(getattr(record, "width"))  # noqa: B009
        self.nested = nested
        own = [f.name for f in fields(record) if f.name not in nested]
        self.schema = _schema(record, own)
        """Each own field's (name, dtype, row shape), or None: the rows are raw bytes in this layout."""
        self.none = [n for n, s in zip(own, self.schema, strict=True) if s is None]
        present = [n for n, s in zip(own, self.schema, strict=True) if s is not None]
        n = len(self.lengths)
        row_bytes = sum(
            int(np.prod(x[2], dtype=np.int64)) * x[1].itemsize for x in self.schema if x is not None
        )
        self.block = block_rows(n, row_bytes=row_bytes)
        """Rows per stored object (the last block may hold fewer): `block_rows`."""
        # raw bytes pickle to themselves (no per-array headers): the object store holds the data and little else
        blocks = [_block(record, present, a, min(a + self.block, n)) for a in range(0, n, self.block)]
        self.index = ray.put([ray.put(b) for b in blocks])
        """One object: the list of the blocks' object refs (block k: rows k*block .. (k+1)*block - 1, each
        field's rows after the previous field's)."""
        self._refs: list[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_refs": None}  # the block refs travel inside `index`, fetched on first use

    def _stacked(self, rows: list[int]) -> T:
        """The record of `rows` at the full width (not yet trimmed)."""
        import ray

        if self._refs is None:
            self._refs = ray.get(self.index)
        refs = self._refs
        size = self.block
        wanted = sorted({r // size for r in rows})
        got = ray.get([refs[k] for k in wanted])
        FETCH["bytes"] += sum(len(g) for g in got)
        counts = [min(size, len(self.lengths) - k * size) for k in wanted]  # rows of each fetched block
        starts = dict(zip(wanted, np.cumsum([0, *counts[:-1]]).tolist(), strict=True))
        at = torch.tensor([starts[r // size] + r % size for r in rows], dtype=torch.long)
        kw: dict[str, Any] = dict.fromkeys(self.none)
        offsets = [0] * len(got)
        for s in self.schema:
            if s is None:
                continue
            name, dtype, shape = s
            count = int(np.prod(shape, dtype=np.int64))
            parts = []
            for j, (g, c) in enumerate(zip(got, counts, strict=True)):
                parts.append(
                    np.frombuffer(g, dtype=dtype, count=c * count, offset=offsets[j]).reshape(c, *shape)
                )
                offsets[j] += c * count * dtype.itemsize
            kw[name] = torch.from_numpy(np.concatenate(parts))[at]
        for n, sub in self.nested.items():
            kw[n] = sub._stacked(rows)
        return self.cls(**kw)

    def select(self, rows: list[int]) -> T:
        """The record of `rows`, trimmed to its longest row: what `record.select(rows)` returns."""
        if not rows:
            raise ValueError("StoredRows.select: no rows")
        t0 = time.perf_counter()
        out = self._stacked(rows).select(list(range(len(rows))))  # type: ignore[attr-defined]
        FETCH["seconds"] += time.perf_counter() - t0
        FETCH["rows"] += len(rows)
        return out


class RowStore:
    """The driver's side: puts records in blocks of rows, each record once; a record nested in a later one (the
    step's SequenceBatch inside its Experience) is reused, not put again. Remembers the last few records."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._recent: list[tuple[Any, StoredRows[Any]]] = []
        self.seconds = 0.0
        """Running total of the driver's seconds in `put` (serialising rows and `ray.put`; `take_metrics`)."""
        self.objects = 0
        """Running total of objects put (blocks and indexes)."""

    def put(self, record: T) -> StoredRows[T]:
        for r, stored in self._recent:
            if r is record:
                return stored
        nested = {
            f.name: self.put(getattr(record, f.name))
            for f in fields(record)  # type: ignore[arg-type]  (a dataclass instance: checked by StoredRows)
            if is_dataclass(getattr(record, f.name))
        }
        t0 = time.perf_counter()
        stored = StoredRows(record, nested)
        self.seconds += time.perf_counter() - t0
        self.objects += 1 + -(-len(stored.lengths) // stored.block)  # the blocks and their index
        self._recent = [(record, stored), *self._recent][: self.keep]
        return stored

    def take_metrics(self) -> dict[str, float]:
        """timing/rows_put (the driver's seconds in `put` since the last call: a step's batch, in its
        experience phase, and its experience's own fields, in its update phase) and perf/rows_put_objects;
        resets both totals."""
        out = {"timing/rows_put": self.seconds, "perf/rows_put_objects": float(self.objects)}
        self.seconds, self.objects = 0.0, 0
        return out


# ------------------------------------------------------------------------------------------- micro-batches
class _Packer(pickle.Pickler):
    """Pickles a record with its tensors left out: each becomes a persistent id (offset, byte count, dtype
    name, shape) into `self.data`, which collects their raw bytes."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.data: list[bytes] = []
        self.at = 0

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        t = obj.detach().contiguous().reshape(-1)
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        pid = (self.at, len(raw), str(t.dtype).removeprefix("torch."), tuple(obj.shape))
        self.data.append(raw)
        self.at += len(raw)
        return pid


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, data: memoryview) -> None:
        super().__init__(file)
        self.data = data

    def persistent_load(self, pid: Any) -> torch.Tensor:
        offset, count, dtype, shape = pid
        if count == 0:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        raw = np.frombuffer(self.data, dtype=np.uint8, count=count, offset=offset).copy()  # its own storage
        return torch.from_numpy(raw).view(getattr(torch, dtype)).reshape(shape)


def pack(record: Any) -> bytes:
    """`record` (any picklable object holding CPU tensors) as one bytes object: 8 bytes of header length,
    the pickle of the record without its tensors, the tensors' raw bytes (see module doc)."""
    head = io.BytesIO()
    packer = _Packer(head)
    packer.dump(record)
    header = head.getvalue()
    return b"".join([len(header).to_bytes(8, "little"), header, *packer.data])


def unpack(blob: bytes) -> Any:
    """The record `pack` stored (tensors rebuilt from the raw bytes, bit for bit)."""
    n = int.from_bytes(blob[:8], "little")
    view = memoryview(blob)
    return _Unpacker(io.BytesIO(view[8 : 8 + n]), view[8 + n :]).load()


class StoredItems(Generic[T]):
    """A list of records (one step's micro-batches) in Ray's object store, one object per record (`pack`);
    satisfies relayrl.workers.base.Items[T]: `sizes`, `tokens`, `len`, `take(indices)`."""

    def __init__(self, items: Sequence[T]) -> None:
        import ray

        self.sizes: list[int] = [getattr(m, "num_tokens", 1) for m in items]
        """Each record's weight in the ranks' shares: its num_tokens (1 when it has none)."""
        self.tokens: list[int] = [int(getattr(m, "num_tokens", 0)) for m in items]
        """Each record's num_tokens (0 when it has none): the step's token count."""
        self.index = ray.put([ray.put(pack(m)) for m in items])
        """One object: the list of the records' object refs."""
        self._refs: list[Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_refs": None}  # the refs travel inside `index`, fetched on first use

    def __len__(self) -> int:
        return len(self.sizes)

    def take(self, indices: Sequence[int]) -> list[T]:
        """The records at `indices`, in that order (only those are fetched)."""
        import ray

        if not indices:
            return []
        t0 = time.perf_counter()
        if self._refs is None:
            self._refs = ray.get(self.index)
        refs = self._refs
        out = [unpack(b) for b in ray.get([refs[i] for i in indices])]
        FETCH["seconds"] += time.perf_counter() - t0
        FETCH["items"] += len(indices)
        return out
