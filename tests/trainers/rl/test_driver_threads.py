"""The RL controller's torch CPU threads: few on a GPU run (its CPU work is many small tensor ops), more only
when the optimizer steps on the CPU (dist.offload), never more than torch's default."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from relayrl.config.rl import RLConfig
from relayrl.trainers.rl import setup as loop


@pytest.mark.parametrize(
    ("device", "offload", "default", "expected"),
    [
        ("cuda", False, 64, loop.DRIVER_THREADS_GPU),  # a 64-core GPU host: capped (was 64)
        ("cuda", True, 64, 64),  # CPU optimizer step in this process (local mode): keeps its threads
        ("cuda", False, 4, 4),  # never more than torch's default
        ("cpu", False, 64, 2),  # CPU runs: the ranks share the cores
        ("cpu", True, 1, 1),
    ],
)
def test_driver_threads(monkeypatch, device, offload, default, expected):
    monkeypatch.setattr(torch, "get_num_threads", lambda: default)
    cfg = RLConfig()
    cfg = replace(cfg, train=replace(cfg.train, device=device), dist=replace(cfg.dist, offload=offload))
    assert loop.driver_threads(cfg) == expected
