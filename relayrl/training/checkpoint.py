"""Atomic, rotating, exactly-resumable checkpoints (DESIGN.md "Outputs").

Layout of one checkpoint (`CheckpointManager.save`)::

    <root>/
      latest                  text file: the folder name of the newest complete checkpoint ("step_40")
      step_40/
        model/                HF folder (save_pretrained + tokenizer) -> from_pretrained loads it
                              (or weights.pt, a torch state_dict, with hf_format=False)
        critic/               ... one folder per entry of `models` (RL saves policy and critic)
        optim.pt              {"optimizers": {name: state_dict}, "schedulers": {name: state_dict}}
        extra.pt              anything torch-picklable the trainer wants back (dataloader state, ...)
        rng.pt                python / numpy / torch / cuda RNG states (`capture_rng_state`)
        trainer_state.json    JSON: {"step", "metric", ...trainer fields}

Atomicity: everything is written into `<root>/.tmp-step_40-<pid>/` and renamed to `step_40/` only when
complete; `latest` is then replaced with `os.replace` (atomic on POSIX). A crash mid-save leaves at most a
`.tmp-*` folder, which `latest()` ignores and the next `save` removes. Rotation (after each save) keeps the
`keep_last` newest checkpoints plus the `keep_best` best by the `metric` passed to `save` (`best_mode` min or
max); the one `latest` points to is never removed.

Never a non-finite model: `check_finite_weights(model, what)` raises `NonFiniteWeights` (naming how many values
and which parameters) before a checkpoint or the final model is written from weights that hold NaN or inf
(relayrl.workers.trained calls it), so a run that diverged stops with an error and exports nothing.

Resume: `load(path, models=..., optimizers=..., schedulers=...)` restores weights in place (HF safetensors or a
peft adapter), optimizer and scheduler states, the RNG states, and returns a `LoadedCheckpoint` with the trainer
state and the extra payload. Single-process (or rank-0 full-state) checkpoints; sharded FSDP state belongs to
relayrl/distributed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from relayrl.training.crc import files_crc32
from relayrl.training.rng import capture_rng_state, restore_rng_state

LATEST = "latest"
STEP_PREFIX = "step_"
TMP_PREFIX = ".tmp-"
WEIGHTS_FILE = "weights.pt"


@dataclass(kw_only=True, slots=True)
class LoadedCheckpoint:
    """What `CheckpointManager.load` returns besides the in-place restores."""

    path: Path
    """The checkpoint folder (`<root>/step_<N>`)."""
    step: int
    """Optimizer steps completed when it was saved."""
    trainer_state: dict[str, Any]
    """The JSON trainer state passed to `save` (plus "step" and "metric")."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The `extra` payload passed to `save` (e.g. {"data": data-iterator state})."""


class NonFiniteWeights(RuntimeError):
    """The weights about to be saved hold NaN or inf: the run diverged (see `check_finite_weights`)."""


def check_finite_weights(tensors: Mapping[str, torch.Tensor], what: str, *, reduce: bool = False) -> None:
    """Raise NonFiniteWeights before `what` (e.g. "the final model <run>/final") is written from `tensors`
    (name -> tensor; DTensor shards are read locally) when any value is NaN or inf. `reduce`: sum the count
    over the ranks of the default process group (sharded weights: every rank must call it)."""
    bad, total, names = 0, 0, []
    for name, t in tensors.items():
        local = t.detach()
        local = local.to_local() if isinstance(local, DTensor) else local  # a sharded parameter: its shard
        if not local.is_floating_point():
            continue
        n = int((~torch.isfinite(local)).sum())
        bad, total = bad + n, total + local.numel()
        if n:
            names.append(name)
    if reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
        counts = torch.tensor([bad, total], dtype=torch.int64)
        if "nccl" in torch.distributed.get_backend():
            counts = counts.cuda()
        torch.distributed.all_reduce(counts)
        bad, total = (int(v) for v in counts.tolist())
    if bad:
        where = f" (in {', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else ""
        raise NonFiniteWeights(
            f"refusing to write {what}: {bad} of {total} weight values are NaN or infinite{where}; the run "
            "diverged. Lower --optim.lr or set --optim.max_grad_norm, and continue from an earlier checkpoint "
            "(--ckpt.resume PATH)"
        )


def step_of(path: Path) -> int:
    """The N of a `step_<N>` folder name."""
    return int(path.name[len(STEP_PREFIX) :])


class CheckpointManager:
    """Saves, rotates, finds and loads checkpoints under one root folder.

    Args:
        root: the checkpoint folder (created if missing).
        keep_last: newest checkpoints to keep (>= 1); older ones are deleted after each save.
        keep_best: additionally keep this many best checkpoints by the `metric` given to `save` (0: none).
        best_mode: "min" (e.g. eval loss) or "max" (e.g. accuracy).
        hf_format: write each model as an HF folder (save_pretrained, loadable by from_pretrained); False
            writes only `<name>/weights.pt` (a torch state_dict: smaller, still exactly resumable).
    """

    def __init__(
        self,
        root: str | Path,
        *,
        keep_last: int = 2,
        keep_best: int = 0,
        best_mode: str = "min",
        hf_format: bool = True,
    ):
        if keep_last < 1:
            raise ValueError(f"ckpt keep_last must be >= 1, got {keep_last}")
        if best_mode not in ("min", "max"):
            raise ValueError(f"ckpt best_mode must be 'min' or 'max', got {best_mode!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_mode = best_mode
        self.hf_format = hf_format
        self.last_save: tuple[float, int] | None = None
        """(seconds, bytes) of the latest `save`: its wall time and the bytes of its files."""

    # ---------------------------------------------------------------- discovery
    def checkpoints(self) -> list[Path]:
        """Complete checkpoint folders, oldest step first."""
        if not self.root.is_dir():
            return []
        found = [
            p
            for p in self.root.iterdir()
            if p.is_dir() and p.name.startswith(STEP_PREFIX) and p.name[len(STEP_PREFIX) :].isdigit()
        ]
        return sorted(found, key=step_of)

    def latest(self) -> Path | None:
        """The folder `latest` names, or the newest complete one if the pointer is missing; None if none."""
        pointer = self.root / LATEST
        if pointer.is_file():
            target = self.root / pointer.read_text().strip()
            if (target / "trainer_state.json").is_file():
                return target
        complete = [p for p in self.checkpoints() if (p / "trainer_state.json").is_file()]
        return complete[-1] if complete else None

    # ---------------------------------------------------------------- save
    def save(
        self,
        step: int,
        *,
        models: Mapping[str, Any],
        tokenizer: Any = None,
        optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
        schedulers: Mapping[str, Any] | None = None,
        trainer_state: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
        metric: float | None = None,
    ) -> Path:
        """Write `<root>/step_<step>/` atomically, point `latest` at it, rotate; returns the folder.

        `models` maps a sub-folder name to a model with `save_pretrained` (HF or peft); the tokenizer is saved
        into every model folder. `trainer_state` must be JSON-serialisable; `extra` is torch-pickled.
        `metric` (lower is better when best_mode="min") ranks checkpoints for `keep_best`.
        """
        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()
        final = self.root / f"{STEP_PREFIX}{step}"
        tmp = self.root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        try:
            tmp.mkdir()
            for name, model in models.items():
                if self.hf_format or not hasattr(model, "state_dict"):  # a worker writes its own format
                    model.save_pretrained(tmp / name)
                else:
                    (tmp / name).mkdir()
                    torch.save(model.state_dict(), tmp / name / WEIGHTS_FILE)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp / name)
            torch.save(
                {
                    "optimizers": {k: o.state_dict() for k, o in (optimizers or {}).items()},
                    "schedulers": {k: s.state_dict() for k, s in (schedulers or {}).items()},
                },
                tmp / "optim.pt",
            )
            torch.save(dict(extra or {}), tmp / "extra.pt")
            torch.save(capture_rng_state(), tmp / "rng.pt")
            state = {**dict(trainer_state or {}), "step": step, "metric": metric}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
            written = write_manifest(tmp)  # last: sizes and checksums of everything above
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():  # re-saving a step (e.g. after a resume): swap, never leave a half folder
            trash = self.root / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
            final.rename(trash)
            tmp.rename(final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            tmp.rename(final)
        self._write_latest(final.name)
        self._rotate()
        self.last_save = (time.perf_counter() - t0, written)
        print(write_line(f"checkpoint {final}", *self.last_save), flush=True)
        return final

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.root / LATEST)

    def _remove_stale_tmp(self) -> None:
        for p in self.root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)

    def _metric_of(self, path: Path) -> float | None:
        try:
            return json.loads((path / "trainer_state.json").read_text()).get("metric")
        except (OSError, ValueError):
            return None

    def _rotate(self) -> None:
        ckpts = self.checkpoints()
        keep = set(ckpts[-self.keep_last :])
        if self.keep_best > 0:
            scored = [(m, p) for p in ckpts if (m := self._metric_of(p)) is not None]
            scored.sort(key=lambda mp: mp[0], reverse=self.best_mode == "max")
            keep |= {p for _, p in scored[: self.keep_best]}
        latest = self.latest()
        if latest is not None:
            keep.add(latest)
        for p in ckpts:
            if p not in keep:
                shutil.rmtree(p, ignore_errors=True)

    def resumable(self) -> Path | None:
        """The newest checkpoint that verifies against its manifest (`verify`); a damaged newer one is
        skipped with a warning naming the file, so a run falls back to the previous complete checkpoint."""
        for path in reversed(self.checkpoints()):
            problem = verify(path)
            if problem is None:
                return path
            warnings.warn(
                f"checkpoint {path} is damaged ({problem}); falling back to the previous checkpoint",
                stacklevel=2,
            )
        return None

    def best(self) -> Path | None:
        """The kept checkpoint with the best metric (None when no checkpoint has one)."""
        scored = [(m, p) for p in self.checkpoints() if (m := self._metric_of(p)) is not None]
        if not scored:
            return None
        pick = min if self.best_mode == "min" else max
        return pick(scored, key=lambda mp: mp[0])[1]

    # ---------------------------------------------------------------- load
    def load(
        self,
        path: str | Path | None = None,
        *,
        models: Mapping[str, torch.nn.Module] | None = None,
        optimizers: Mapping[str, torch.optim.Optimizer] | None = None,
        schedulers: Mapping[str, Any] | None = None,
        restore_rng: bool = True,
    ) -> LoadedCheckpoint:
        """Restore a checkpoint in place (default: `latest()`); returns trainer state and `extra`.

        Models must have the same architecture as when saved; weights are copied into them (so optimizers
        built on their parameters stay valid). Optimizer and scheduler states are loaded after the weights. A
        `step_<N>` folder whose trainer state holds another step is refused (renamed or copied: resuming would
        skip or repeat steps).
        """
        path = Path(path) if path is not None else self.resumable()
        if path is None or not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(
                f"no complete checkpoint at {path or self.root}: expected a step_<N> folder with trainer_state.json"
            )
        problem = verify(path)
        if problem is not None:
            raise ValueError(
                f"checkpoint {path} is damaged ({problem}); resume from another one with --ckpt.resume "
                f"{self.root}/step_<N>, or remove it and rerun to fall back to the previous one"
            )
        state = json.loads((path / "trainer_state.json").read_text())
        step = int(state["step"])
        if path.name.startswith(STEP_PREFIX) and path.name != f"{STEP_PREFIX}{step}":
            raise ValueError(
                f"checkpoint {path} holds step {step} (trainer_state.json), not the step its name says: it was "
                f"renamed or copied, and resuming would skip or repeat steps; rename it {STEP_PREFIX}{step} or "
                f"resume from another one"
            )
        for name, model in (models or {}).items():
            load_weights_into(model, path / name)
        optim = load_state(path / "optim.pt")
        for name, opt in (optimizers or {}).items():
            opt.load_state_dict(optim["optimizers"][name])
        for name, sched in (schedulers or {}).items():
            sched.load_state_dict(optim["schedulers"][name])
        if restore_rng:
            restore_rng_state(load_state(path / "rng.pt"))
        extra = load_state(path / "extra.pt")
        return LoadedCheckpoint(path=path, step=step, trainer_state=state, extra=extra)


MANIFEST = "manifest.json"


def write_line(what: str, seconds: float, nbytes: int) -> str:
    """'relayrl: checkpoint <folder> written: 78.12 GB in 41.3 s' (what users read after every save)."""
    return f"relayrl: {what} written: {nbytes / 1e9:.2f} GB in {seconds:.1f} s"


def timed_write(what: str, write: Callable[[], str | Path]) -> Path:
    """Run `write` (it writes a folder and returns its path) and print its `write_line`; returns the path."""
    t0 = time.perf_counter()
    folder = Path(write())
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    print(write_line(f"{what} {folder}", time.perf_counter() - t0, size), flush=True)
    return folder


def write_manifest(folder: Path) -> int:
    """manifest.json: {relative path: {"size", "crc32"}} of every file under `folder` (written last, so a
    checkpoint is only as complete as its manifest says; checksummed by several threads,
    relayrl.training.crc). Returns the bytes of those files."""
    paths = [p for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST]
    crcs = files_crc32(paths)
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "crc32": crcs[p]} for p in paths}
    (folder / MANIFEST).write_text(json.dumps(files, indent=1, sort_keys=True))
    return sum(f["size"] for f in files.values())


def verify(folder: Path) -> str | None:
    """None when the checkpoint `folder` is intact; else what is wrong, naming the file: trainer_state.json
    unreadable, or a file of the manifest missing, truncated or changed (a checkpoint without a manifest,
    from before manifests, is only checked for its trainer_state.json)."""
    state = folder / "trainer_state.json"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as e:
        return f"{state}: unreadable ({type(e).__name__})"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())
    except ValueError:
        return f"{manifest}: unreadable"
    for rel, want in files.items():
        f = folder / rel
        if not f.is_file():
            return f"{f}: missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{f}: {size} bytes, {want['size']} when written"
    crcs = files_crc32([folder / rel for rel in files])
    for rel, want in files.items():
        if crcs[folder / rel] != want["crc32"]:
            return f"{folder / rel}: contents changed since written (checksum)"
    return None


def load_state(path: str | Path) -> Any:
    """torch.load of a state file with weights_only=True: tensors and plain Python types only. A file that
    carries pickled objects is refused (unpickling a checkpoint made by someone else could run their code)."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"{path} holds pickled Python objects, not only tensors and plain types; refusing to load it "
            "(unpickling could run code). relayrl writes state that loads with weights_only=True: resume "
            "from a checkpoint written by relayrl"
        ) from err


def _read_safetensors_folder(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob(f"{stem}*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {stem}*.safetensors in {folder}: was it saved with save_pretrained?")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def load_weights_into(model: torch.nn.Module, folder: str | Path) -> None:
    """Copy the weights of an HF (or peft adapter) folder into `model` in place.

    Keys missing from the files are allowed only when they are tied to a loaded parameter (e.g. lm_head tied to
    the embeddings); anything else is an error naming the keys.
    """
    folder = Path(folder)
    if (folder / WEIGHTS_FILE).is_file():
        weights = torch.load(folder / WEIGHTS_FILE, map_location="cpu", weights_only=True)
        check_shapes(model, {k: tuple(v.shape) for k, v in weights.items()}, folder)
        model.load_state_dict(weights)
        return
    if (folder / "adapter_config.json").is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, _read_safetensors_folder(folder, "adapter_model"))
        return
    state = _read_safetensors_folder(folder, "model")
    check_shapes(model, {k: tuple(v.shape) for k, v in state.items()}, folder)
    result = model.load_state_dict(state, strict=False)
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    untied = [k for k in result.missing_keys if own[k].data_ptr() not in loaded_ptrs]
    if not untied and not result.unexpected_keys:
        return
    # Saved names may differ from in-memory names (transformers' weight conversions, e.g. fused MoE experts):
    # let from_pretrained map them, then copy.
    mismatch = (
        f"checkpoint {folder} does not match the model: missing {untied[:5]}, unexpected "
        f"{result.unexpected_keys[:5]}; was it saved from the same architecture?"
    )
    from_pretrained = getattr(type(model), "from_pretrained", None)
    if from_pretrained is None:
        raise ValueError(mismatch)
    fresh = from_pretrained(folder, dtype=next(model.parameters()).dtype)
    try:
        model.load_state_dict(fresh.state_dict(), strict=True)
    except RuntimeError as err:
        raise ValueError(mismatch) from err


def _architecture(config: Any) -> str:
    """ "hidden 64, 2 layers, vocab 300" from an HF config (object or config.json dict); "" when unknown."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    parts = [
        f"{label} {get(key)}"
        for key, label in (
            ("hidden_size", "hidden"),
            ("num_hidden_layers", "layers"),
            ("vocab_size", "vocab"),
        )
        if isinstance(get(key), int)
    ]
    return ", ".join(parts)


def check_shapes(model: torch.nn.Module, saved: Mapping[str, tuple[int, ...]], source: str | Path) -> None:
    """One clear ValueError when tensors saved in `source` (name -> shape; names as the model's) have other
    shapes than the model's: the checkpoint belongs to another model. Names both shapes (and both
    architectures, where `source` holds a config.json) and what to do. Names only one side has are left to
    the caller."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    diff = [(k, shape, own[k]) for k, shape in saved.items() if k in own and tuple(shape) != own[k]]
    if not diff:
        return
    name, theirs, ours = diff[0]
    arch_ours = _architecture(getattr(model, "config", None))
    config_file = Path(source) / "config.json"
    arch_theirs = _architecture(json.loads(config_file.read_text())) if config_file.is_file() else ""
    archs = f" (checkpoint: {arch_theirs}; this model: {arch_ours})" if arch_theirs and arch_ours else ""
    raise ValueError(
        f"checkpoint {source} belongs to another model{archs}: {len(diff)} of its tensors have other shapes, "
        f"e.g. {name} is {list(theirs)} there and {list(ours)} here. Resume with the model the run was started "
        "with (its config.yaml names it), or start a new run from this model: another --train.output_dir, or "
        "--ckpt.resume none --ckpt.overwrite true"
    )
