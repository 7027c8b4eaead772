"""Optimizer states parked in host memory while generation uses the GPU (dist.offload_optimizer_in_rollout).

    parking = HostStates()
    parking.park(optimizer)      after the update, before the engine wakes: every state tensor on a GPU is
                                 copied into this object's host buffers and the device copies are released
    parking.unpark(optimizer)    before the next update: the states it parked go back to their devices

Design:
- One flat host buffer per dtype, sized to the exact sum of the parked states' elements, each state a view
  of it at a fixed offset; allocated at the first park and reused by every later one while the states'
  layout (which tensors, their shapes and dtypes) is the same, rebuilt when it changes (a new optimizer,
  another model). Host memory = the states' bytes (52 GB of AdamW moments at the 7B shape), once for the run.
- With CUDA, each buffer is page-locked in place (cudaHostRegister, as torch's own checkpoint stager does),
  so the copies run at the link's speed. Not torch's pinned allocator: its caching host allocator rounds
  every block up to a power of two (relayrl/distributed/dcp_writer.py), ~1.8x the states' bytes at the 7B
  shape with one block per state. If registering fails the buffer stays pageable (slower copies, a warning).
- `unpark` moves back only what `park` moved, to the device each came from: states that live in host memory
  by design (dist.offload's CPU shards) stay there.
- Sharded states (DTensor) are parked with `.to("cpu", non_blocking=True)` (torch's pinned, cached blocks)
  rather than in the flat buffers.
- Copies are asynchronous; each park / unpark waits for the devices it copied from / to before returning.

Why (measured on one H200, 7B shape, 2026-11-28, before this module): the states went to host memory with a
plain `.to("cpu")` at the start of each rollout, i.e. after the engine had woken with them still on the GPU;
from the second step on, the rollout took 39-42 s against 2.3 s for the first (no states yet) and the sync
10-13 s against 0.7 s. Which part of that the copies and which the wake under memory pressure was is not
isolated: `PolicyWorker._wake` now parks before the engine wakes, and this module bounds the copies' cost.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

# (id of the parameter, state name): the optimizer holds the parameter, so the ids are unique
Key = tuple[int, str]


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _register(buf: torch.Tensor) -> bool:
    """Page-lock `buf` in place; False (and a warning) when CUDA refuses."""
    cudart = torch.cuda.cudart()
    size = buf.numel() * buf.element_size()
    err = -1 if cudart is None else int(cudart.cudaHostRegister(buf.data_ptr(), size, 0))
    if err != 0:
        log.warning("parked optimizer states stay in pageable host memory (cudaHostRegister error %d)", err)
    return err == 0


def _sync(devices: set[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


class HostStates:
    """Host buffers for one optimizer's parked states (module doc). `parks(t)` says which state tensors to
    park (default: those not already in host memory; tests park CPU tensors through it)."""

    def __init__(self, parks: Callable[[torch.Tensor], bool] = _on_device) -> None:
        self.parks = parks
        self.flat: dict[torch.dtype, torch.Tensor] = {}
        self.registered: list[torch.Tensor] = []
        self.layout: list[tuple[Key, torch.Size, torch.dtype]] = []
        self.views: dict[Key, torch.Tensor] = {}
        self.parked: dict[Key, torch.device] = {}  # what the last park moved, and from where

    def park(self, optimizer: torch.optim.Optimizer) -> None:
        """Every state tensor `parks` selects -> host memory; its device copy is released."""
        plain: list[tuple[Key, dict, str, torch.Tensor]] = []
        devices: set[torch.device] = set()
        for param, state in optimizer.state.items():
            for k, v in state.items():
                if not isinstance(v, torch.Tensor) or k == "step" or not self.parks(v):
                    continue
                key = (id(param), k)
                self.parked[key] = v.device
                devices.add(v.device)
                if isinstance(v, DTensor):
                    state[k] = v.to("cpu", non_blocking=True)
                else:
                    plain.append((key, state, k, v))
        layout = [(key, v.shape, v.dtype) for key, _, _, v in plain]
        if plain and layout != self.layout:
            self._allocate(layout)
        for key, state, k, v in plain:
            view = self.views[key]
            view.copy_(v, non_blocking=True)
            state[k] = view
        _sync(devices)  # the host copies are complete before anything reads them

    def unpark(self, optimizer: torch.optim.Optimizer) -> None:
        """The states the last park moved -> back to the devices they came from (the buffers are kept)."""
        devices: set[torch.device] = set()
        for param, state in optimizer.state.items():
            for k, v in state.items():
                device = self.parked.get((id(param), k))
                if device is None or not isinstance(v, torch.Tensor):
                    continue
                state[k] = v.to(device, non_blocking=True, copy=True)
                devices.add(device)
        self.parked.clear()
        _sync(devices)

    def _allocate(self, layout: list[tuple[Key, torch.Size, torch.dtype]]) -> None:
        self.release()
        sizes: dict[torch.dtype, int] = {}
        for _, shape, dtype in layout:
            sizes[dtype] = sizes.get(dtype, 0) + shape.numel()
        self.flat = {dtype: torch.empty(n, dtype=dtype) for dtype, n in sizes.items()}
        if torch.cuda.is_available():
            self.registered = [buf for buf in self.flat.values() if buf.numel() and _register(buf)]
        offsets = dict.fromkeys(sizes, 0)
        for key, shape, dtype in layout:
            n = shape.numel()
            self.views[key] = self.flat[dtype][offsets[dtype] : offsets[dtype] + n].view(shape)
            offsets[dtype] += n
        self.layout = layout
        gib = sum(b.numel() * b.element_size() for b in self.flat.values()) / 2**30
        log.info("optimizer states parked in %.2f GiB of host memory (%s)", gib,
                 "page-locked" if self.registered else "pageable")  # fmt: skip

    def release(self) -> None:
        """Free the host buffers (un-registering them first)."""
        cudart = torch.cuda.cudart() if self.registered else None
        if cudart is not None:
            for buf in self.registered:
                cudart.cudaHostUnregister(buf.data_ptr())
        self.registered, self.flat, self.views, self.layout = [], {}, {}, []

    def __del__(self) -> None:
        # at interpreter shutdown CUDA may be gone; the process's memory goes anyway
        with contextlib.suppress(Exception):
            self.release()
