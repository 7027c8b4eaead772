"""Train steps over FSDP2 units (relayrl.training.sharded), shared by tests/training/test_sharded.py's one-rank
tests and its ranks spawned over a real gloo group (a module of its own so torch.multiprocessing's children can
import it by name)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from relayrl.config.components import OptimConfig
from relayrl.data.batches import sft_batch
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.models.forward import choose_layout, prepare_model
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.trainers.sft import next_token_loss
from relayrl.training.setup import build_train_step
from relayrl.training.step import TrainStep

CPU = torch.device("cpu")
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, scheduler="constant", max_grad_norm=0.5)
"""lr large enough that two steps move every weight; clipping at 0.5 so the clip scales the gradients."""


class Sample:
    def __init__(self, ids: list[int], mask: list[bool]) -> None:
        self.input_ids, self.loss_mask = ids, mask


def micro_batches(seed: int, n: int = 3, per: int = 2) -> list[Any]:
    """`n` micro-batches of `per` random samples (lengths 5-13, loss on the second half)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        samples = []
        for _ in range(per):
            length = int(torch.randint(5, 14, (1,), generator=g))
            ids = torch.randint(4, 100, (length,), generator=g).tolist()
            samples.append(Sample(ids, [i >= length // 2 for i in range(length)]))
        out.append(sft_batch(samples, "padded"))
    return out


def model() -> torch.nn.Module:
    """Tied embeddings, 101-row vocab and 50-row MLP: uneven shards over 2 ranks."""
    m = build_tiny_model(
        build_tiny_tokenizer(), TinyModelSpec(hidden=36, layers=2, heads=2, kv_heads=1, intermediate=50)
    )
    prepare_model(m, choose_layout(m, CPU))
    return m


def sharded_step(keep_gathered: bool) -> TrainStep:
    """The tiny model sharded over the default group, its train step (gradients reduced once per step)."""
    m = shard_model(model(), ShardSpec(device=CPU))
    return build_train_step(
        m,
        OPTIM,
        100,
        next_token_loss,
        device=CPU,
        sharded=True,
        defer_grad_sync=True,
        keep_gathered=keep_gathered,
    )


def layers(step: TrainStep) -> list[torch.nn.Module]:
    return list(step.model.model.layers)  # pyright: ignore[reportAttributeAccessIssue]


def gathered(module: torch.nn.Module) -> bool:
    """Whether an FSDP2 unit holds its gathered weights (plain tensors) rather than its shards (DTensors)."""
    return not any(isinstance(p, DTensor) for p in module.parameters())


class GatherCounter:
    """The all-gathers FSDP2 issues (its collective is all_gather_single in newer torch, all_gather_into_tensor
    before), counted while inside the block."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self) -> None:
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> GatherCounter:
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def counted(*a: Any, _fn: Any = fn, **kw: Any) -> Any:
                self.calls += 1
                return _fn(*a, **kw)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def dtensor_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The norm as torch.nn.utils computes it over DTensor gradients (the path before local shards)."""
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def replicated_steps(rank: int, mbs: list[list[Any]]) -> dict[str, Any]:
    """The same two steps with the whole model on every rank (dist.replicate): rank 1 starts from perturbed
    weights, so only the broadcast makes the replicas equal; then whether a replica that drifted is caught."""
    from relayrl.training.replicate import broadcast_params, check_replicas

    m = model()
    if rank == 1:
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.5)
    broadcast_params(m)
    step = build_train_step(m, OPTIM, 100, next_token_loss, device=CPU, replicate_grads=True)
    outs = [step.step(batch) for batch in mbs]
    check_replicas(step.optimizer_params(), "the test's replicas")  # equal: must not raise
    weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        if rank == 1:
            next(iter(m.parameters())).view(-1)[0] += 1e-3
    try:
        check_replicas(step.optimizer_params(), "the test's replicas")
        caught = ""
    except RuntimeError as e:
        caught = str(e)
    return {"outs": [(o.loss, o.count, o.grad_norm) for o in outs], "weights": weights, "caught": caught}


def rank_main(rank: int, world: int, store_path: str, out: str) -> None:
    """Two steps of 3 micro-batches (each rank its own data) with keep_gathered off, then on, from the same
    weights; the all-gathers of each step; the weights after; and the local-shard norm against DTensor's on
    the gradients of one more backward (rank{r}.pt)."""
    from relayrl.training import sharded

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {}
        mbs = [micro_batches(seed=10 * s + rank) for s in range(2)]
        for keep in (False, True):
            step = sharded_step(keep)
            outs, gathers = [], []
            for batch in mbs:
                with GatherCounter() as c:
                    outs.append(step.step(batch))
                gathers.append(c.calls)
            result[keep] = {
                "outs": [(o.loss, o.count, o.grad_norm) for o in outs],
                "gathers": gathers,
                "weights": {n: t.clone() for n, t in full_tensors(step.model)},
                "sharded_after": all(isinstance(p, DTensor) for p in step.model.parameters()),
            }
        result["replicated"] = replicated_steps(rank, mbs)
        step = sharded_step(False)
        for mb in micro_batches(seed=99 + rank):
            next_token_loss(step.model, mb).loss_sum.backward()
        grads = [p.grad for p in step.model.parameters() if p.grad is not None]
        ref = dtensor_norm(grads)
        new = sharded.total_norm(grads)
        want = [g.to_local().clone() * torch.clamp(0.5 / (ref + 1e-6), max=1.0) for g in grads]
        sharded.clip_(grads, 0.5, new)
        result["norm"] = (float(ref), float(new))
        result["clipped_equal"] = all(torch.equal(g.to_local(), w) for g, w in zip(grads, want, strict=True))
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
