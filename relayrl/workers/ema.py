"""The policy's exponential moving average (`ema`), on one rank or over the shards of an FSDP2 policy.

    ema = PolicyEma(model, decay)        fp32 copy of the model's state: full tensors on one rank; on N ranks
                                         DTensors laid out like the parameters (each rank holds its shard)
    ema.update(model)                    ema = decay * ema + (1 - decay) * weights, after every update
    ema.save(folder) / ema.load(folder)  with the role's checkpoint (see below)
    full = ema.full()                    the whole EMA state dict on every rank (gathered one tensor at a time)

Create, update and save it inside `TrainStep.full_precision()` on one rank (the module then holds the fp32
masters); a sharded module's parameters are the fp32 masters already (relayrl.distributed.fsdp).

Sharded: the update runs on each rank's local shard only (`DTensor.to_local()`, an in-place elementwise
update: no communication, the same arithmetic per element as on one rank, so the result is bitwise the one-rank
EMA of the same weights). Checkpoints: one rank stores the EMA in worker_state.pt (the role's `extra`, as
before); N ranks write it with torch.distributed.checkpoint into `<folder>/ema/` beside the policy's `dcp/`
(relayrl.distributed.checkpoint.save_tensors), so it reshards to any rank count on load. Every direction
loads: a full EMA onto the shards (each rank keeps its slice), a sharded EMA onto one rank (gathered).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relayrl.distributed.checkpoint import load_full_tensors, load_tensors, save_tensors, tensors_saved

EMA_DIR = "ema"


def _local(t: Any) -> Tensor:
    """The tensor this rank stores: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: Any) -> Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class PolicyEma:
    """An fp32 moving average of a (possibly FSDP2-sharded) model's floating-point state (see module doc)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema: decay {decay} must be in (0, 1)")
        self.decay = decay
        self.state: dict[str, Any] = {
            k: v.detach().clone().float() if v.is_floating_point() else v.detach().clone()
            for k, v in model.state_dict().items()
        }
        """name -> fp32 tensor (a DTensor with this rank's shard when the model is sharded)."""
        self.sharded = any(hasattr(v, "to_local") for v in self.state.values())

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """ema <- decay * ema + (1 - decay) * weights, shard by shard (no communication)."""
        d = self.decay
        for k, v in model.state_dict().items():
            if v.is_floating_point():
                _local(self.state[k]).mul_(d).add_(_local(v.detach()).float(), alpha=1 - d)

    def full(self, keep: bool = True) -> dict[str, Tensor]:
        """The full EMA state dict (CPU tensors), gathered one tensor at a time; a collective per sharded
        tensor, so every rank of the group calls it. `keep` False: gather, but return {} (ranks that only help
        rank 0 write the export hold nothing)."""
        out = {}
        for k, v in self.state.items():
            t = _full(v)
            if keep:
                out[k] = t.cpu()
        return out

    def extra(self) -> dict[str, Any]:
        """What goes into the role's worker_state.pt: the EMA itself on one rank, a marker on N (the shards
        are in <folder>/ema/, written by `save`)."""
        return {"ema": None if self.sharded else self.state}

    def save(self, folder: str | Path) -> None:
        """N ranks: every rank writes its shards to <folder>/ema/ (DCP). One rank: nothing (see `extra`)."""
        if self.sharded:
            save_tensors(Path(folder) / EMA_DIR, self.state)

    def load(self, folder: str | Path, saved: dict[str, Tensor] | None) -> bool:
        """Restore from a checkpoint folder: `saved` is worker_state.pt's "ema" (a full EMA written by one
        rank, or None). Returns False when the checkpoint holds no EMA (the EMA then stays as built)."""
        path = Path(folder) / EMA_DIR
        if tensors_saved(path):
            if self.sharded:
                load_tensors(path, self.state)  # resharded to this run's rank count
                return True
            saved = load_full_tensors(path)
        if saved is None:
            return False
        if set(saved) != set(self.state):
            raise ValueError(
                f"{folder}: the checkpoint's EMA names {len(saved)} tensors, this policy {len(self.state)} "
                "(e.g. missing " + str(sorted(set(self.state) - set(saved))[:3]) + "); resume with the model "
                "the run was started with"
            )
        for k, v in self.state.items():
            _local(v).copy_(_slice_like(saved[k], v))
        return True


def _slice_like(full: Tensor, like: Any) -> Tensor:
    """The part of the full tensor `full` that `like` (a DTensor, or a plain tensor) holds on this rank."""
    if not hasattr(like, "to_local"):
        return full
    from torch.distributed.tensor import distribute_tensor

    # every rank holds the same full tensor: each keeps its own slice (no data moves between ranks)
    return distribute_tensor(
        full.to(like.device), like.device_mesh, like.placements, src_data_rank=None
    ).to_local()
