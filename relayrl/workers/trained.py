"""What the trained roles (policy, critic) share about sharding and state: one place that knows whether the
role runs on one rank (plain module, HF-folder checkpoints) or on N ranks (FSDP2 shards, DCP checkpoints).

    shard_if_grouped(model, dist, device, precision)   FSDP2-shard `model` when this process is one rank of
                                                       a multi-rank role; returns True when it did
    state = RoleState(model, train, tokenizer, full_weights)
    state.save(folder, extra)         1 rank: HF folder + worker_state.pt; N ranks: dcp/ + rng/ + worker_state.pt
    extra = state.load(folder)        either format, on any rank count (relayrl.distributed.checkpoint)
    state.export(folder)              HF folder of the full model (+ tokenizer), written by rank 0
    state.save_hf(folder, weights)    HF folder from a full state dict (rank 0)

worker_state.pt always holds the schedule, counters and (1 rank) optimizer state and RNG; the role adds its own
`extra` entries (e.g. the policy's EMA). Under N ranks the RNG of each rank is in rng/rank_<r>.pt.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relayrl.config.rl import DistConfig
from relayrl.distributed.checkpoint import (
    export_full,
    is_sharded_checkpoint,
    load_model_and_optim,
    load_rng,
    save_sharded,
)
from relayrl.distributed.fsdp import ShardSpec, is_sharded, shard_model
from relayrl.distributed.group import in_group, rank
from relayrl.training.rng import capture_rng_state, restore_rng_state
from relayrl.training.step import TrainStep

STATE_FILE = "worker_state.pt"


def shard_if_grouped(model: Any, dist: DistConfig | None, device: torch.device, precision: str) -> bool:
    """Shard `model` with FSDP2 when this process is one rank of a multi-rank role (see module doc)."""
    if not in_group():
        return False
    d = dist or DistConfig()
    spec = ShardSpec(
        device=device,
        compute_dtype=torch.bfloat16 if precision == "bf16" else None,
        offload=d.offload,
        reshard_after_forward=d.reshard_after_forward,
    )
    shard_model(model, spec)
    return True


def _optimizer_names(model: torch.nn.Module, train: TrainStep) -> list[str]:
    """Module names of the optimizer's parameters, in the optimizer's order."""
    if train.master is not None:
        return [n for n, _ in train.master.named_params()]
    ids = {id(p): n for n, p in model.named_parameters()}
    return [ids[id(p)] for g in train.optimizer.param_groups for p in g["params"]]


class RoleState:
    """Checkpoint and export of a trained role (see module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        train: TrainStep,
        tokenizer: Any,
        full_weights: Callable[[Path], dict[str, torch.Tensor]],
    ) -> None:
        self.model, self.train, self.tokenizer = model, train, tokenizer
        self.full_weights = full_weights

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)

    def save(self, folder: str | Path, extra: dict[str, Any]) -> None:
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {
            "scheduler": self.train.scheduler.state_dict(),
            "nonfinite_skips": self.train.nonfinite_total,
            **extra,
        }
        if self.sharded:
            save_sharded(path, self.model, self.train.optimizer, capture_rng_state())
            if rank() == 0:
                self.model.config.save_pretrained(path)  # what the folder holds (architecture), no weights
                self.tokenizer.save_pretrained(path)
                torch.save(state, path / STATE_FILE)
            torch.distributed.barrier()
            return
        with self.train.full_precision():
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        state["optimizer"] = self.train.optimizer.state_dict()
        state["rng"] = capture_rng_state()
        torch.save(state, path / STATE_FILE)

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore model, optimizer, schedule, counters and RNG; returns worker_state.pt's entries."""
        from relayrl.training.checkpoint import load_state, load_weights_into

        path = Path(folder)
        state = load_state(path / STATE_FILE)
        if self.sharded or is_sharded_checkpoint(path):
            with self.train.full_precision():
                load_model_and_optim(
                    path,
                    self.model,
                    self.train.optimizer,
                    _optimizer_names(self.model, self.train),
                    full_weights=self.full_weights,
                    full_optim_state=lambda p: load_state(p / STATE_FILE)["optimizer"],
                )
            if self.train.master is not None:  # the masters hold the loaded fp32 weights
                self.train.master.refresh()
            rng = load_rng(path) if is_sharded_checkpoint(path) else state.get("rng")
        else:
            with self.train.full_precision():
                load_weights_into(self.model, path)
            self.train.optimizer.load_state_dict(state["optimizer"])
            rng = state["rng"]
        self.train.scheduler.load_state_dict(state["scheduler"])
        self.train.nonfinite_total = int(state.get("nonfinite_skips", 0))
        if rng is not None:
            restore_rng_state(rng)
        return state

    def export(self, folder: str | Path) -> str:
        """The full model as an HF folder (+ tokenizer); every rank calls it, rank 0 writes."""
        path = Path(folder)
        if self.sharded:
            export_full(self.model, lambda sd: self.save_hf(path, sd))
            return str(path)
        with self.train.full_precision():
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return str(path)

    def save_hf(self, folder: str | Path, weights: dict[str, torch.Tensor]) -> None:
        """An HF folder with `weights` (a full state dict of this model), from rank 0 only."""
        self.model.save_pretrained(folder, state_dict=weights)
        self.tokenizer.save_pretrained(folder)
