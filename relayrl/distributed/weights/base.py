"""The weight-transport seam: how the rollout engine comes to generate from the trainer's new weights.

    trainer side   WeightSource      refresh() -> seconds       the engine-side copy made current (cast-copy,
                                                                FSDP gather; nothing when shared or streamed)
                                     engine_tensors()           None: the engine's module changed in place;
                                                                else (HF name, tensor) pairs, lazily, once
                                     max_abs_diff()             the weight canary (0: engine == trainer)
    engine side    RolloutEngine     load_weights(named | None, version=v), between two rounds; requests in
                                     flight go on under the new weights (partial rollout)
                   Pausable          paused(): no round runs while weights change in place (rollout/base.py)
                   WorkerLoading     load_in_workers(fn, version=v): the model lives in worker processes (vllm)
    across processes (a group of its own, `Channel`: the sender's rank 0 + every receiving process)
                   WeightSender      join(channel); send(model): every parameter, in `module_layout` order
                   WeightReceiver    layout() (checked against the sender's before joining); join(channel,
                                     sender's layout); receive(version): its side of the same collective

Versions: every load names the weight version (the RL step); the engine stamps it on every token it samples
afterwards (Completion.versions), so a sample that ran across a load carries both.

One file per transport:
    local.py      LocalWeights, same process: shared (the engine runs on the trained module), copy (on-device
                  cast-copy into the engine's buffers), gather (FSDP all-gather into every rank's full replica),
                  stream (named tensors for an engine holding its own copy: vllm colocated); `load_into`
    broadcast.py  a NCCL / gloo group of its own: BroadcastSender (the policy's rank 0) -> ModuleReceiver (a
                  separate engine actor's module, under pause); connect_engines / sync_weights (the
                  controller's side of it) and weight_ranks
    vllm.py       VLLMReceiver: each vLLM worker process of a separate engine enters the group itself and
                  loads the broadcast through vLLM's loader (the functions run inside the workers)
    tensor_parallel.py  TensorParallelWeights, same process: each rank's engine holds a TP shard
                  (rollout/native_tp.py); `refresh` all-gathers the FSDP shards (fsdp.full_tensors: in buckets on GPUs)
                  and keeps this rank's slice (`tp_slice`: column-parallel weights split their rows,
                  row-parallel ones their columns). TensorParallelReceiver: a separate TP native engine's
                  shard actor in broadcast.py's group (rank 1 + engine x tp + shard, as `weight_ranks`
                  counts), keeping its slice of each broadcast tensor; the sender does not change.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

Layout = list[tuple[str, tuple[int, ...], str]]
"""(name, shape, dtype as str(torch.dtype)) of every tensor a sender broadcasts, in order."""

NamedTensors = Iterator[tuple[str, torch.Tensor]]
"""(HF parameter name, tensor) pairs, produced lazily (a consumer loading them in chunks never holds all)."""


def module_layout(model: torch.nn.Module) -> Layout:
    """The layout of `model`'s parameters in `named_parameters()` order (what a sender broadcasts)."""
    return [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]


@dataclass(frozen=True, kw_only=True, slots=True)
class Channel:
    """Where a cross-process transport meets (picklable: it travels to every rank)."""

    address: str
    """Host of the sender's TCP store (the policy's rank 0)."""
    port: int
    """Its free port."""
    world: int
    """Ranks of the group: the sender + every receiving process (`weight_ranks`)."""
    backend: str
    """nccl (GPUs) or gloo (CPUs)."""
    timeout_s: float
    """Bound on the rendezvous and on every broadcast."""


class WeightSource(Protocol):
    """The trainer side: its current weights, made ready for an engine."""

    model: torch.nn.Module
    """What a same-process engine runs on (the trained module itself, or the engine's own copy)."""

    @property
    def kind(self) -> str:
        """How the engine gets the weights (shared, copy, gathered, streamed)."""
        ...

    def refresh(self) -> float:
        """Make the engine-side copy current; the seconds it took."""
        ...

    def engine_tensors(self) -> NamedTensors | None:
        """What `engine.load_weights` gets after `refresh` (None: the engine's module changed in place)."""
        ...

    def max_abs_diff(self) -> float:
        """max |engine weight - trainer weight cast to the engine dtype| (0 = in sync)."""
        ...


class WeightSender(Protocol):
    """The sending end of a cross-process transport (the policy's rank 0)."""

    def join(self, channel: Channel) -> None:
        """Enter the group as its rank 0 (every rank of the group joins at the same time)."""
        ...

    def send(self, model: torch.nn.Module) -> None:
        """Every parameter of `model`, in `module_layout` order, to every receiver."""
        ...


class WeightReceiver(Protocol):
    """The receiving end of a cross-process transport: a separate engine's side of the group."""

    def layout(self) -> Layout | None:
        """The layout it receives into, checked against the sender's before joining; None: it takes whatever
        the sender's layout lists (checked on the first receive)."""
        ...

    def join(self, channel: Channel, layout: Layout) -> None:
        """Enter the group (ranks after the sender's); `layout` is the sender's."""
        ...

    def receive(self, version: int) -> None:
        """Take one broadcast of the sender's weights into the engine, as weight version `version` (between
        two rounds; requests in flight go on under the new weights)."""
        ...
