"""CRC-32 of checkpoint files (the manifest's checksums), computed over chunks by several threads.

    file_crc32(path)          == zlib.crc32 of the whole file, the same number the serial loop gives
    crc32_combine(a, b, n)    crc32(A + B) from crc32(A) = a, crc32(B) = b and len(B) = n (zlib's algorithm)

A 7B policy's checkpoint holds ~78 GB (fp32 weights and two Adam moments); one thread checksums ~3-4 GB/s, so
the manifest alone took 20+ s on the driver. Chunks of CHUNK_BYTES are read and checksummed by THREADS threads
(zlib.crc32 and file reads release the GIL) and the chunk checksums are combined in order: the result is the
serial one, bit for bit, so manifests written before and after verify alike.
"""

from __future__ import annotations

import functools
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CHUNK_BYTES = 64 * 2**20
"""Bytes one thread reads and checksums at a time."""
THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads of `file_crc32` (and of checksumming several files at once)."""


def _times(mat: tuple[int, ...], vec: int) -> int:
    """GF(2) matrix (32 columns as ints) times vector."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[n]) for n in range(32))


@functools.lru_cache(maxsize=64)
def _shift(length: int) -> tuple[int, ...]:
    """The operator that appends `length` zero bytes to a CRC-32 register (zlib's crc32_combine)."""
    odd = (0xEDB88320, *(1 << n for n in range(31)))  # one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four zero bits
    op = tuple(1 << n for n in range(32))  # identity
    while length:
        even = _square(odd)  # the first pass: one zero byte
        if length & 1:
            op = tuple(_times(even, c) for c in op)
        length >>= 1
        if not length:
            break
        odd = _square(even)
        if length & 1:
            op = tuple(_times(odd, c) for c in op)
        length >>= 1
    return op


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib.crc32(a + b) from crc1 = crc32(a), crc2 = crc32(b), len2 = len(b)."""
    return _times(_shift(len2), crc1) ^ crc2 if len2 > 0 else crc1


_buffers = threading.local()


def _chunk_crc(path: Path, start: int, size: int) -> int:
    """crc32 of `size` bytes of the file from `start`, read into this thread's reused buffer (a fresh 64 MiB
    bytes object per chunk costs as much in page faults as the checksum)."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = _buffers.buf = bytearray(max(size, min(CHUNK_BYTES, 1 << 20)))
    view = memoryview(buf)
    crc, done = 0, 0
    with path.open("rb", buffering=0) as f:
        f.seek(start)
        while done < size:
            n = f.readinto(view[: size - done])
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            done += n
    return crc


def file_crc32(path: Path, pool: ThreadPoolExecutor | None = None) -> int:
    """zlib.crc32 of the file's bytes, its chunks checksummed in parallel (module doc)."""
    size = path.stat().st_size
    if size <= CHUNK_BYTES:
        return _chunk_crc(path, 0, size)
    starts = range(0, size, CHUNK_BYTES)
    own = pool is None
    pool = pool or ThreadPoolExecutor(THREADS)
    try:
        parts = list(
            pool.map(lambda s: (_chunk_crc(path, s, CHUNK_BYTES), min(CHUNK_BYTES, size - s)), starts)
        )
    finally:
        if own:
            pool.shutdown()
    crc = 0
    for part, n in parts:
        crc = crc32_combine(crc, part, n)
    return crc


def files_crc32(paths: list[Path]) -> dict[Path, int]:
    """file_crc32 of every path, the small files several at a time and every big file's chunks in parallel."""
    small = [p for p in paths if p.stat().st_size <= CHUNK_BYTES]
    big = [p for p in paths if p not in set(small)]
    with ThreadPoolExecutor(THREADS) as pool:
        out = dict(zip(small, pool.map(file_crc32, small), strict=True))
        for p in big:  # its chunks share the pool (a big file's chunks never wait on a nested pool)
            out[p] = file_crc32(p, pool)
    return out
