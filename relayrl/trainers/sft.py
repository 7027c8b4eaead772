"""`relayrl sft`: supervised fine-tuning on the shared training-loop core.

    SFTConfig(model, data, optim, train, ckpt, logger, mode)
      -> build_sft_data(data, tokenizer, mode)        relayrl.data.build: TokenizedSample(input_ids, loss_mask)
      -> make_sft_collate(...)                        step indices -> micro-batches (packed or padded TokenBatch,
                                                      labels shifted *within* each sample)
      -> Trainer(TrainEngine(loss_fn=next_token_loss), ResumableSampler, CheckpointManager, MetricsLogger).fit()
         (the parts built from the component configs by trainers/setup.py, shared with RM / DPO / KTO)

Modes (masks are built by the data layer): response (loss on the response only, default), multiturn (loss on
every assistant turn), pretrain (every token). The loss is token-level cross-entropy summed over the target
tokens of the whole optimizer step divided by their count (see trainers/core.py), so micro-batch size and
packing do not change the update.

Run folder (train.output_dir, default runs/sft): config.yaml (fully resolved), metrics.jsonl,
tensorboard/ (when asked), checkpoints/step_<N>/ (model/ is an HF folder), checkpoints/latest.

Programmatic use (the demo): `result = run_sft(cfg)`; `result.model`, `result.metrics`, `result.run_dir`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from relayrl.config.base import check_choices, run_command, save_yaml, to_dict
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from relayrl.data.packing import IGNORE_INDEX, TokenBatch, chunk_by_count, pack, pad, plan_token_budget
from relayrl.data.packing import shift_for_next_token as shift
from relayrl.trainers.core import LoopSettings, LossOutput, ResumableSampler, Trainer
from relayrl.trainers.setup import (
    build_checkpoint_manager,
    build_engine,
    build_logger,
    resolve_device,
    resume_if_asked,
    run_dir_of,
    seed_everything,
    total_steps_of,
)


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    """Supervised fine-tuning."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to fine-tune (and its tokenizer)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training / eval data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpoints and resume."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics sinks."""
    mode: Literal["response", "multiturn", "pretrain"] = "response"
    """Which tokens carry loss: response (the answer only), multiturn (every assistant turn), pretrain (all)."""

    def __post_init__(self) -> None:
        check_choices(self)


@dataclass(kw_only=True, slots=True)
class SFTResult:
    """What `run_sft` returns."""

    model: Any
    """The trained model (in memory, on the training device)."""
    tokenizer: Any
    """Its tokenizer."""
    run_dir: Path
    """The run folder (config.yaml, metrics.jsonl, checkpoints/)."""
    metrics: dict[str, float]
    """The last logged metrics row (train/loss, eval/loss when evaluated, ...)."""
    history: list[dict[str, float]]
    """Every metrics row of this process."""
    checkpoint: Path | None
    """The last checkpoint folder written (its `model/` sub-folder loads with from_pretrained)."""


# ---------------------------------------------------------------------------------------------- loss
def next_token_loss(model: torch.nn.Module, batch: TokenBatch) -> LossOutput:
    """Summed token cross-entropy over positions whose `labels` field is not IGNORE_INDEX.

    loss_sum = sum_t -log p(labels_t | tokens <= t of the same sample); count = number of such t. Metric
    token_acc (a sum; the core divides by the step's count) = argmax hits.
    """
    logits = model(**batch.model_inputs()).logits
    labels = batch.fields["labels"]
    keep = labels != IGNORE_INDEX
    picked = logits[keep].float()
    targets = labels[keep]
    loss_sum = F.cross_entropy(picked, targets, reduction="sum")
    hits = float((picked.argmax(-1) == targets).sum()) if targets.numel() else 0.0
    return LossOutput(loss_sum=loss_sum, count=int(keep.sum()), metrics={"token_acc": hits})


# ---------------------------------------------------------------------------------------------- batching
def sft_micro_batches(
    samples: Sequence[Any],
    *,
    packing: bool,
    pad_id: int,
    micro_batch_size: int = 1,
    max_tokens_per_micro_batch: int = 0,
) -> list[TokenBatch]:
    """One optimizer step's samples (objects with input_ids, loss_mask) -> micro-batches.

    Split by token budget (first-fit-decreasing) when max_tokens_per_micro_batch > 0, else into chunks of
    micro_batch_size. Each group is one forward pass: packed into rows no longer than its longest sample
    (packing: little padding, attention cost of the padded layout) or right-padded, one row per sample.
    """
    lengths = [len(s.input_ids) for s in samples]
    if max_tokens_per_micro_batch > 0:
        groups = plan_token_budget(lengths, max_tokens_per_micro_batch)
    else:
        groups = chunk_by_count(len(samples), micro_batch_size)
    out = []
    for group in groups:
        seqs = [list(samples[i].input_ids) for i in group]
        labels = {"labels": [shift(samples[i].input_ids, samples[i].loss_mask) for i in group]}
        pads = {"labels": IGNORE_INDEX}
        if packing:
            row_len = max(len(s) for s in seqs)
            out.append(pack(seqs, labels, pad_id=pad_id, pad_values=pads, row_len=row_len))
        else:
            out.append(pad(seqs, labels, pad_id=pad_id, pad_values=pads))
    return out


def make_sft_collate(samples: Sequence[Any], cfg: TrainConfig, pad_id: int) -> Callable[[list[int]], list]:
    """indices -> micro-batches, per the train config (packing, micro_batch_size, token budget)."""

    def collate(indices: list[int]) -> list[TokenBatch]:
        return sft_micro_batches(
            [samples[i] for i in indices],
            packing=cfg.packing,
            pad_id=pad_id,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        )

    return collate


def eval_batches_fn(samples: Sequence[Any], cfg: TrainConfig, pad_id: int) -> Callable[[], list[list]]:
    """Every eval sample once, in order, batched like training."""
    step = cfg.batch_size

    def batches() -> list[list[TokenBatch]]:
        collate = make_sft_collate(samples, cfg, pad_id)
        return [collate(list(range(i, min(len(samples), i + step)))) for i in range(0, len(samples), step)]

    return batches


# ---------------------------------------------------------------------------------------------- run
def _load_data(cfg: SFTConfig, tokenizer: Any) -> tuple[list, list]:
    from relayrl.data.build import build_sft_data

    train, evals, _ = build_sft_data(cfg.data, tokenizer, cfg.mode)
    return train, evals


def run_sft(cfg: SFTConfig) -> SFTResult:
    """Train per `cfg`; writes the run folder; returns the model, metrics and paths."""
    from relayrl.models.loading import load_model_and_tokenizer

    device = resolve_device(cfg.train.device)
    seed_everything(cfg.train.seed)
    run_dir = run_dir_of(cfg.train, "sft")
    run_dir.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, run_dir / "config.yaml")
    model, tokenizer = load_model_and_tokenizer(cfg.model, device=device)
    train_samples, eval_samples = _load_data(cfg, tokenizer)
    total = total_steps_of(cfg.train, len(train_samples))
    if total <= 0:
        raise ValueError(
            f"no optimizer step to run: {len(train_samples)} training samples < train.batch_size "
            f"{cfg.train.batch_size}; lower train.batch_size or set train.max_steps"
        )
    pad_id = tokenizer.pad_token_id
    engine = build_engine(model, cfg.optim, total, device, next_token_loss)
    trainer = Trainer(
        engine=engine,
        sampler=ResumableSampler(len(train_samples), cfg.train.batch_size, seed=cfg.train.seed),
        collate=make_sft_collate(train_samples, cfg.train, pad_id),
        settings=LoopSettings(
            total_steps=total,
            eval_every=cfg.train.eval_every,
            save_every=cfg.ckpt.save_every,
            best_metric=cfg.ckpt.best_metric,
            log_every=cfg.train.log_every,
        ),
        ckpt=build_checkpoint_manager(cfg.ckpt, run_dir),
        eval_batches=eval_batches_fn(eval_samples, cfg.train, pad_id) if eval_samples else None,
        tokenizer=tokenizer,
    )
    resumed = resume_if_asked(trainer, cfg.ckpt)
    with build_logger(
        cfg.logger, run_dir, total_steps=total, config=to_dict(cfg), start_step=trainer.step
    ) as logger:
        trainer.logger = logger
        if resumed:
            print(f"resumed from step {trainer.step} ({run_dir / 'checkpoints'})")
        result = trainer.fit()
    last = result.history[-1] if result.history else {}
    return SFTResult(
        model=model,
        tokenizer=tokenizer,
        run_dir=run_dir,
        metrics=last,
        history=result.history,
        checkpoint=result.last_checkpoint,
    )


def main(argv: list[str] | None = None) -> int:
    """`relayrl sft [--config run.yaml] [--dotted.flags ...]`."""

    def go(cfg: SFTConfig) -> int:
        result = run_sft(cfg)
        loss = result.metrics.get("train/loss", float("nan"))
        eval_loss = result.metrics.get("eval/loss")
        tail = f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""
        print(
            f"sft done: {result.metrics.get('step', 0)} steps, train loss {loss:.4f}{tail}; run folder {result.run_dir}"
        )
        return 0

    return run_command(SFTConfig, argv, "relayrl sft", go, description=__doc__.split("\n")[0])
