"""The HF model folder of a sharded (FSDP2) role, written by every rank in parallel, each its own rows.

    stats = export_hf(model, folder)            every rank calls it; returns this rank's ExportStats
    stats = export_hf(model, folder, tensors)   other weights of the same model (the policy's sharded EMA)

The folder is what `save_pretrained` writes for the same weights: config.json (+ generation_config.json),
model.safetensors (or model-0000k-of-0000n.safetensors + model.safetensors.index.json past MAX_SHARD_BYTES,
HF's split), fp32 as trained, tied copies left out; a one-file export is byte for byte the file
`save_pretrained` writes (tests/distributed/test_hf_export.py).

Why no gather: FSDP2 shards every parameter along dim 0 (Shard(0), torch.chunk's rows), and a row-major
tensor's rows [start, start + n) are one contiguous byte range of its safetensors data. So the file layout
(header, every tensor's offset) is computed from the global shapes alone, rank 0 writes the headers and sizes
the files, and then every rank writes its own local shard at its offset (os.pwrite) - no collective moves a
weight, no rank holds more than its shard, and the ranks write their 1/N of the bytes at the same time. A GPU
shard goes through one pinned STAGING_BYTES buffer. Tensors that are not sharded (buffers) are written by one
rank each. The old path (`relayrl.distributed.checkpoint.export_full`: every tensor gathered to rank 0's CPU,
then one `save_pretrained` there: the whole fp32 model plus safetensors' serialised copy in rank 0's memory,
one thread writing, the other ranks waiting in a barrier) remains for what this one cannot write in place:
peft models, models whose saved names differ from their parameters (transformers' weight conversions, e.g.
fused MoE experts), placements other than Shard(0) on a 1-D mesh, dtypes safetensors has no name for.
`streamable(model, tensors)` says which (None, or the reason); every rank reaches the same answer.

The ranks of a multi-node group write into one file: the folder must be on a shared filesystem with POSIX
byte-range writes (NFS, Lustre, GPFS; not an object-store mount), as checkpoints already require.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from relayrl.distributed.group import rank, world
from relayrl.distributed.sharded_load import owned_rows
from relayrl.models.forward import hf_model

log = logging.getLogger(__name__)
MAX_SHARD_BYTES = 50 * 10**9
"""save_pretrained's default max_shard_size ("50GB"): a model of more bytes is split into several files."""
STAGING_BYTES = 64 * 2**20
"""The pinned host buffer a GPU shard is copied through on its way to the file."""
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


@dataclass(kw_only=True, slots=True)
class ExportStats:
    """What one rank did in `export_hf`."""

    bytes_written: int
    """Weight bytes this rank wrote (its shards; rank 0 also the headers)."""
    total_bytes: int
    """Bytes of every weight file of the export (all ranks together)."""
    seconds: float
    """Wall time of the export on this rank, barriers included."""
    files: int
    """Number of safetensors files."""


@dataclass(kw_only=True, slots=True)
class _Entry:
    name: str
    tensor: Any
    """The tensor (a DTensor: this rank's shard is written) to write."""
    offset: int = 0
    """Byte offset of its data in its file (header included)."""
    file: int = 0


def untied(model: torch.nn.Module, weights: Mapping[str, Any]) -> dict[str, Any]:
    """`weights` without the tied copies (e.g. lm_head.weight when it is the input embeddings), as the
    one-rank save_pretrained leaves them out. Only ties the model HAS: an untied lm_head (Qwen2.5-7B) is
    kept (the class attribute `_tied_weights_keys` names it whether or not it is tied)."""
    tied = getattr(model, "all_tied_weights_keys", None)  # the ties this model has ({} when untied)
    if tied is None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tied = getattr(model, "_tied_weights_keys", None)  # older transformers: the class's possible ties
    if isinstance(tied, dict):
        return {k: v for k, v in weights.items() if not (k in tied and tied[k] in weights)}
    return dict(weights)


def streamable(model: torch.nn.Module, tensors: Mapping[str, Any]) -> str | None:
    """None when `export_hf` can write `tensors` of `model` in place; else why not (module doc)."""
    from torch.distributed.tensor import DTensor, Shard

    if hf_model(model) is not model:
        return "a peft model (its adapter folder is written by save_pretrained)"
    if getattr(model, "is_remote_code", lambda: False)():
        return "a remote-code model (save_pretrained copies its code files)"
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
            return f"{name} has dtype {getattr(t, 'dtype', type(t).__name__)}, not one safetensors names"
        if isinstance(t, DTensor) and (
            t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),) or not t.dim()
        ):
            return f"{name} is placed {t.placements} on {t.device_mesh}, not Shard(0) on a 1-D mesh"
    try:  # transformers' own check for renamed / fused saved weights
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers whose save_pretrained reverts no conversion but the renames below
        if getattr(model, "_checkpoint_conversion_mapping", None):
            return "the model renames its weights when saved (_checkpoint_conversion_mapping)"
        return None
    meta = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in tensors.items()}
    try:
        saved = revert_weight_conversion(cast(Any, model), meta)
    except Exception as e:
        return f"transformers' weight conversion cannot be checked on shapes alone ({type(e).__name__})"
    if set(saved) != set(meta) or any(tuple(saved[k].shape) != tuple(meta[k].shape) for k in meta):
        return "the model's saved weight names differ from its parameters (transformers' weight conversions)"
    return None


def _split(entries: list[_Entry], max_bytes: int) -> list[list[_Entry]]:
    """Files of entries in state-dict order, as huggingface_hub's split_torch_state_dict_into_shards: a
    tensor bigger than `max_bytes` goes alone, else a new file starts when the next one would tip it over."""
    files: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for e in entries:
        n = _nbytes(e.tensor)
        if n > max_bytes:
            files.append([e])
            continue
        if current and size + n > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += n
    if current:
        files.append(current)
    return files


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _header(entries: list[_Entry]) -> tuple[bytes, int]:
    """The safetensors header of one file (the layout safetensors itself writes: data sorted by dtype size,
    then name; the JSON padded with spaces to 8 bytes) with every entry's `offset` set; (header, file size)."""
    entries.sort(key=lambda e: (-e.tensor.element_size(), e.name))
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for e in entries:
        n = _nbytes(e.tensor)
        meta[e.name] = {
            "dtype": DTYPES[e.tensor.dtype],
            "shape": list(e.tensor.shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    for e in entries:
        e.offset += start + meta[e.name]["data_offsets"][0]
    return len(text).to_bytes(8, "little") + text, start + pos


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [WEIGHTS]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _pwrite(fd: int, data: Any, pos: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


class _Writer:
    """Writes a tensor's bytes at a file position; GPU tensors through one pinned staging buffer."""

    def __init__(self) -> None:
        self.staging: torch.Tensor | None = None
        self.written = 0

    def write(self, fd: int, t: torch.Tensor, pos: int) -> None:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            _pwrite(fd, flat.numpy(), pos)
        else:
            if self.staging is None:
                self.staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
            for i in range(0, flat.numel(), STAGING_BYTES):
                n = min(STAGING_BYTES, flat.numel() - i)
                self.staging[:n].copy_(flat[i : i + n])
                _pwrite(fd, self.staging[:n].numpy(), pos + i)
        self.written += flat.numel()


def write_config(model: torch.nn.Module, folder: Path) -> None:
    """config.json (+ generation_config.json) as save_pretrained writes them (dtype and architectures set
    from the model, the FSDP class prefix removed)."""
    hf: Any = model
    hf.config.dtype = str(hf.dtype).split(".")[1]
    hf.config.architectures = [type(hf).__name__.removeprefix("FSDP")]
    hf.config.save_pretrained(folder)
    if hf.can_generate():
        hf.generation_config.save_pretrained(folder)


@torch.no_grad()
def export_hf(
    model: torch.nn.Module,
    folder: str | Path,
    tensors: Mapping[str, Any] | None = None,
    *,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> ExportStats:
    """Write the HF folder of `model` (or of `tensors`, name -> tensor of the same model: DTensor shards or
    whole tensors) into `folder`: every rank writes its own rows (module doc). Every rank of the model's group
    calls it; `streamable` must have said None. The tokenizer is the caller's."""
    t0 = time.perf_counter()
    path = Path(folder)
    state = untied(model, tensors if tensors is not None else model.state_dict())
    entries = [_Entry(name=k, tensor=v) for k, v in state.items()]
    files = _split(entries, max_shard_bytes)
    names = _file_names(len(files))
    headers = []
    for i, group in enumerate(files):
        for e in group:
            e.file = i
        headers.append(_header(group))
    me, ranks = rank(), world()
    writer = _Writer()
    if me == 0:
        path.mkdir(parents=True, exist_ok=True)
        for stale in [*path.glob("model*.safetensors"), path / INDEX]:  # an earlier export's other split
            if stale.name not in names:
                stale.unlink(missing_ok=True)
        for name, (head, size) in zip(names, headers, strict=True):
            with open(path / name, "wb") as f:
                f.write(head)
                f.truncate(size)  # the data region, filled by the ranks below
        writer.written = sum(len(h) for h, _ in headers)
    _barrier()
    fds = [os.open(path / n, os.O_WRONLY) for n in names]
    try:
        for i, e in enumerate(entries):
            _write_mine(writer, fds[e.file], e, i, me, ranks)
    finally:
        for fd in fds:
            os.close(fd)
    _barrier()
    if me == 0:
        write_config(model, path)
        if len(files) > 1:
            _write_index(model, path, files, names)
    total = sum(size for _, size in headers)
    return ExportStats(
        bytes_written=writer.written, total_bytes=total, seconds=time.perf_counter() - t0, files=len(files)
    )


def _write_mine(writer: _Writer, fd: int, e: _Entry, index: int, me: int, ranks: int) -> None:
    """This rank's part of entry `e`: its rows of a sharded tensor; a whole tensor when it owns it (the
    entries that are not sharded go to the ranks in turn)."""
    t = e.tensor
    if hasattr(t, "to_local"):
        start, count = owned_rows(t)
        if count:
            row = _nbytes(t) // t.shape[0]
            writer.write(fd, t.to_local(), e.offset + start * row)
    elif index % ranks == me and t.numel():
        writer.write(fd, t, e.offset)


def _write_index(model: torch.nn.Module, folder: Path, files: list[list[_Entry]], names: list[str]) -> None:
    """model.safetensors.index.json as save_pretrained writes it for a split model."""
    weight_map = {e.name: names[i] for i, group in enumerate(files) for e in group}
    total = sum(_nbytes(e.tensor) for group in files for e in group)
    params = sum(p.numel() for p in model.parameters())
    index = {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def export_sharded(
    model: torch.nn.Module,
    folder: str | Path,
    tokenizer: Any,
    gathered: Callable[[], None],
    tensors: Mapping[str, Any] | None = None,
) -> ExportStats | None:
    """The HF folder (+ tokenizer, by rank 0) of a sharded role: `export_hf` when `streamable`, else
    `gathered()` (the old path through rank 0, which writes the tokenizer itself), with a log line saying
    why. Every rank calls it. Returns this rank's ExportStats (None on the old path)."""
    state = dict(tensors) if tensors is not None else model.state_dict()
    reason = streamable(model, state)
    if reason is not None:
        log.warning("export of %s gathered on rank 0 (the old path): %s", folder, reason)
        gathered()
        return None
    stats = export_hf(model, folder, state)
    if rank() == 0:
        tokenizer.save_pretrained(folder)
        log.info(
            "exported %s: %.2f GB in %d file(s), %.1f s (%.2f GB by this rank)",
            folder, stats.total_bytes / 1e9, stats.files, stats.seconds, stats.bytes_written / 1e9,
        )  # fmt: skip
    return stats
