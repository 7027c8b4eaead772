"""Fixtures of the distributed tests: a one-rank gloo process group in this process (FSDP2 and DCP run on it
as on N ranks, without Ray or subprocesses)."""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture()
def one_rank_group(tmp_path):
    """The default process group of one gloo rank, destroyed after the test (TrainStep and friends read
    `dist.is_initialized()`, so none may leak into later tests)."""
    assert not dist.is_initialized(), "an earlier test left a process group"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
