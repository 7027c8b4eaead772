"""The ranks of tests/workers/test_ema_sharded.py (a module of its own: torch.multiprocessing's spawn imports
the rank function by name in each child)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.agents.base import Trajectory
from relayrl.config.presets import tiny_cpu_config
from relayrl.data.records import PromptSample
from relayrl.distributed.checkpoint import load_model_and_optim, save_sharded
from relayrl.distributed.fsdp import ShardSpec, shard_model
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.trainers.rl.validate import validate_rl
from relayrl.workers.base import Experience, collate
from relayrl.workers.ema import PolicyEma
from relayrl.workers.policy import PolicySpec, PolicyWorker

DECAY = 0.8
STEPS = 4


def build(sharded: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, PolicyEma]:
    """The same tiny model on every rank (fixed seed), sharded or not, its optimizer and its EMA. SGD with
    momentum (state to checkpoint, and linear in the gradient): Adam would scale the fp32 rounding noise of
    near-zero gradient entries to lr-sized steps, so a 2-rank and a 1-rank run could not be compared tightly."""
    model = build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(hidden=32, layers=2, seed=0))
    if sharded:
        shard_model(model, ShardSpec(device=torch.device("cpu")))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
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
        load_model_and_optim(
            ckpt, model, opt, names, full_weights=lambda p: {}, full_optim_state=lambda p: {}
        )
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


def policy_spec(model_path: str, out: str, ema: float):
    """A PolicyWorker spec on the tiny model (CPU, GRPO defaults) with the EMA on."""
    cfg = validate_rl(tiny_cpu_config(model_path, out))
    return PolicySpec(
        model=cfg.model, optim=cfg.optim, algo=cfg.algo, rollout=cfg.rollout, eval=cfg.eval, device="cpu",
        ema=ema, total_steps=4,
    )  # fmt: skip


def experience(seed: int):
    """Four rows of different lengths with random advantages (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i, n in enumerate((9, 12, 6, 10)):
        ids = torch.randint(4, 60, (n,), generator=g).tolist()
        sample = PromptSample(index=i, prompt="", prompt_ids=ids[:3])
        act = [False] * 3 + [True] * (n - 3)
        trajs.append(Trajectory(sample=sample, token_ids=ids, action_mask=act, rollout_logprobs=[0.0] * n))
    batch = collate(trajs, pad_id=0)
    adv = torch.randn(batch.input_ids.shape, generator=g) * batch.action_mask
    return Experience(tokens=batch, advantages=adv, rewards=torch.randn(4, generator=g))


def policy_run(model_path: str, out: Path, ema: float) -> None:
    """update, checkpoint, update, export to out/a; a fresh worker resumed from the checkpoint: update, export
    to out/b (on every rank of the group, or on one process)."""
    w = PolicyWorker(policy_spec(model_path, str(out), ema))
    w.update(experience(1), kl_coef=0.0)
    w.save(str(out / "ckpt"))
    w.update(experience(2), kl_coef=0.0)
    w.export(str(out / "a"))
    w.close()
    w = PolicyWorker(policy_spec(model_path, str(out), ema))
    w.load(str(out / "ckpt"))
    w.update(experience(2), kl_coef=0.0)
    w.export(str(out / "b"))
    w.close()


def policy_rank_main(rank: int, world: int, store: str, model_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.manual_seed(0)
    try:
        policy_run(model_path, Path(out), DECAY)
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    finally:
        dist.destroy_process_group()
