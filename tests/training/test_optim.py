"""build_optim / schedule_lr read an optimizer section through `OptimSettings` (the eight fields they use),
so any object with those fields builds the same AdamW and schedule; schedule_lr is the scheduler's own lr.
(Param groups and the lr_factor formula: tests/training/test_step.py.)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from relayrl.config.components import OptimConfig
from relayrl.training.optim import (
    Schedule,
    build_optim,
    build_optimizer,
    schedule_lr,
)


@dataclass
class Settings:
    """Not an OptimConfig: only the fields OptimSettings names."""

    name: str = "adamw"
    muon_momentum: float = 0.95
    lr: float = 0.1
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.8, 0.9)
    eps: float = 1e-6
    scheduler: str = "cosine"
    warmup_steps: int = 2
    warmup_ratio: float = 0.0
    min_lr_ratio: float = 0.5


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def test_any_object_with_the_eight_fields_builds_the_optimizer_and_schedule():
    opt, sched = build_optim(_model(), Settings(), total_steps=6)
    assert isinstance(opt, torch.optim.AdamW) and isinstance(sched, Schedule)
    decay, no_decay = opt.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.01, 0.0)
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-6 and decay["foreach"]
    # warmup 2 steps: 0.1 * 1/2 at step 0 (the lr the first step uses)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05, rel=1e-12)


def test_schedule_lr_is_the_lr_the_scheduler_sets_at_every_step():
    cfg = Settings()
    opt, sched = build_optim(_model(), cfg, total_steps=6)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == [schedule_lr(cfg, s, 6) for s in range(6)]  # the same float products
    # by hand: warmup (s + 1) / 2, then cosine from 1 to min_lr_ratio 0.5 over the 4 steps after it
    cos = [0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(4)]
    assert seen == pytest.approx([0.1 * f for f in [0.5, 1.0, *cos]], rel=1e-12)


def test_an_optim_config_and_a_plain_settings_object_agree():
    config = OptimConfig(lr=0.1, weight_decay=0.01, adam_betas=(0.8, 0.9), eps=1e-6, warmup_steps=2,
                         min_lr_ratio=0.5)  # fmt: skip
    assert [schedule_lr(config, s, 6) for s in range(6)] == [schedule_lr(Settings(), s, 6) for s in range(6)]


def test_fsdp2_shards_in_cpu_memory_step_with_the_fused_cpu_adamw(tmp_path):
    """dist.offload keeps a 7B policy's shards (DTensors) in CPU memory, where the optimizer step runs: torch's
    fused CPU AdamW (11x foreach's speed measured), with foreach's numbers; plain CPU tensors keep foreach."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        w, g = torch.randn(16, 8), torch.randn(16, 8)
        plain = torch.nn.Parameter(w.clone())
        plain.grad = g.clone()
        local = distribute_tensor(w.clone(), mesh, [Shard(0)])
        shard = torch.nn.Parameter(local)
        shard.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
        opts = [build_optimizer([("w", p)], lr=1e-2, weight_decay=0.1) for p in (plain, shard)]
        assert opts[0].defaults["fused"] is None and opts[0].defaults["foreach"] is True
        assert opts[1].defaults["fused"] is True
        for _ in range(3):
            for o in opts:
                o.step()
        torch.testing.assert_close(local.full_tensor(), plain.detach(), rtol=1e-6, atol=1e-7)
        assert not torch.equal(local.full_tensor(), w)  # the steps moved the sharded weights
    finally:
        dist.destroy_process_group()
