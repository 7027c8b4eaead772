"""relayrl.distributed.dcp_writer: DCP records written by several threads per rank with the host memory they
stage bounded, read back bit for bit by torch's own reader, as a checkpoint written by torch's writer is."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from relayrl.distributed.dcp_writer import BoundedWriter, last_stats

KB = 1024
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state() -> dict:
    """Tensors of every kind the writer treats apart: CPU views of a larger storage (copied, 40 KB each), one
    view of 100 KB (over the test's 64 KB budget), tensors that own their bytes (written in place: fp32,
    bf16, a 0-dim int64, an empty one), and a plain object (pickled bytes)."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 10 * KB + 7, generator=g)
    big = torch.randn(26 * KB, generator=g)
    return {
        "views": {f"v{i}": base[i, : 10 * KB] for i in range(4)},  # 40 KB each, storage 4x larger
        "big": big[: 25 * KB],  # 100 KB of a 104 KB storage
        "own": torch.randn(3, 5, generator=g),
        "bf16": torch.randn(7, 3, generator=g).to(torch.bfloat16),
        "step": torch.tensor(12, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "meta": {"lr": 0.25, "betas": (0.9, 0.95)},
    }


def _zeros_like(state: dict) -> dict:
    """Where `load` puts a checkpoint of `state` back: zeroed tensors, placeholders for the objects."""
    out: dict = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros_like(v).contiguous()
        else:
            out[k] = _zeros_like(v) if k != "meta" else dict.fromkeys(v)
    return out


def _assert_same_bits(got: dict, want: dict) -> None:
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k].view(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
        elif k == "meta":
            assert got[k] == v
        else:
            _assert_same_bits(got[k], v)


def test_records_load_bit_identically_with_the_staged_bytes_in_budget(tmp_path):
    state = _state()
    writer = BoundedWriter(tmp_path / "new", threads=3, host_budget=64 * KB)
    save(state, checkpoint_id=str(tmp_path / "new"), storage_writer=writer)
    stats = last_stats()
    assert stats is not None
    # three files of this rank, however the tensors are spread; torch's writer: one
    assert sorted(p.name for p in (tmp_path / "new").glob("*.distcp")) == [
        f"__0_{i}.distcp" for i in range(3)
    ]
    # the five views were copied one at a time (two 40 KB copies exceed 64 KB; the 100 KB one is held
    # alone), the tensors that own their bytes were not copied at all
    assert stats.copied_records == 5 and stats.peak_held_bytes == 100 * KB, stats
    back = _zeros_like(state)
    load(back, checkpoint_id=str(tmp_path / "new"))
    _assert_same_bits(back, state)
    # torch's writer, read by the same reader: the same metadata entries
    save(state, checkpoint_id=str(tmp_path / "old"), storage_writer=FileSystemWriter(tmp_path / "old"))
    new_md = FileSystemReader(str(tmp_path / "new")).read_metadata().state_dict_metadata
    old_md = FileSystemReader(str(tmp_path / "old")).read_metadata().state_dict_metadata
    assert new_md == old_md


def test_a_budget_that_holds_two_lets_two_threads_stage_at_once(tmp_path):
    state = {f"v{i}": torch.arange(4 * KB + 1, dtype=torch.float32)[: 4 * KB] for i in range(8)}  # 16 KB each
    writer = BoundedWriter(tmp_path, threads=2, host_budget=32 * KB)
    save(state, checkpoint_id=str(tmp_path), storage_writer=writer)
    stats = last_stats()
    assert stats is not None and stats.copied_records == 8 and stats.peak_held_bytes <= 32 * KB
    back = {k: torch.zeros(4 * KB) for k in state}
    load(back, checkpoint_id=str(tmp_path))
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.gpu
def test_gpu_tensors_are_staged_through_the_pinned_buffer_and_load_back_bit_identically(
    tmp_path, monkeypatch
):
    import relayrl.distributed.dcp_writer as dw

    monkeypatch.setattr(dw, "CHUNK_BYTES", 32 * KB)  # 50 KB goes through the chunks into a host tensor
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "small": torch.randn(3, 1000, device="cuda", generator=g),
        "big": torch.randn(25 * KB, device="cuda", generator=g).to(torch.bfloat16),
        "view": torch.randn(8, 1000, device="cuda", generator=g)[2:5],
    }
    save(
        state, checkpoint_id=str(tmp_path), storage_writer=BoundedWriter(tmp_path, threads=2, host_budget=KB)
    )
    stats = last_stats()
    assert stats is not None and stats.copied_records == 3 and stats.peak_held_bytes == 50 * KB, stats
    back = {k: torch.zeros_like(v, device="cpu").contiguous() for k, v in state.items()}
    load(back, checkpoint_id=str(tmp_path))
    for k, v in state.items():
        assert torch.equal(back[k], v.cpu()), k


def test_every_writing_thread_writes_records_with_the_caller_s_crc_setting(tmp_path, monkeypatch):
    """torch.save's record CRC setting is thread-local (a new thread starts with it on):
    relayrl.distributed.checkpoint turns it off around a save, and each writing thread must follow."""
    real, seen = torch.save, []

    def save_recording(*args, **kwargs):
        seen.append(torch.serialization.get_crc32_options())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "save", save_recording)
    state = {f"t{i}": torch.full((5,), float(i)) for i in range(4)}
    torch.serialization.set_crc32_options(False)
    try:
        save(state, checkpoint_id=str(tmp_path), storage_writer=BoundedWriter(tmp_path, threads=2))
    finally:
        torch.serialization.set_crc32_options(True)
    assert seen == [False] * 4
