"""The storage writer of relayrl's DCP checkpoints: a rank's host memory bounded, its files written in parallel.

    save(state, checkpoint_id=folder, storage_writer=BoundedWriter(folder))   (relayrl.distributed.checkpoint)
    last_stats()                                                             what this process's last write did

Why not torch's FileSystemWriter as it comes (torch 2.11-2.13, read in filesystem.py): it puts a rank's whole
shard into one file written by one thread, and `_write_files_from_queue` keeps every tensor it copied to host
memory in a dict (`tensor_dict`, which only its safetensors format reads) until that file is closed. So a GPU
rank held a host copy of its entire model + optimizer shard during the save; and those copies are
`non_blocking` device-to-host copies, i.e. pinned memory from the caching host allocator, which rounds each
block up to a power of two (a 7B MLP shard of 68 MB takes a 128 MB block) and keeps the blocks after the save.
Measured 2026-11-27 (4 x H200, 6.5B parameters with fp32 masters and AdamW state on 4 ranks): every rank's RSS
grew by 36.1 GB for its 19.6 GB shard, and the save took 86.5 s (0.91 GB/s).

This writer keeps DCP's file layout and record format (a `.metadata` file plus `__<rank>_<i>.distcp` files of
torch.save records, which FileSystemReader reads however many files a rank wrote), so every loader reads both
old and new checkpoints unchanged. What differs:
- `default_threads()` files per rank (THREADS, fewer on a machine with fewer cores), each written by its own
  thread (tensors split by size, largest first);
- each tensor is copied to host memory just before its record is written and freed right after. A record of
  at most CHUNK_BYTES leaves a GPU through the thread's pinned CHUNK_BYTES buffer and is written from it; a
  larger one is copied through that buffer into a fresh host tensor, and the bytes so held at once by a
  rank's threads stay within HOST_BUDGET_BYTES (a tensor larger than the budget waits for the others and is
  held alone). A CPU tensor that owns exactly its bytes is written without a copy. A rank's extra host memory
  is therefore at most threads * CHUNK_BYTES + max(HOST_BUDGET_BYTES, its largest tensor);
- torch.save's per-record CRC setting (thread-local in torch) is the caller's in every writing thread, so
  relayrl.distributed.checkpoint's `without_zip_crc` holds there too;
- every file is fsynced before the save returns, as before (`sync_files`): a checkpoint is on disk when the
  checkpoint manager rotates older ones away.
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

THREADS = 4
"""Files (and writing threads) per rank, at most (`default_threads`): one thread copies and serialises a few
GB/s, a rank's 20 GB shard of a 7B checkpoint needs several to keep up with a node's disks, and a GPU node has
the cores (bench/save_time.py --paths ckpt measures it)."""
CHUNK_BYTES = 128 * 2**20
"""Each thread's pinned buffer for GPU -> host copies (a power of two: the caching host allocator wastes
nothing on it). 128 MiB holds a rank's share of every 7B matrix at 4 ranks (an MLP shard is 68 MB), so those
are written straight from it."""
HOST_BUDGET_BYTES = 2**30
"""Host bytes of staged tensors (larger than CHUNK_BYTES) a rank's threads may hold at once."""


@dataclass(kw_only=True, slots=True)
class WriteStats:
    """What one rank's `BoundedWriter.write_data` did (seconds are summed over its threads)."""

    files: int = 0
    """Data files this rank wrote."""
    bytes: int = 0
    """Bytes of those files."""
    records: int = 0
    """Records written (tensors and pickled objects)."""
    copied_records: int = 0
    """Records copied to host memory first (GPU tensors, CPU views of a larger storage)."""
    peak_held_bytes: int = 0
    """Most bytes of staged host tensors held at once by the rank's threads (the pinned buffers not counted)."""
    copy_s: float = 0.0
    """Seconds spent copying tensors to host memory."""
    write_s: float = 0.0
    """Seconds spent serialising records into the files."""
    sync_s: float = 0.0
    """Seconds spent in fsync."""
    wall_s: float = 0.0
    """Wall time of write_data."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **seconds: float) -> None:
        with self.lock:
            for k, v in seconds.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lock"}


_last: WriteStats | None = None


def last_stats() -> WriteStats | None:
    """The stats of this process's last `BoundedWriter.write_data` (None before any)."""
    return _last


class _Budget:
    """Host bytes the threads of one write may hold at once; a request over the limit waits for zero."""

    def __init__(self, limit: int, stats: WriteStats) -> None:
        self.limit, self.used, self.stats = limit, 0, stats
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        with self.cond:
            self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self.used)
        try:
            yield
        finally:
            with self.cond:
                self.used -= n
                self.cond.notify_all()


def _nbytes(item: WriteItem) -> int:
    data = item.tensor_data
    assert data is not None
    n = data.properties.dtype.itemsize
    for s in data.size:
        n *= s
    return n


def _buckets(items: list[WriteItem], n: int) -> list[list[WriteItem]]:
    """`items` over at most `n` files: pickled objects in the first, tensors largest first into the file with
    the fewest bytes so far."""
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    sizes = [0] * n
    buckets[0] += [it for it in items if it.type == WriteItemType.BYTE_IO]
    for it in sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=_nbytes, reverse=True):
        i = sizes.index(min(sizes))
        buckets[i].append(it)
        sizes[i] += _nbytes(it)
    return [b for b in buckets if b]


def _owns_exactly(t: torch.Tensor) -> bool:
    """A CPU tensor that torch.save writes as is: contiguous, its storage exactly its bytes."""
    return (
        t.device.type == "cpu"
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`raw` (uint8, exactly `like`'s bytes, its own storage) viewed with `like`'s dtype and shape."""
    if like.numel() == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    return raw.view(like.dtype).reshape(like.shape)


class _Sink:
    """A write-only view of the file for torch.save (no tell/seek: a record is one self-contained zip)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, b: Any) -> int:
        return self.stream.write(b)

    def flush(self) -> None:
        self.stream.flush()


class _Thread:
    """One writing thread's pinned buffer; stages one tensor at a time."""

    def __init__(self, budget: _Budget, stats: WriteStats) -> None:
        self.budget, self.stats = budget, stats
        self.pinned: torch.Tensor | None = None

    @contextlib.contextmanager
    def host(self, t: torch.Tensor) -> Iterator[torch.Tensor]:
        """`t` as a CPU tensor that owns exactly its bytes, valid inside the block."""
        if _owns_exactly(t):
            yield t
            return
        n = t.numel() * t.element_size()
        t0 = time.perf_counter()
        if t.device.type == "cuda":  # a new thread's current device is 0, not this rank's
            torch.cuda.set_device(t.device)
        if t.device.type != "cpu" and n <= CHUNK_BYTES:
            # from_numpy: a tensor whose storage is exactly these n bytes of the buffer (a slice's storage
            # would be the whole buffer, and torch.save writes whole storages)
            raw = torch.from_numpy(self._buffer()[:n].numpy())
            staged = _typed(raw, t)
            staged.copy_(t)
            self._copied(t0)
            yield staged
            return
        with self.budget.hold(n):
            raw = torch.empty(n, dtype=torch.uint8)
            staged = _typed(raw, t)
            if t.device.type == "cpu":
                staged.copy_(t)
            else:
                self._through_pinned(t, raw)
            self._copied(t0)
            try:
                yield staged
            finally:
                del raw, staged  # back to the OS before the budget is released

    def _buffer(self) -> torch.Tensor:
        """This thread's pinned CHUNK_BYTES buffer, allocated on first use."""
        if self.pinned is None:
            self.pinned = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        return self.pinned

    def _through_pinned(self, t: torch.Tensor, raw: torch.Tensor) -> None:
        pinned = self._buffer()
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        for i in range(0, flat.numel(), CHUNK_BYTES):
            m = min(CHUNK_BYTES, flat.numel() - i)
            pinned[:m].copy_(flat[i : i + m])
            raw[i : i + m].copy_(pinned[:m])

    def _copied(self, t0: float) -> None:
        self.stats.add(copy_s=time.perf_counter() - t0, copied_records=1)


def default_threads() -> int:
    """THREADS, or one per core on a machine with fewer (on 2 cores more threads only take turns)."""
    return max(1, min(THREADS, os.cpu_count() or 1))


def _crc_option() -> bool | None:
    """torch.save's per-record zip CRC setting in this thread (a thread-local setting: a new thread starts
    with it on, whatever its parent set); None on a torch without the setting."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    return get() if get is not None else None


class BoundedWriter(FileSystemWriter):
    """FileSystemWriter with `threads` files per rank and a rank's staged host memory bounded (module doc)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        threads: int | None = None,
        host_budget: int = HOST_BUDGET_BYTES,
        sync_files: bool = True,
    ) -> None:
        threads = default_threads() if threads is None else threads
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=threads)
        self.host_budget = host_budget

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        global _last
        t0 = time.perf_counter()
        stats = WriteStats()
        budget = _Budget(self.host_budget, stats)
        crc = _crc_option()  # torch.save's record CRC setting is per thread: the caller's, in every thread
        prefix = plan.storage_data.prefix
        jobs = [
            (f"{prefix}{i}{DEFAULT_SUFFIX}", b) for i, b in enumerate(_buckets(plan.items, self.thread_count))
        ]
        with ThreadPoolExecutor(max(1, len(jobs)), thread_name_prefix="dcp-write") as pool:
            futures = [
                pool.submit(self._write_file, name, items, planner, _Thread(budget, stats), crc)
                for name, items in jobs
            ]
            results = [r for f in futures for r in f.result()]
        stats.files, stats.wall_s = len(jobs), time.perf_counter() - t0
        stats.records = len(results)
        stats.bytes = sum(r.size_in_bytes for r in results)
        _last = stats
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, thread: _Thread, crc: bool | None
    ) -> list[WriteResult]:
        if crc is not None:
            torch.serialization.set_crc32_options(crc)
        results = []
        stats = thread.stats
        with Path(self.fs.concat_path(self.path, name)).open("wb") as stream:
            for item in items:
                offset = stream.tell()
                data = planner.resolve_data(item)
                if isinstance(data, io.BytesIO):  # WriteItemType.BYTE_IO: a pickled object
                    stream.write(data.getbuffer())
                else:
                    assert isinstance(data, torch.Tensor), type(data)
                    with thread.host(data.detach()) as host:
                        t0 = time.perf_counter()
                        torch.save(host, cast(IO[bytes], _Sink(stream)))
                        stats.add(write_s=time.perf_counter() - t0)
                length = stream.tell() - offset
                info = _StorageInfo(name, offset, length)
                results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=info))
            if self.sync_files:
                t0 = time.perf_counter()
                stream.flush()
                os.fsync(stream.fileno())
                stats.add(sync_s=time.perf_counter() - t0)
        thread.pinned = None
        return results
