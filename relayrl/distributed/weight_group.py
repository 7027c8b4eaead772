"""A process group of its own for sending weights from the policy to separate engine actors.

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

import torch
import torch.distributed as dist

Layout = list[tuple[str, tuple[int, ...], str]]
"""(name, shape, dtype as str(torch.dtype)) of every tensor the sender broadcasts, in order."""


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
        self.store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timeout)
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world)
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        else:
            raise ValueError(f"WeightGroup backend must be nccl or gloo, got {backend!r}")

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
