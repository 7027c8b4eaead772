"""Checkpoints of a role's model and optimizer across rank counts (torch.distributed.checkpoint, DCP).

A worker folder of a checkpoint (checkpoints/step_N/policy/, .../critic/) holds one of two formats:

    full     (a 1-rank run)  HF model files (model.safetensors, config.json) + worker_state.pt with the
             optimizer state keyed by parameter index (relayrl.training.checkpoint.load_state)
    sharded  (an N-rank run) dcp/ (DCP: the model weights and the optimizer state, sharded, keyed by parameter
             name) + worker_state.pt (rank 0: schedule and counters) + rng/rank_<r>.pt (each rank's RNG)

Both load on any number of ranks:

    save_sharded(folder, model, optimizer, rng)      every rank calls it (a collective)
    load_model_and_optim(folder, model, optimizer, names, full_weights=, full_optim_state=)
                                                     into a sharded model (DCP reshards to this rank count, or
                                                     a full checkpoint is spread onto the shards) or into a
                                                     1-rank model (a sharded checkpoint is gathered in memory)
    load_rng(folder)                                 this rank's RNG state, if the saving run had this rank
    export_full(model, save)                         the full weights gathered, `save` called on rank 0
    save_tensors(folder, state) / load_tensors(folder, state) / load_full_tensors(folder) / tensors_saved(folder)
                                                     any other sharded name -> tensor dict (the policy's EMA)
    is_sharded_checkpoint(folder)

Optimizer state is matched by parameter NAME (the module's FQN) in every direction, so the rank count, FSDP
and peft wrapping may differ between the saving and the loading run, as long as the model and the set of
trained parameters are the same. `names` names the optimizer's parameters in order (for a 1-rank model whose
optimizer holds separate fp32 master tensors, relayrl.training.precision.MasterWeights, their module names).
Exact resume across rank counts: weights, optimizer and schedule are exact; a rank that did not exist in the
saving run starts its RNG from the run seed (sampling is seeded per request, so rollouts are unaffected).

Every DCP checkpoint is written through `storage_writer(folder)` (relayrl.distributed.dcp_writer: several
files per rank written by threads, a rank's host memory bounded; torch's file layout and records, so the
loaders read checkpoints of either writer).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from relayrl.distributed.dcp_writer import BoundedWriter
from relayrl.distributed.fsdp import is_sharded
from relayrl.training.checkpoint import check_shapes, load_state

DCP_DIR = "dcp"
RNG_DIR = "rng"


def is_sharded_checkpoint(folder: str | Path) -> bool:
    return (Path(folder) / DCP_DIR / ".metadata").is_file()


def _rank() -> int:
    d = torch.distributed
    return d.get_rank() if d.is_available() and d.is_initialized() else 0


def _barrier() -> None:
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        d.barrier()


@contextlib.contextmanager
def without_zip_crc() -> Iterator[None]:
    """torch.save's per-record zip CRC-32 off inside the block (DCP writes every tensor with torch.save). The
    checkpoint's manifest already checksums every file (relayrl.training.crc, in parallel), torch.load reads
    the records without it, and this single-threaded CRC was about half of a rank's DCP write time (CPU,
    170M parameters: 2.5-4.0 s -> 1.4-1.7 s on tmpfs). The previous setting is restored."""
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:  # an older torch: always computed
        yield
        return
    before = get()
    set_(False)
    try:
        yield
    finally:
        set_(before)


def storage_writer(folder: str | Path) -> BoundedWriter:
    """The writer of every DCP checkpoint relayrl saves (relayrl.distributed.dcp_writer: a rank's host memory
    bounded, several files per rank written in parallel; torch's file layout, so any loader reads it)."""
    return BoundedWriter(str(folder))


def save_sharded(
    folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rng: dict[str, Any]
) -> None:
    """Write dcp/ (model + optimizer shards of every rank) and rng/rank_<r>.pt (this rank's RNG state).
    Every rank calls it with its own shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import save

    path = Path(folder)
    msd, osd = get_state_dict(model, optimizer)
    dcp = str(path / DCP_DIR)
    with without_zip_crc():
        save({"model": msd, "optim": osd}, checkpoint_id=dcp, storage_writer=storage_writer(dcp))
    (path / RNG_DIR).mkdir(parents=True, exist_ok=True)
    torch.save(rng, path / RNG_DIR / f"rank_{_rank()}.pt")
    _barrier()


def load_rng(folder: str | Path) -> dict[str, Any] | None:
    """This rank's RNG state from a sharded checkpoint (None when the saving run had fewer ranks)."""

    f = Path(folder) / RNG_DIR / f"rank_{_rank()}.pt"
    return load_state(f) if f.is_file() else None


def _full_dcp(folder: Path) -> dict[str, Any]:
    """The whole DCP checkpoint in this process's memory (for a 1-rank model)."""
    return load_full_tensors(folder / DCP_DIR)


def _dcp_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The model's tensor shapes (name -> global shape) from a DCP checkpoint's metadata, nothing loaded."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(folder / DCP_DIR)).read_metadata().state_dict_metadata
    prefix = "model."
    return {
        k[len(prefix) :]: tuple(v.size)
        for k, v in meta.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }


def _by_index(osd: dict[str, Any], names: list[str], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A name-keyed optimizer state dict -> torch's index-keyed one for `optimizer` (params named `names`)."""
    state = osd.get("state", {})
    missing = [n for n in names if n not in state]
    if missing and len(missing) < len(names):
        raise ValueError(
            f"checkpoint optimizer state lacks {len(missing)} trained parameters, e.g. {missing[:3]}"
        )
    groups = []
    start = 0
    saved_groups = osd.get("param_groups", [])
    for gi, g in enumerate(optimizer.param_groups):
        n = len(g["params"])
        saved = saved_groups[gi] if gi < len(saved_groups) else {}
        groups.append(
            {**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(start, start + n))}
        )
        start += n
    return {"state": {i: state[n] for i, n in enumerate(names) if n in state}, "param_groups": groups}


def _by_name(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """torch's index-keyed optimizer state dict -> the name-keyed form (DCP's / set_state_dict's)."""
    index_of = {}
    groups = []
    for g in osd["param_groups"]:
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
        )
        index_of.update({i: names[i] for i in g["params"]})
    return {"state": {index_of[i]: s for i, s in osd["state"].items()}, "param_groups": groups}


def load_model_and_optim(
    folder: str | Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    *,
    full_weights: Callable[[Path], dict[str, torch.Tensor]],
    full_optim_state: Callable[[Path], dict[str, Any]],
) -> None:
    """Load a sharded checkpoint into `model` / `optimizer` (sharded or not), or a full checkpoint into a
    sharded model (a full checkpoint into a 1-rank model is the worker's plain load).

    `names`: the names of the optimizer's parameters in its order; `full_weights(folder)` -> the full state
    dict of a full checkpoint (names as this model's, unsharded); `full_optim_state(folder)` -> its
    index-keyed optimizer state."""

    path = Path(folder)
    if is_sharded(model):
        _load_into_sharded(path, model, optimizer, names, full_weights, full_optim_state)
        return
    full = _full_dcp(path)
    check_shapes(model, {k: tuple(v.shape) for k, v in full["model"].items()}, path)
    missing, unexpected = model.load_state_dict(full["model"], strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint weights do not fit this model: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}; resume with the model the run was started with"
        )
    optimizer.load_state_dict(_by_index(full["optim"], names, optimizer))


def _load_into_sharded(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    full_weights: Callable[[Path], dict[str, torch.Tensor]],
    full_optim_state: Callable[[Path], dict[str, Any]],
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    if is_sharded_checkpoint(path):
        check_shapes(model, _dcp_shapes(path), path)
        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optim": osd}
        load(state, checkpoint_id=str(path / DCP_DIR))  # reshards to this run's rank count
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return
    weights: dict[str, Any] = full_weights(path)  # plain tensors: what set_state_dict's ValueType allows
    check_shapes(model, {k: tuple(v.shape) for k, v in weights.items()}, path)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=weights,
        optim_state_dict=_by_name(full_optim_state(path), names),
        options=StateDictOptions(full_state_dict=True),
    )


def save_tensors(folder: str | Path, state: dict[str, Any]) -> None:
    """Write a name -> tensor dict (DTensors: each rank its shards) as its own DCP checkpoint in `folder`
    (e.g. the policy's EMA beside dcp/). Every rank calls it."""
    from torch.distributed.checkpoint.state_dict_saver import save

    with without_zip_crc():
        save(dict(state), checkpoint_id=str(folder), storage_writer=storage_writer(folder))
    _barrier()


def tensors_saved(folder: str | Path) -> bool:
    """True when `folder` holds a checkpoint written by `save_tensors`."""
    return (Path(folder) / ".metadata").is_file()


def load_tensors(folder: str | Path, state: dict[str, Any]) -> None:
    """Load `save_tensors`' checkpoint into `state` in place (its DTensors are filled with this rank's
    shards, resharded from whatever rank count wrote it)."""
    from torch.distributed.checkpoint.state_dict_loader import load

    load(state, checkpoint_id=str(folder))


def load_full_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """`save_tensors`' checkpoint as full tensors in this process (for a model on one rank)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(folder), str(out))
        return load_state(out)


def export_full(model: torch.nn.Module, save: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Gather the full weights (to CPU) on every rank and call `save(state_dict)` on rank 0 only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full: dict[str, Any] = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if _rank() == 0:
        save(full)
    _barrier()
