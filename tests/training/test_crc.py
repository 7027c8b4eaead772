"""The manifest's checksums computed over chunks by threads (relayrl.training.crc) are zlib.crc32 of the
whole file, bit for bit: chunk boundaries at every position of interest, empty files, many files at once;
and a checkpoint's save reports its time and bytes."""

from __future__ import annotations

import os
import zlib

import pytest

from relayrl.training import crc
from relayrl.training.checkpoint import CheckpointManager


@pytest.mark.parametrize("split", [0, 1, 7, 1000, 4095, 4096])
def test_combine_of_two_parts_is_the_crc_of_the_whole(split):
    data = os.urandom(4096)
    a, b = data[:split], data[split:]
    assert crc.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data)


def test_files_are_checksummed_chunk_by_chunk_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(crc, "CHUNK_BYTES", 1000)  # small chunks: every file over 1000 bytes is split
    sizes = [0, 1, 999, 1000, 1001, 2000, 12_345]
    paths = []
    for n in sizes:
        (p := tmp_path / f"f{n}").write_bytes(os.urandom(n))
        paths.append(p)
    got = crc.files_crc32(paths)
    assert got == {p: zlib.crc32(p.read_bytes()) for p in paths}
    assert crc.file_crc32(paths[-1]) == zlib.crc32(paths[-1].read_bytes())


def test_a_save_reports_its_seconds_and_bytes(tmp_path, capsys):
    mgr = CheckpointManager(tmp_path, hf_format=False)
    path = mgr.save(1, models={}, extra={"blob": b"x" * 5000})
    assert mgr.last_save is not None
    seconds, nbytes = mgr.last_save
    assert nbytes == sum(p.stat().st_size for p in path.rglob("*") if p.name != "manifest.json")
    assert nbytes > 5000 and seconds > 0
    assert f"relayrl: checkpoint {path} written: {nbytes / 1e9:.2f} GB in" in capsys.readouterr().out
