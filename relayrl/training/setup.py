"""Recipe set-up shared by every trainer and worker: component configs -> the training core's parts.

    device = resolve_device(cfg.train.device); seed_everything(cfg.train.seed)
    run_dir = run_dir_of(cfg.train, "sft")                       train.output_dir or runs/<command>
    total = total_steps_of(cfg.train, len(train_samples))
    step = build_train_step(model, cfg.optim, total, loss_fn, precision=...)   AdamW + schedule + clipping
    ckpt = build_checkpoint_manager(cfg.ckpt, run_dir)           <run_dir>/checkpoints, rotation
    logger = build_logger(cfg.logger, run_dir, total_steps=total, config=to_dict(cfg))
    resume_if_asked(trainer, cfg.ckpt)                           ckpt.resume: auto / none / path
    freeze_heap() ... thaw_heap()                                start-up frozen for the run's full collections

Only plain config components go in (never a whole command config), so every recipe calls the same code.
`resolve_device` (relayrl.models.loading) and `seed_everything` are the ONE device / seeding path (RL
workers use them too).
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from relayrl.config.base import ConfigError, default_instance, to_dict
from relayrl.config.components import CkptConfig, LoggerConfig, OptimConfig
from relayrl.training.checkpoint import CheckpointManager
from relayrl.training.logging import MetricsLogger
from relayrl.training.loop import Trainer
from relayrl.training.optim import build_optim, schedule_lr
from relayrl.training.precision import MasterWeights, resolve_precision
from relayrl.training.rng import seed_everything
from relayrl.training.run_lock import lock_run_dir, release_run_dir
from relayrl.training.step import LossFn, TrainStep

__all__ = [
    "build_checkpoint_manager",
    "build_logger",
    "build_train_step",
    "checkpoint_to_resume",
    "compute_precision",
    "freeze_heap",
    "holds_run",
    "release_run_dir",
    "resume_if_asked",
    "run_dir_of",
    "seed_everything",
    "thaw_heap",
    "total_steps_of",
]


def freeze_heap() -> None:
    """Collect, then move every object alive now into the garbage collector's permanent generation
    (`gc.freeze`), so the full collections of the run skip them. Called when a run has built what lives until
    it ends (the RL driver after its roles; in local mode that is every role; the one-model runner before its
    loop): the libraries, modules, tokenizer and datasets make ~0.4M tracked objects, and a full collection over
    them paused a step for 0.19-0.24 s on the 2-core CPU at 2,048 trajectories a step (0.002-0.005 s frozen;
    bench/gc_pause.py, docs/architecture.md "Garbage collection"). Collecting first keeps garbage out of the
    permanent generation. A frozen object is still freed by its reference count; only a frozen reference
    cycle dropped before `thaw_heap` waits for it (workers hold cycles: RoleState's bound method, MoE blocks),
    so every run that freezes thaws when it ends, and Ray ranks, whose workers drop models mid-run (DPO's
    reference after precompute), do not freeze."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Hand the frozen objects back to the collector and collect (`gc.unfreeze` + `gc.collect`): the end of a
    run that called `freeze_heap`, so its workers' reference cycles are freed before a next run in the same
    process (iterative DPO's rounds, the demo's phases, a script looping over runs)."""
    gc.unfreeze()
    gc.collect()


def compute_precision(model_dtype: str, device: torch.device) -> str:
    """The TrainStep precision for `model.dtype`: fp32 on CPU; on CUDA "fp32" keeps fp32 compute, anything
    else (auto, bf16, fp16) computes in bf16 autocast (fp16 autocast would need loss scaling). The trained
    weights and optimizer states are fp32 masters either way."""
    if device.type != "cuda" or model_dtype == "fp32":
        return "fp32"
    return resolve_precision("auto", device)


def holds_run(run_dir: Path) -> bool:
    """Whether `run_dir` holds a training run: metrics.jsonl or a checkpoint."""
    return run_dir.is_dir() and (
        (run_dir / "metrics.jsonl").is_file()
        or any(p.name.startswith(("step_", "latest")) for p in (run_dir / "checkpoints").glob("*"))
    )


def prepare_run_dir(run_dir: Path, ckpt: CkptConfig, prog: str) -> Path:
    """The run folder, ready for a run that starts per `ckpt.resume`: created when missing; an error naming
    the folder when it is a file, or when it holds another run (checkpoints or metrics) and this run does
    not continue it (resume none or a checkpoint path) -- unless ckpt.overwrite, which moves the old run aside
    to <folder>.old-<YYYYmmdd-HHMMSS> first. Two runs' metrics, samples and checkpoints are never mixed.

    The folder is locked for this process (relayrl.training.run_lock) before anything in it is read or moved:
    a folder another process is running in is refused (RunFolderBusy, naming its pid). The runner releases it
    at the end (`release_run_dir`); the process ending releases it too."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(
            f"train.output_dir {run_dir} is a file, not a folder; choose another --train.output_dir"
        )
    if run_dir.is_dir():
        lock_run_dir(run_dir, prog)
    if holds_run(run_dir) and ckpt.resume != "auto":
        if not ckpt.overwrite:
            raise ValueError(
                f"{prog}: {run_dir} already holds a run (checkpoints / metrics.jsonl) and --ckpt.resume "
                f"{ckpt.resume} starts another one there; continue it with --ckpt.resume auto, choose another "
                "--train.output_dir, or pass --ckpt.overwrite true to move the old run aside"
            )
        aside = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        release_run_dir(run_dir)  # the lock file moved with the old run
        print(f"{prog}: moved the previous run in {run_dir} aside to {aside}")
    run_dir.mkdir(parents=True, exist_ok=True)
    lock_run_dir(run_dir, prog)
    return run_dir


RESUMABLE_FIELDS = (
    "train.max_steps",
    "train.epochs",
    "train.log_every",
    "train.eval_every",
    "train.device",
    "train.output_dir",
    "eval.every",
    "ckpt.",
    "logger.",
    "dist.",
    "rollout.engine_copy",
)
"""Config fields (or prefixes) a run may change and still continue from its checkpoint: how long, how often,
where it runs and logs. Anything else changes what the run computes and needs a new run."""


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def check_config_change(run_dir: Path, cfg: Any, prog: str, *, updates_per_step: int = 1) -> list[str]:
    """Continuing a run (ckpt.resume auto with a checkpoint in `run_dir`): compare `cfg` with the run's saved
    config.yaml. Changes of RESUMABLE_FIELDS are listed and allowed (a run with another step total says how its
    learning-rate schedule changes: `schedule_change`); any other change is an error listing the fields and what
    to do. A field the saved config lacks (added to relayrl since) counts as its default. Returns the changes. `updates_per_step`: optimizer steps per run step (RL: epochs x mini-batches)."""
    saved_file = run_dir / "config.yaml"
    ckpts = run_dir / "checkpoints"
    if cfg.ckpt.resume != "auto" or not saved_file.is_file() or not (ckpts / "latest").is_file():
        return []
    try:
        saved = _flat(yaml.safe_load(saved_file.read_text()) or {})
    except yaml.YAMLError:
        return []
    now = _flat(to_dict(cfg))
    # a field added since the run was saved reads as its default there: a run folder from an older relayrl
    # continues as long as the new fields keep their defaults
    defaults = _flat(to_dict(default_instance(type(cfg))))
    changed = sorted(
        k for k in set(saved) | set(now) if saved.get(k, defaults.get(k)) != now.get(k, defaults.get(k))
    )
    if not changed:
        return []
    describe = [f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in changed]
    blocking = [d for k, d in zip(changed, describe, strict=True) if not k.startswith(RESUMABLE_FIELDS)]
    if blocking:
        raise ConfigError(
            f"{prog}: {run_dir} holds a run started with another config ({'; '.join(blocking)}); continuing it "
            "would mix two setups. Drop those flags to continue the run, or start a new one with another "
            "--train.output_dir (or --ckpt.resume none --ckpt.overwrite true to move this one aside)",
            field=changed[0],
        )
    print(f"{prog}: continuing the run in {run_dir} with changed settings: {'; '.join(describe)}")
    if "train.max_steps" in changed or "train.epochs" in changed:
        line = schedule_change(run_dir, saved, cfg, updates_per_step)
        if line:
            print(f"{prog}: {line}")
    return describe


def schedule_change(run_dir: Path, saved: dict[str, Any], cfg: Any, updates_per_step: int = 1) -> str | None:
    """One line saying how the learning-rate schedule changes when the run in `run_dir` (flat saved config
    `saved`) continues with `cfg`'s step total; None when the checkpoint already reached the new total.

    What happens (relayrl.training.optim): the schedule is rebuilt for the new total (warm-up by ratio and the
    decay span it) and the run continues from the checkpoint's step k, so steps 1..k keep the lr they had and
    step k+1 runs at the new schedule's lr for it (`Schedule.load_state_dict`)."""
    done, old_total = _checkpoint_progress(run_dir)
    if old_total is None and int(saved.get("train.max_steps") or 0) > 0:
        old_total = int(saved["train.max_steps"])
    new_total = _new_total(cfg.train, saved, old_total)
    if done is None or old_total is None or new_total is None:
        return (
            "the learning-rate schedule is recomputed for the new step total: warm-up and decay span it, and the "
            "run continues from the checkpoint's step at the new schedule's lr"
        )
    if new_total <= done:
        return None
    per = max(1, updates_per_step)
    old_lr = schedule_lr(cfg.optim, done * per, old_total * per)
    new_lr = schedule_lr(cfg.optim, done * per, new_total * per)
    how = "stretched" if new_total > old_total else "shortened"
    lr = f"changes from {old_lr:.4g} to {new_lr:.4g}" if new_lr != old_lr else f"stays {new_lr:.4g}"
    return (
        f"the learning-rate schedule is recomputed for {new_total} steps instead of {old_total} "
        f"({cfg.optim.scheduler}, {how}), continuing after step {done}: the lr at step {done + 1} {lr}"
    )


def _checkpoint_progress(run_dir: Path) -> tuple[int | None, int | None]:
    """(steps done, the run's step total then) from the latest checkpoint's trainer_state.json; None for what
    it does not say (total_steps is recorded since the schedule line needs it)."""
    ckpts = run_dir / "checkpoints"
    try:
        state = json.loads(
            (ckpts / (ckpts / "latest").read_text().strip() / "trainer_state.json").read_text()
        )
    except (OSError, ValueError):
        return None, None
    total = state.get("total_steps")
    return int(state["step"]) if "step" in state else None, int(total) if total else None


def _new_total(train: Any, saved: dict[str, Any], old_total: int | None) -> int | None:
    """The continued run's step total, where the config alone says it: train.max_steps when > 0; else (a total
    set by the data) the old total rescaled by train.epochs (same data and batch size, as they cannot change),
    or the old total for a run without epochs (RL: one pass over the same prompts)."""
    if train.max_steps > 0:
        return train.max_steps
    if old_total is None or int(saved.get("train.max_steps") or 0) > 0:
        return None
    epochs, old_epochs = getattr(train, "epochs", None), saved.get("train.epochs")
    if epochs is None:
        return old_total
    return old_total // old_epochs * epochs if old_epochs else None


def run_dir_of(train: Any, command: str) -> Path:
    """train.output_dir, or runs/<command> when empty."""
    return Path(train.output_dir or f"runs/{command}")


def total_steps_of(train: Any, num_samples: int) -> int:
    """train.max_steps when > 0 (wrapping over epochs as needed), else epochs x (num_samples // batch_size)."""
    if train.max_steps > 0:
        return train.max_steps
    return train.epochs * (num_samples // train.batch_size)


def build_checkpoint_manager(
    ckpt: CkptConfig, run_dir: Path, *, hf_format: bool | None = None
) -> CheckpointManager:
    """<run_dir>/checkpoints with the config's rotation (keep_last 0 = keep all). `hf_format`: overrides
    ckpt.save_hf_model (RL roles always write HF folders through their workers' own save)."""
    return CheckpointManager(
        run_dir / "checkpoints",
        keep_last=ckpt.keep_last if ckpt.keep_last > 0 else 10**9,
        keep_best=1 if ckpt.keep_best else 0,
        best_mode=ckpt.best_mode,
        hf_format=ckpt.save_hf_model if hf_format is None else hf_format,
    )


def build_logger(
    cfg: LoggerConfig,
    run_dir: Path,
    *,
    total_steps: int,
    config: dict[str, Any],
    start_step: int = 0,
    console: bool | None = None,
) -> MetricsLogger:
    """MetricsLogger from a LoggerConfig. `console`: print metric lines (default logger.progress_bar; RL
    draws its own progress line)."""
    return MetricsLogger(
        run_dir,
        total_steps=total_steps,
        tensorboard=cfg.tensorboard,
        wandb=cfg.wandb,
        wandb_project=cfg.wandb_project,
        wandb_run_name=cfg.wandb_run_name or run_dir.name,
        config=config,
        console=cfg.progress_bar if console is None else console,
        start_step=start_step,
    )


def build_train_step(
    model: torch.nn.Module,
    optim: OptimConfig,
    total_steps: int,
    loss_fn: LossFn | None = None,
    *,
    precision: str = "auto",
    device: torch.device | None = None,
    sharded: bool = False,
    defer_grad_sync: bool = False,
    keep_gathered: bool = False,
    reshard_after_forward: bool = True,
    replicate_grads: bool = False,
) -> TrainStep:
    """TrainStep from an OptimConfig: AdamW (fused on CUDA) + schedule + clipping, at `precision`. With
    "bf16" the module is converted to bf16 compute weights and the optimizer holds their fp32 masters;
    `sharded` (FSDP2, relayrl.distributed.fsdp): the sharded fp32 parameters are the masters and FSDP's
    mixed-precision policy casts them for compute, so no MasterWeights; `defer_grad_sync`, `keep_gathered` and
    `reshard_after_forward` (what the layers were sharded with) say how its micro-batches drive the FSDP2 units
    (relayrl.training.sharded); `replicate_grads` (dist.replicate: the whole model on every rank of a group)
    sums the gradients over the ranks once a step (relayrl.training.replicate)."""
    device = device if device is not None else next(model.parameters()).device
    precision = resolve_precision(precision, device)
    master = MasterWeights(model, torch.bfloat16) if precision == "bf16" and not sharded else None
    optimizer, scheduler = build_optim(master.named_params() if master else model, optim, total_steps)
    return TrainStep(
        master=master,
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        scheduler=scheduler,
        grad_clip=optim.max_grad_norm,
        precision=precision,
        device=device,
        defer_grad_sync=sharded and defer_grad_sync,
        keep_gathered=sharded and keep_gathered,
        reshard_after_forward=reshard_after_forward,
        replicate_grads=replicate_grads and not sharded,
    )


def checkpoint_to_resume(resume: str, ckpt: CheckpointManager) -> Path | None:
    """THE resume rule (recipes and RL), `ckpt.resume`: "none" -> None; "auto" -> the run folder's newest
    complete checkpoint (a damaged newer one is skipped with a warning), None when there is none; a path ->
    that checkpoint folder (an error naming the field when it is not one)."""
    if resume == "none":
        return None
    if resume == "auto":
        return ckpt.resumable()
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"ckpt.resume={resume!r} is not a checkpoint folder (no trainer_state.json)")
    return path


def resume_if_asked(trainer: Trainer, ckpt: CkptConfig) -> bool:
    """Resume `trainer` per ckpt.resume (`checkpoint_to_resume`); True when it resumed."""
    if trainer.ckpt is None:
        return False
    path = checkpoint_to_resume(ckpt.resume, trainer.ckpt)
    return path is not None and trainer.resume(path)
