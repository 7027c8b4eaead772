"""The ranks of tests/workers/test_ema_sharded.py (a module of its own: torch.multiprocessing's spawn imports
the rank function by name in each child)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.distributed.checkpoint import load_model_and_optim, save_sharded
from relayrl.distributed.fsdp import ShardSpec, shard_model
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.workers.ema import PolicyEma

DECAY = 0.8
STEPS = 4


def build(sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, PolicyEma]:
    """The same tiny model on every rank (fixed seed), sharded or not, its AdamW and its EMA."""
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(hidden=32, layers=2, seed=0))
    if sharded:
        shard_model(model, ShardSpec(device=torch.device("cpu")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, PolicyEma(model, DECAY)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, ema: PolicyEma, steps: range, ref=None) -> None:
    """Optimizer steps on a batch fixed by the step number (the same on every rank), the EMA after each;
    `ref`: a plain dict EMA of the gathered full weights, kept beside it (the one-rank formula)."""
    for step in steps:
        ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(step))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
        if ref is not None:
            for k, v in model.state_dict().items():
                full = v.full_tensor() if hasattr(v, "full_tensor") else v
                ref[k].mul_(DECAY).add_(full.detach(), alpha=1 - DECAY)


def rank_main(rank: int, world: int, store: str, out: str) -> None:
    """Run A: STEPS steps uninterrupted (with the gathered-weights reference EMA). Run B: half the steps,
    a checkpoint (model + optimizer + EMA), fresh objects loaded from it, the other half."""
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    try:
        model, opt, ema = build(sharded=True)
        ref = ema.full()
        train(model, opt, ema, range(STEPS), ref)
        a = ema.full()

        model, opt, ema = build(sharded=True)
        train(model, opt, ema, range(STEPS // 2))
        ckpt = Path(out) / "ckpt"
        save_sharded(ckpt, model, opt, {})
        ema.save(ckpt)
        half = ema.full()
        model, opt, ema = build(sharded=True)
        names = [n for n, _ in model.named_parameters()]
        load_model_and_optim(ckpt, model, opt, names, full_weights=lambda p: {}, full_optim_state=lambda p: {})
        assert ema.load(ckpt, None)
        train(model, opt, ema, range(STEPS // 2, STEPS))
        b = ema.full()
        local = {k: tuple(v.to_local().shape) for k, v in ema.state.items()}
        spread = build(sharded=True)[2]  # a full (one-rank) EMA spread onto the shards
        assert spread.load(Path(out) / "no_ema_dir", a)
        spread_full = spread.full()
        if rank == 0:
            torch.save(
                {"a": a, "ref": ref, "b": b, "half": half, "local": local, "spread": spread_full},
                Path(out) / "result.pt",
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()
