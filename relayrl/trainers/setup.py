"""Recipe set-up shared by SFT, RM, DPO and KTO: component configs -> the training-loop core's parts.

    device = resolve_device(cfg.train.device); seed_everything(cfg.train.seed)
    run_dir = run_dir_of(cfg.train, "sft")                       train.output_dir or runs/<command>
    total = total_steps_of(cfg.train, len(train_samples))
    engine = build_engine(model, cfg.optim, total, device, loss_fn)   AdamW + schedule + clipping
    ckpt = build_checkpoint_manager(cfg.ckpt, run_dir)           <run_dir>/checkpoints, rotation
    logger = build_logger(cfg.logger, run_dir, total_steps=total, config=to_dict(cfg))
    resume_if_asked(trainer, cfg.ckpt)                           ckpt.resume: auto / none / path

Only plain config components go in (never a whole command config), so every recipe calls the same code.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relayrl.config.components import CkptConfig, LoggerConfig, OptimConfig, TrainConfig
from relayrl.trainers.checkpoint import CheckpointManager
from relayrl.trainers.core import LossFn, TrainEngine, Trainer, build_optimizer, build_scheduler
from relayrl.trainers.logging import MetricsLogger


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when available else cpu; "cuda" without a GPU is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "train.device=cuda but no CUDA device is available; use --train.device cpu or auto"
        )
    return torch.device(name)


def run_dir_of(train: TrainConfig, command: str) -> Path:
    """train.output_dir, or runs/<command> when empty."""
    return Path(train.output_dir or f"runs/{command}")


def total_steps_of(train: TrainConfig, num_samples: int) -> int:
    """train.max_steps when > 0 (wrapping over epochs as needed), else epochs x (num_samples // batch_size)."""
    if train.max_steps > 0:
        return train.max_steps
    return train.epochs * (num_samples // train.batch_size)


def build_checkpoint_manager(ckpt: CkptConfig, run_dir: Path) -> CheckpointManager:
    """<run_dir>/checkpoints with the config's rotation (keep_last 0 = keep all)."""
    return CheckpointManager(
        run_dir / "checkpoints",
        keep_last=ckpt.keep_last if ckpt.keep_last > 0 else 10**9,
        keep_best=1 if ckpt.keep_best else 0,
        best_mode=ckpt.best_mode,
        hf_format=ckpt.save_hf_model,
    )


def build_logger(
    cfg: LoggerConfig, run_dir: Path, *, total_steps: int, config: dict[str, Any], start_step: int = 0
) -> MetricsLogger:
    """MetricsLogger from a LoggerConfig."""
    return MetricsLogger(
        run_dir,
        total_steps=total_steps,
        tensorboard=cfg.tensorboard,
        wandb=cfg.wandb,
        wandb_project=cfg.wandb_project,
        wandb_run_name=cfg.wandb_run_name or run_dir.name,
        config=config,
        console=cfg.progress_bar,
        start_step=start_step,
    )


def build_engine(
    model: torch.nn.Module, optim: OptimConfig, total_steps: int, device: torch.device, loss_fn: LossFn
) -> TrainEngine:
    """TrainEngine from an OptimConfig (AdamW + schedule + clipping); precision auto (bf16 autocast on GPU)."""
    o = optim
    optimizer = build_optimizer(
        model, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.adam_betas), eps=o.eps
    )
    scheduler = build_scheduler(
        optimizer,
        total_steps=total_steps,
        warmup_steps=o.warmup_steps,
        warmup_ratio=o.warmup_ratio,
        schedule=o.scheduler,
        min_lr_ratio=o.min_lr_ratio,
    )
    return TrainEngine(
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        scheduler=scheduler,
        grad_clip=o.max_grad_norm,
        device=device,
    )


def resume_if_asked(trainer: Trainer, ckpt: CkptConfig) -> bool:
    """ckpt.resume: auto (latest in the run folder if any), none, or a checkpoint folder path."""
    if ckpt.resume == "none":
        return False
    if ckpt.resume == "auto":
        return trainer.resume()
    path = Path(ckpt.resume)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(
            f"ckpt.resume={ckpt.resume!r} is not a checkpoint folder (no trainer_state.json)"
        )
    return trainer.resume(path)
