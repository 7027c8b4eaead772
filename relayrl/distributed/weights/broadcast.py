"""The broadcast transport (base.py): a process group of its own from the policy to separate engine actors.

    connect_engines(policy, engines, launcher, n, timeout_s, tp)   the controller: check layouts, form the
                                                        group (every rank joins at once), send version 0
    sync_weights(policy, engines, version)              the controller: policy.sync (its rank 0 sends) and the
                                                        engines' receive_weights, both sides of one collective
    BroadcastSender().join(channel); .send(model)       the policy's rank 0: every parameter, in order
    ModuleReceiver(engine, model, engine_rank)          an engine actor holding its own module: receives
                                                        straight into its parameters while its rounds are
                                                        paused, then load_weights(None, version)
    endpoint = free_endpoint()                          on the sender (the policy's rank 0): (address, port)
    group = WeightGroup(*endpoint, rank=r, world=1 + N, backend="nccl" | "gloo", timeout_s=600)
    group.broadcast(tensor)                             rank 0 sends, ranks 1..N receive into `tensor`
    for name, t in receive_named(group, layout, device): ...   a receiver without the sender's module: every
                                                        tensor of the sender's `layout`, in order (vLLM workers)

The policy's ranks already form one torch.distributed group (FSDP), and each engine role forms another; a
process can hold only one default group, so this one is built directly from a TCP store
(`ProcessGroupNCCL` / `ProcessGroupGloo`), outside `torch.distributed`'s global state: it never clashes with
the role groups and every rank joins it by calling the constructor at the same time (the store is the
rendezvous; `timeout_s` bounds the wait and every broadcast). NCCL on GPUs (device-to-device, NVLink where
there is one), gloo on CPUs (the CPU tests).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from relayrl.distributed.launch.base import Launcher, RoleHandle
from relayrl.distributed.weights.base import Channel, Layout, module_layout
from relayrl.rollout.base import RolloutEngine, paused


def weight_ranks(num_engines: int, tp: int) -> int:
    """Ranks of the weight group: the policy's rank 0 + every engine's tp receiving processes."""
    return 1 + num_engines * tp


def free_endpoint() -> tuple[str, int]:
    """(this host's address, a free TCP port): where the sender's store listens."""
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    try:
        import ray

        address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except ImportError:
        address = "127.0.0.1"
    return address, port


class WeightGroup:
    """Rank 0 (the sender) and the engines (1..world-1); see the module doc."""

    def __init__(
        self, address: str, port: int, *, rank: int, world: int, backend: str, timeout_s: float
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world, self.backend = rank, world, backend
        # torch's stubs lag its runtime here: TCPStore is public, ProcessGroupNCCL's options default, and
        # both process groups have broadcast
        self.store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)  # pyright: ignore[reportPrivateImportUsage]
        self.pg: Any
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world)  # pyright: ignore[reportCallIssue]
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        else:
            raise ValueError(f"WeightGroup backend must be nccl or gloo, got {backend!r}")

    @classmethod
    def on(cls, channel: Channel, rank: int) -> WeightGroup:
        """Join `channel`'s group as `rank` (0: the sender; 1..world-1: the receiving processes)."""
        return cls(
            channel.address,
            channel.port,
            rank=rank,
            world=channel.world,
            backend=channel.backend,
            timeout_s=channel.timeout_s,
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every other rank's `tensor` (same shape and dtype everywhere), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()


def receive_named(
    group: WeightGroup, layout: Layout, device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor on `device`) for every entry of `layout`, each received from rank 0 as it is asked for (a
    lazy iterator: a consumer loading the tensors in chunks never holds them all). gloo receives into host
    memory and copies to `device`; NCCL receives on `device` directly."""
    recv_device = torch.device(device) if group.backend == "nccl" else torch.device("cpu")
    for name, shape, dtype in layout:
        buf = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")), device=recv_device)
        group.broadcast(buf)
        yield name, buf.to(device, non_blocking=False)


class BroadcastSender:
    """The policy's rank 0 end of the group (a `WeightSender`, base.py)."""

    def __init__(self) -> None:
        self.group: WeightGroup | None = None

    def join(self, channel: Channel) -> None:
        self.group = WeightGroup.on(channel, 0)

    @torch.no_grad()
    def send(self, model: torch.nn.Module) -> None:
        if self.group is None:
            raise RuntimeError("BroadcastSender.send before join")
        for p in model.parameters():
            self.group.broadcast(p.data)


class ModuleReceiver:
    """A separate engine actor holding its own module (native / hf; a `WeightReceiver`, base.py): rank
    1 + engine_rank of the group, receiving every parameter in place while the engine's rounds are paused."""

    def __init__(self, engine: RolloutEngine, model: torch.nn.Module, engine_rank: int) -> None:
        self.engine, self.model, self.rank = engine, model, 1 + engine_rank
        self.group: WeightGroup | None = None

    def layout(self) -> Layout:
        return module_layout(self.model)

    def join(self, channel: Channel, layout: Layout) -> None:
        """`layout` equals this receiver's own (connect_engines checked it before anyone joined)."""
        self.group = WeightGroup.on(channel, self.rank)

    @torch.no_grad()
    def receive(self, version: int) -> None:
        if self.group is None:
            raise RuntimeError("ModuleReceiver.receive before join")
        with paused(self.engine):
            for p in self.model.parameters():
                self.group.broadcast(p.data)
            self.engine.load_weights(None, version=version)


class SendsWeights(Protocol):
    """The sending role's side (the policy, relayrl.workers.policy.PolicyWorker), as the controller calls it."""

    def weight_layout(self) -> Layout: ...

    def weight_endpoint(self) -> tuple[str, int]: ...

    def join_weights(self, channel: Channel) -> None: ...

    def sync(self, version: int | None = None) -> dict[str, float]: ...


class ReceivesWeights(Protocol):
    """The receiving role's side (separate engines, relayrl.workers.engine.EngineWorker)."""

    def weight_layout(self) -> Layout | None: ...

    def join_weights(self, channel: Channel, layout: Layout) -> None: ...

    def receive_weights(self, version: int) -> None: ...


def connect_engines(
    policy: RoleHandle[SendsWeights],
    engines: RoleHandle[ReceivesWeights],
    launcher: Launcher,
    n: int,
    timeout_s: float,
    tp: int = 1,
) -> None:
    """Form the weight group (the policy's rank 0 + the n engines' tp receiving processes each) and send the
    engines the policy's weights as version 0 (so they start from exactly the trainer's weights, cast to the
    engine dtype). Engines whose receivers take the sender's layout as it comes (vllm: its own parameter names
    differ, packed q/k/v) report None for theirs; the others must match it exactly."""
    sent, received = policy.call(SendsWeights.weight_layout), engines.call(ReceivesWeights.weight_layout)
    if received is not None and sent != received:  # mismatched tensors would hang or corrupt: refuse before
        diff = next((a, b) for a, b in zip([*sent, None], [*received, None], strict=False) if a != b)
        raise RuntimeError(
            f"dist.num_engines: the engines' weights differ from the policy's replica ({len(sent)} vs "
            f"{len(received)} tensors; first difference: policy {diff[0]} vs engine {diff[1]})"
        )
    address, port = policy.call(SendsWeights.weight_endpoint)
    backend = "nccl" if launcher.use_gpus else "gloo"
    channel = Channel(
        address=address, port=port, world=weight_ranks(n, tp), backend=backend, timeout_s=timeout_s
    )
    joins = (
        policy.submit(SendsWeights.join_weights, channel),
        engines.submit(ReceivesWeights.join_weights, channel, sent),
    )
    for job in joins:
        job.result()
    sync_weights(policy, engines, 0)


def sync_weights(
    policy: RoleHandle[SendsWeights], engines: RoleHandle[ReceivesWeights] | None, version: int
) -> dict[str, float]:
    """policy.sync(version); with separate engines their receive_weights at the same time (the policy's rank 0
    broadcasts, they receive: both sides of one collective). Returns the policy's sync metrics."""
    if engines is None:
        return policy.call(SendsWeights.sync, version)
    out = policy.submit(SendsWeights.sync, version)
    received = engines.submit(ReceivesWeights.receive_weights, version)
    metrics = out.result()
    received.result()
    return metrics
