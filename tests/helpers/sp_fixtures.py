"""What the sequence-parallel tests run, in each spawned gloo rank and in the one-process reference (imported
by name: tests/helpers is on pytest's pythonpath, and spawned ranks inherit sys.path).

    out = sp_run(rank, world, sp, store)   one SGD step of the SFT loss on MICRO_BATCHES (each rank its
                                           data-parallel share) + policy log-probs / entropy and critic
                                           values of LOGPROB_SEQS, before the step; the full updated weights
    spawn_sp(world, sp, tmp_path)          sp_run on `world` spawned ranks -> rank 0's result
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rank_spawn import spawn_ranks

from relayrl.data.batches import SFTBatch
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.distributed.group import my_data_share
from relayrl.distributed.sequence_parallel import setup_sequence_parallel
from relayrl.models import sequence_parallel
from relayrl.models.forward import choose_layout, prepare_model, token_logprobs, token_values
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.trainers.sft import next_token_loss
from relayrl.training.step import TrainStep

SPEC = TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=1, seed=3)
"""4 query heads, ONE KV head: under SP=2 the KV head is repeated (models.sequence_parallel.expand_kv)."""

LR = 0.5


def _seqs(lengths: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 90, (n,), generator=g) for n in lengths]


def _batch(lengths: list[int], seed: int) -> SFTBatch:
    ids = _seqs(lengths, seed)
    g = torch.Generator().manual_seed(seed + 1)
    targets = [torch.rand(n, generator=g) < 0.7 for n in lengths]
    return SFTBatch(input_ids=ids, targets=targets, layout="varlen", num_tokens=sum(lengths))


# odd totals (23, 17, 30, 9 tokens): the packed row is padded to a multiple of the SP size
MICRO_BATCHES = [([7, 12, 4], 1), ([17], 2), ([5, 9, 11, 5], 3), ([9], 4)]
LOGPROB_SEQS = [13, 6, 21]


def _model() -> Any:
    model = build_tiny_model(build_tiny_tokenizer(), SPEC)
    # a value head on the same trunk (critic values through the same SP path)
    torch.manual_seed(7)
    model.score = torch.nn.Linear(SPEC.hidden, 1)  # pyright: ignore[reportAttributeAccessIssue]
    return model


def sp_run(rank: int, world: int, sp: int, store: str | None) -> dict[str, Any]:
    """See the module doc. world 1 without a store: the plain one-process path (padded layout)."""
    if store is not None:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = _model()
        if store is not None:
            setup_sequence_parallel(sp, model, "model")
        layout = choose_layout(model, "cpu")
        prepare_model(model, layout)
        seqs = _seqs(LOGPROB_SEQS, 9)
        with torch.no_grad():
            lp, ent = token_logprobs(model, seqs, layout, temperature=0.7, entropy=True)
            values = token_values(model, seqs, layout)
        if store is not None:
            shard_model(model, ShardSpec(device=torch.device("cpu")))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        step = TrainStep(model=model, optimizer=opt, grad_clip=0.0, precision="fp32", device="cpu")
        batches = [_batch(n, s) for n, s in MICRO_BATCHES]
        for b in batches:
            b.layout = layout
        mine = [batches[i] for i in my_data_share([b.num_tokens for b in batches])]
        out = step.step(mine, next_token_loss)
        weights = {k: v.detach().clone() for k, v in full_tensors(model)}
        if store is not None:
            dist.barrier()  # no rank tears gloo down while a peer is still in a collective
        return {
            "layout": layout,
            "loss": out.loss,
            "count": out.count,
            "grad_norm": out.grad_norm,
            "logprobs": lp,
            "entropy": ent,
            "values": values,
            "weights": weights,
        }
    finally:
        sequence_parallel.set_group(None)
        if store is not None:
            dist.destroy_process_group()


def _entry(rank: int, world: int, sp: int, folder: str) -> None:
    torch.save(sp_run(rank, world, sp, str(Path(folder) / "store")), Path(folder) / f"rank{rank}.pt")


def spawn_sp(world: int, sp: int, folder: Path) -> list[Any]:
    """sp_run on `world` spawned gloo ranks; every rank's result."""
    spawn_ranks(_entry, (world, sp, str(folder)), nprocs=world)
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world)]
