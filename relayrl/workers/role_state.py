"""A trained role's checkpoint and export on one rank, on N FSDP2-sharded ranks, or on N replicated ranks
(dist.replicate): the one place that knows which files each writes and how each loads on any rank count
(relayrl.workers.trained's module doc has the formats).

    state = RoleState(model, train, tokenizer, full_weights, hf_format=True)
    state.save(folder, extra)     1 rank: HF folder + worker_state.pt (optimizer, RNG); N sharded ranks: dcp/ +
                                  rng/rank_<r>.pt + worker_state.pt; N replicated ranks: rank 0 writes the
                                  one-rank files, every rank its rng/rank_<r>.pt (the replicas checked equal)
    extra = state.load(folder)    either format, on any rank count, sharded or replicated
    state.export(folder)          HF folder of the full model (+ tokenizer); sharded: each rank writes its rows
    state.export_whole(folder, w) an unsharded model's HF folder (rank 0), with weights `w` (e.g. an EMA) if given
    state.save_hf(folder, w)      HF folder from a full state dict (rank 0)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relayrl.distributed.checkpoint import (
    RNG_DIR,
    export_full,
    is_sharded_checkpoint,
    load_model_and_optim,
    load_rng,
    save_sharded,
)
from relayrl.distributed.fsdp import is_sharded
from relayrl.distributed.group import in_group, rank
from relayrl.distributed.hf_export import export_sharded, untied
from relayrl.models.loading import pretrained
from relayrl.training.checkpoint import WEIGHTS_FILE, check_finite_weights, load_state, load_weights_into
from relayrl.training.replicate import check_replicas
from relayrl.training.rng import capture_rng_state, restore_rng_state
from relayrl.training.step import TrainStep

STATE_FILE = "worker_state.pt"


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
        hf_format: bool = True,
    ) -> None:
        self.model, self.train, self.tokenizer = model, train, tokenizer
        self.full_weights = full_weights
        self.hf_format = hf_format
        """1 rank: an HF folder (save_pretrained), or False: a plain state dict (weights.pt)."""

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)

    @property
    def replicated(self) -> bool:
        """One rank of several, each holding the whole model (dist.replicate): rank 0 writes the one-rank
        format, every rank its RNG."""
        return in_group() and not self.sharded

    def check_finite(self, what: str) -> None:
        """NonFiniteWeights (relayrl.training.checkpoint) when the trained weights hold NaN / inf: nothing
        is written from a diverged model. Every rank calls it (the count is summed over a sharded role)."""
        with self.train.full_precision():
            check_finite_weights(dict(self.model.named_parameters()), what, reduce=self.sharded)

    def save(self, folder: str | Path, extra: dict[str, Any]) -> None:
        path = Path(folder)
        self.check_finite(f"a checkpoint to {path}")
        path.mkdir(parents=True, exist_ok=True)
        state: dict[str, Any] = {
            "scheduler": self.train.scheduler.state_dict(),
            "nonfinite_skips": self.train.nonfinite_total,
            **extra,
        }
        if self.sharded:
            save_sharded(path, self.model, self.train.optimizer, capture_rng_state())
            if rank() == 0:
                pretrained(self.model).config.save_pretrained(
                    path
                )  # what the folder holds (architecture), no weights
                self.tokenizer.save_pretrained(path)
                torch.save(state, path / STATE_FILE)
            torch.distributed.barrier()
            return
        if self.replicated:  # the replicas must agree before one of them speaks for all
            check_replicas(self.train.optimizer_params(), f"a checkpoint to {path}")
            (path / RNG_DIR).mkdir(parents=True, exist_ok=True)
            torch.save(capture_rng_state(), path / RNG_DIR / f"rank_{rank()}.pt")
        if rank() == 0:
            with self.train.full_precision():
                if self.hf_format:
                    pretrained(self.model).save_pretrained(path)
                else:
                    torch.save(self.model.state_dict(), path / WEIGHTS_FILE)
            self.tokenizer.save_pretrained(path)
            state["optimizer"] = self.train.optimizer.state_dict()
            state["rng"] = capture_rng_state()
            torch.save(state, path / STATE_FILE)
        if self.replicated:
            torch.distributed.barrier()

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore model, optimizer, schedule, counters and RNG; returns worker_state.pt's entries."""
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
        else:
            with self.train.full_precision():
                load_weights_into(self.model, path)
            self.train.optimizer.load_state_dict(state["optimizer"])
        # per-rank RNG (a sharded or a replicated run's checkpoint; None for a rank the saving run did not
        # have: it keeps the run seed's), else the one rank's
        per_rank = is_sharded_checkpoint(path) or (path / RNG_DIR).is_dir()
        rng = load_rng(path) if per_rank else state.get("rng")
        self.train.scheduler.load_state_dict(state["scheduler"])
        self.train.nonfinite_total = int(state.get("nonfinite_skips", 0))
        if rng is not None:
            restore_rng_state(rng)
        return state

    def export(self, folder: str | Path) -> str:
        """The full model as an HF folder (+ tokenizer); every rank calls it. Refused
        (NonFiniteWeights, nothing written) when the weights are not finite."""
        path = Path(folder)
        self.check_finite(f"the final model to {path}")
        if self.sharded:  # every rank writes its own rows (distributed/hf_export.py), else through rank 0
            old_path = lambda: export_full(self.model, lambda sd: self.save_hf(path, sd))  # noqa: E731
            export_sharded(self.model, path, self.tokenizer, old_path)
            return str(path)
        self.export_whole(path)
        return str(path)

    def export_whole(self, path: Path, weights: dict[str, torch.Tensor] | None = None) -> None:
        """The HF folder of an unsharded model (one rank, or replicated ranks: rank 0 writes for all, the others
        wait), with `weights` (a full state dict, e.g. the policy's EMA) in place of the trained ones if given."""
        if rank() == 0:
            with self.train.full_precision():
                current = None
                if weights is not None:
                    current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                    self.model.load_state_dict(weights)
                pretrained(self.model).save_pretrained(path)
                if current is not None:
                    self.model.load_state_dict(current)
            self.tokenizer.save_pretrained(path)
        if self.replicated:
            torch.distributed.barrier()

    def save_hf(self, folder: str | Path, weights: dict[str, torch.Tensor]) -> None:
        """An HF folder with `weights` (a full state dict of this model), from rank 0 only. Tied copies (e.g.
        lm_head.weight = the input embeddings) are left out, as the one-rank save_pretrained does."""
        pretrained(self.model).save_pretrained(folder, state_dict=untied(self.model, weights))
        self.tokenizer.save_pretrained(folder)
