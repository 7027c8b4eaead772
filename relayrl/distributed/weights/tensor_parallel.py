"""The tensor-parallel transport (base.py): each rank's engine holds 1/TP of the weights (a TP shard,
rollout/native_tp.py), refreshed from the trainer's (FSDP2-sharded or plain) parameters.

    tw = TensorParallelWeights(policy, dtype=torch.bfloat16, group=tp_group, device=dev)   BEFORE FSDP shards
    ...optimizer step on the (sharded) policy...                                             the policy
    seconds = tw.refresh()      every rank of the trainer's group at once (a collective per parameter)
    engine.load_weights(None, version=step)                 (tw.load_into(engine, step) does both, paused)
    tw.max_abs_diff()           the weight canary over this rank's slices (0: engine == trainer)

Construction copies only this rank's slice of each parameter (`native_tp.shard_model`, from the module as
loaded, before it is sharded), straight into `dtype` on `device`. `refresh` walks the trained parameters in
order and all-gathers them over the trainer's FSDP group in buckets (`fsdp.full_tensors`: one collective per
`fsdp.BUCKET_BYTES`, cast to `dtype` before the gather), copies this rank's `tp_slice` of each into the shard's
parameter and drops the rest: at no time does any rank hold more than about two buckets (or the largest single
parameter, at 7B the embedding, 1.1 GB bf16) beyond its shard, never a full unsharded model. The shard's q/k/v and gate/up parameters are views of its fused
buffers (rollout/native_fused.py), so the copy refreshes the fused GEMMs too and the canary covers them.

Every rank of the trainer's group calls `refresh` and `max_abs_diff` (collectives), whatever its TP group.
The TP group (`group`) is this rank's engine group: consecutive ranks of the trainer's group (`tp_groups`).

Separate TP engines (`TensorParallelReceiver`): each engine actor is one shard (the engine role has
num_engines x tp ranks, blocks of tp consecutive ranks forming an engine); each joins the broadcast group of
broadcast.py as one receiver, takes every full tensor the policy's rank 0 sends, one at a time, and keeps
its slice. The sender does not change.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from relayrl.distributed.fsdp import full_tensors
from relayrl.distributed.weights.base import Channel, Layout
from relayrl.distributed.weights.broadcast import WeightGroup, receive_named
from relayrl.models.forward import hf_model
from relayrl.rollout.base import RolloutEngine, paused
from relayrl.rollout.native_tp import shard_model, tp_slice


def tp_groups(tp: int, backend: str | None = None) -> Any:
    """This rank's TP group: the default group's ranks in consecutive blocks of `tp` (every rank creates
    every block's group, in order, as torch.distributed requires)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp < 1 or world % tp:
        raise ValueError(f"dist.engine_tp={tp} must divide the policy's {world} ranks")
    mine = None
    for start in range(0, world, tp):
        group = dist.new_group(list(range(start, start + tp)), backend=backend)
        if start <= rank < start + tp:
            mine = group
    return mine


class TensorParallelWeights:
    """A TP shard of a trained module's weights for this rank's engine (a `WeightSource`, base.py)."""

    def __init__(
        self, source: torch.nn.Module, *, dtype: torch.dtype, group: Any, device: torch.device | None = None
    ) -> None:
        if hf_model(source) is not source:
            raise ValueError(
                "dist.engine_tp > 1 with a LoRA policy (model.lora.rank > 0) is not supported: the TP shard "
                "holds plain weights; merge the adapters or use dist.engine_tp 1"
            )
        self.source = source
        self.dtype = dtype
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.trained = {n for n, p in source.named_parameters() if p.requires_grad}
        self.model = shard_model(
            source, rank=self.rank, size=self.size, group=group, dtype=dtype, device=device
        )
        """The shard the engine runs on (rollout/native_tp.TPNativeEngine)."""
        self.stream = False

    @property
    def kind(self) -> str:
        """Always "tensor-parallel": this rank's slices, written in place."""
        return "tensor-parallel"

    def _slices(self, names: set[str] | None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(this rank's slice of the trainer's tensor in `dtype`, the shard's parameter), gathered in buckets
        (a collective over the trainer's group per bucket)."""
        targets = {n: p.data for n, p in self.model.named_parameters()}
        for name, full in full_tensors(self.source, self.dtype, names):
            yield tp_slice(name, full, self.rank, self.size), targets[name]

    @torch.no_grad()
    def refresh(self) -> float:
        """Copy this rank's slice of every trained parameter into the shard; the seconds it took."""
        t0 = time.perf_counter()
        target = None
        for part, target in self._slices(self.trained):
            target.copy_(part)
        if target is not None and target.is_cuda:
            torch.cuda.synchronize(target.device)
        return time.perf_counter() - t0

    def engine_tensors(self) -> None:
        """None: the shard was updated in place."""
        return None

    def load_into(
        self, engine: RolloutEngine, version: int | None, before_load: Callable[[], None] | None = None
    ) -> float:
        """`refresh` with the engine's rounds paused, then `before_load`, then load_weights(None, version)."""
        with paused(engine):
            seconds = self.refresh()
            if before_load is not None:
                before_load()
            engine.load_weights(None, version=version)
        return seconds

    @torch.no_grad()
    def max_abs_diff(self) -> float:
        """max |shard slice - trainer's slice cast to the engine dtype| over every parameter of this rank."""
        diffs = (float((d - s).abs().max()) if d.numel() else 0.0 for s, d in self._slices(None))
        return max(diffs, default=0.0)


class TensorParallelReceiver:
    """A separate TP native engine's shard process in the broadcast group (a `WeightReceiver`, base.py): rank
    1 + its engine-role rank (= 1 + engine x tp + shard, as `weight_ranks` counts), receiving each tensor of
    the sender's layout in full, one at a time, and keeping its `tp_slice`, while the engine's rounds are
    paused (every shard of the engine pauses between the same two rounds: rounds run in lock step)."""

    def __init__(self, engine: RolloutEngine, shard: torch.nn.Module, engine_rank: int, group: Any) -> None:
        self.engine, self.shard, self.rank = engine, shard, 1 + engine_rank
        self.tp_rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        self.group: WeightGroup | None = None
        self.sent: Layout = []

    def layout(self) -> None:
        """None: the sender's full-tensor layout is taken as it is (the shard holds slices of it)."""
        return None

    def join(self, channel: Channel, layout: Layout) -> None:
        targets = dict(self.shard.named_parameters())
        missing = [name for name, _, _ in layout if name not in targets]
        if missing:
            raise RuntimeError(
                f"tensor-parallel engine: the sender's tensors {missing[:3]} have no shard here"
            )
        self.sent = layout
        self.group = WeightGroup.on(channel, self.rank)

    @torch.no_grad()
    def receive(self, version: int) -> None:
        if self.group is None:
            raise RuntimeError("TensorParallelReceiver.receive before join")
        targets = {n: p.data for n, p in self.shard.named_parameters()}
        device = next(iter(targets.values())).device
        with paused(self.engine):
            for name, full in receive_named(self.group, self.sent, device):
                targets[name].copy_(tp_slice(name, full, self.tp_rank, self.tp_size))
            self.engine.load_weights(None, version=version)
