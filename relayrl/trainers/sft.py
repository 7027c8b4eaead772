"""`relayrl sft`: supervised fine-tuning, a recipe on the shared training core (relayrl/training).

    SFTConfig(model, data, optim, train, ckpt, logger, mode)
      -> build_sft_data(data, tokenizer, mode)        relayrl.data.build: TokenizedSample(input_ids, loss_mask)
      -> make_sft_collate(...)                        step indices -> micro-batches (SFTBatch: the samples'
                                                      token ids + target masks, grouped by token budget or count)
      -> Trainer(TrainStep(loss_fn=next_token_loss), ResumableSampler, CheckpointManager, MetricsLogger).fit()
         (the parts built from the component configs by training/setup.py, shared with RM / DPO / KTO)

Forward passes go through relayrl.models.forward: on a GPU the micro-batch's samples are packed into one
row and attention runs per sample with variable-length (cu_seqlens) kernels; on a CPU they run as
length-bucketed, right-padded rows with plain causal attention (no dense mask in either case). Log-probs
come from the chunked LM-head path (no [N, V] fp32 logits).

Modes (masks are built by the data layer): response (loss on the response only, default), multiturn (loss on
every assistant turn), pretrain (every token). The loss is token-level cross-entropy summed over the target
tokens of the whole optimizer step divided by their count (training/step.py), so micro-batch size and the
layout do not change the update.

Run folder (train.output_dir, default runs/sft): config.yaml (fully resolved), metrics.jsonl,
tensorboard/ (when asked), checkpoints/step_<N>/ (model/ is an HF folder), checkpoints/latest.

Programmatic use (the demo): `result = run_sft(cfg)`; `result.model`, `result.metrics`, `result.run_dir`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from relayrl.config.base import check_choices, run_command, save_yaml, to_dict
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    DataParallelConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from relayrl.data.packing import chunk_by_count
from relayrl.training.loop import LoopSettings
from relayrl.training.sampler import ResumableSampler
from relayrl.training.setup import (
    build_checkpoint_manager,
    build_logger,
    check_config_change,
    prepare_run_dir,
    resume_if_asked,
    run_dir_of,
    seed_everything,
    total_steps_of,
)
from relayrl.training.signals import SignalFlag
from relayrl.training.step import LossOutput


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
    dist: DataParallelConfig = field(default_factory=DataParallelConfig)
    """Data parallelism: one process, or Ray ranks with FSDP2 shards."""

    def __post_init__(self) -> None:
        check_choices(self)


@dataclass(kw_only=True, slots=True)
class SFTResult:
    """What `run_sft` returns."""

    model: Any
    """The trained model (in memory, on the training device); None with dist.mode=ray (see final_model)."""
    tokenizer: Any
    """Its tokenizer."""
    run_dir: Path
    """The run folder (config.yaml, metrics.jsonl, checkpoints/)."""
    metrics: dict[str, float]
    """The last logged metrics row (train/loss, eval/loss when evaluated, ...)."""
    history: list[dict[str, float]]
    """Every metrics row of this process."""
    checkpoint: Path | None
    """The last checkpoint folder written (its `model/` sub-folder loads with from_pretrained on one rank;
    on N ranks it holds DCP shards: use `final_model`)."""
    final_model: Path | None = None
    """The HF folder of the trained model (<run folder>/final; on N ranks exported by rank 0); None when the
    run was stopped by a signal (its last checkpoint holds the state)."""
    exit_code: int = 0
    """0 done; 130 / 143 stopped by SIGINT / SIGTERM after writing a checkpoint."""
    steps: int = 0
    """Optimizer steps completed (including those of a resumed run)."""
    already_complete: bool = False
    """The run folder's checkpoint had already reached the step total: nothing was trained."""


# ---------------------------------------------------------------------------------------------- loss
@dataclass(kw_only=True, slots=True)
class SFTBatch:
    """One micro-batch: the samples of one forward pass."""

    input_ids: list[torch.Tensor]
    """Per sample, [L_i] int64 token ids."""
    targets: list[torch.Tensor]
    """Per sample, [L_i] bool: token t carries loss (it is predicted from tokens < t; position 0 never)."""
    layout: str = "padded"
    """Attention layout of the forward (relayrl.models.forward.LAYOUTS)."""
    num_tokens: int = 0
    """Real tokens in the micro-batch."""


def next_token_loss(model: torch.nn.Module, batch: SFTBatch) -> LossOutput:
    """Summed token cross-entropy: loss_sum = sum over target tokens t of -log p(x_t | x_<t of the same
    sample); count = number of target tokens."""
    from relayrl.models.forward import to_device, token_logprobs

    logp, _ = token_logprobs(model, batch.input_ids, batch.layout)
    mask = torch.cat(batch.targets)
    mask[torch.tensor(_first_positions(batch.input_ids))] = False
    mask = to_device(mask, logp.device)
    loss_sum = -torch.where(mask, logp, 0.0).sum()
    return LossOutput(loss_sum=loss_sum, count=mask.sum().float())


def _first_positions(seqs: Sequence[torch.Tensor]) -> list[int]:
    starts, at = [], 0
    for s in seqs:
        starts.append(at)
        at += len(s)
    return starts


# ---------------------------------------------------------------------------------------------- batching
def sft_micro_batches(
    samples: Sequence[Any],
    *,
    layout: str,
    packing: bool,
    micro_batch_size: int = 1,
    max_tokens_per_micro_batch: int = 0,
) -> list[SFTBatch]:
    """One optimizer step's samples (objects with input_ids, loss_mask) -> micro-batches.

    packing with a token budget (max_tokens_per_micro_batch > 0): samples grouped by
    relayrl.models.forward.plan_micro_batches (real tokens per GPU varlen pack; padded tokens per CPU
    length bucket); otherwise consecutive chunks of micro_batch_size samples.
    """
    from relayrl.models.forward import plan_micro_batches

    lengths = [len(s.input_ids) for s in samples]
    if packing and max_tokens_per_micro_batch > 0:
        groups = plan_micro_batches(lengths, max_tokens_per_micro_batch, layout)
    else:
        groups = chunk_by_count(len(samples), micro_batch_size)
    return [
        SFTBatch(
            input_ids=[torch.as_tensor(list(samples[i].input_ids), dtype=torch.long) for i in g],
            targets=[torch.as_tensor(list(samples[i].loss_mask), dtype=torch.bool) for i in g],
            layout=layout,
            num_tokens=sum(lengths[i] for i in g),
        )
        for g in groups
    ]


def make_sft_collate(samples: Sequence[Any], cfg: TrainConfig, layout: str) -> Callable[[list[int]], list]:
    """indices -> micro-batches, per the train config (packing, micro_batch_size, token budget)."""

    def collate(indices: list[int]) -> list[SFTBatch]:
        return sft_micro_batches(
            [samples[i] for i in indices],
            layout=layout,
            packing=cfg.packing,
            micro_batch_size=cfg.micro_batch_size,
            max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        )

    return collate


def eval_batches_fn(samples: Sequence[Any], cfg: TrainConfig, layout: str) -> Callable[[], list[list]]:
    """Every eval sample once, in order, batched like training."""
    step = cfg.batch_size

    def batches() -> list[list[SFTBatch]]:
        collate = make_sft_collate(samples, cfg, layout)
        return [collate(list(range(i, min(len(samples), i + step)))) for i in range(0, len(samples), step)]

    return batches


# ---------------------------------------------------------------------------------------------- run
def _load_data(cfg: SFTConfig, tokenizer: Any) -> tuple[list, list]:
    from relayrl.data.build import build_sft_data

    train, evals, _ = build_sft_data(cfg.data, tokenizer, cfg.mode)
    return train, evals


def _settings(cfg: SFTConfig, total: int) -> LoopSettings:
    return LoopSettings(
        total_steps=total,
        eval_every=cfg.train.eval_every,
        save_every=cfg.ckpt.save_every,
        best_metric=cfg.ckpt.best_metric,
        log_every=cfg.train.log_every,
    )


def _total_steps(cfg: SFTConfig, num_samples: int) -> int:
    total = total_steps_of(cfg.train, num_samples)
    if total <= 0:
        raise ValueError(
            f"no optimizer step to run: {num_samples} training samples < train.batch_size "
            f"{cfg.train.batch_size}; lower train.batch_size or set train.max_steps"
        )
    return total


def _model_role(cfg: SFTConfig, launcher: Any, dist: Any, total: int, run_dir: Path) -> tuple[Any, str]:
    """Spawn the model role (ModelWorker with the SFT loss) and print the start-up banner; returns (handle,
    attention layout the collate must build)."""
    from relayrl.workers.trained import ModelSpec, ModelWorker

    m = cfg.model
    spec = ModelSpec(
        model=m,
        optim=cfg.optim,
        total_steps=total,
        loss_fn=next_token_loss,
        seed=cfg.train.seed,
        device=cfg.train.device,
        dist=dist,
        hf_format=cfg.ckpt.save_hf_model,
    )
    handle = launcher.spawn("model", ModelWorker, spec)
    info = handle.call("info")
    print(
        f"relayrl sft: {cfg.mode} loss on {m.name_or_path} ({info['params'] / 1e6:.1f}M params, "
        f"{info['precision']}, {info['layout']} attention), {info['ranks']} rank(s), {total} steps of "
        f"{cfg.train.batch_size} samples; run folder {run_dir}",
        flush=True,
    )
    return handle, info["layout"]


def run_sft(cfg: SFTConfig) -> SFTResult:
    """Train per `cfg`; writes the run folder; returns the model, metrics and paths.

    One code path for one process and for N ranks: this process reads the data and runs the loop (sampler,
    eval cadence, logging, checkpoints: relayrl.training.loop via RemoteTrainer); the model lives in a
    ModelWorker role (relayrl.workers.trained), in this process (dist.mode=local) or as
    `dist.num_nodes x dist.num_gpus_per_node` Ray ranks holding FSDP2 shards (dist.mode=ray). Each optimizer
    step's micro-batches go to the role; each rank trains on its share, gradients are reduced over all
    ranks and the loss is normalised by the global target-token count, so the update equals the
    one-process update on the same global batch. With N ranks the model is also exported to <run>/final."""
    from relayrl.config.rl import DistConfig
    from relayrl.distributed.launch import build_launcher
    from relayrl.models.loading import load_tokenizer
    from relayrl.workers.trained import RemoteTrainer

    d = cfg.dist
    seed_everything(cfg.train.seed)
    run_dir = prepare_run_dir(run_dir_of(cfg.train, "sft"), cfg.ckpt, "relayrl sft")
    check_config_change(run_dir, cfg, "relayrl sft")
    save_yaml(cfg, run_dir / "config.yaml")
    m = cfg.model
    tokenizer = load_tokenizer(
        m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
    )
    train_samples, eval_samples = _load_data(cfg, tokenizer)
    total = _total_steps(cfg, len(train_samples))
    dist = DistConfig.for_one_model(d)
    launcher = build_launcher(dist, {"model": d.ranks})
    try:
        handle, layout = _model_role(cfg, launcher, dist, total, run_dir)
        trainer = RemoteTrainer(
            handle,
            sampler=ResumableSampler(len(train_samples), cfg.train.batch_size, seed=cfg.train.seed),
            collate=make_sft_collate(train_samples, cfg.train, layout),
            settings=_settings(cfg, total),
            ckpt=build_checkpoint_manager(cfg.ckpt, run_dir),
            eval_batches=eval_batches_fn(eval_samples, cfg.train, layout) if eval_samples else None,
            tokenizer=tokenizer,
        )
        resumed = resume_if_asked(trainer, cfg.ckpt)
        done_before = resumed and trainer.step >= total
        stop = SignalFlag("relayrl sft")
        with (
            build_logger(
                cfg.logger, run_dir, total_steps=total, config=to_dict(cfg), start_step=trainer.step
            ) as logger,
            stop.installed(),
        ):
            trainer.logger = logger
            if resumed:
                print(f"resumed from step {trainer.step} ({run_dir / 'checkpoints'})")
            fit = trainer.fit(stop)
        final = None
        if fit.stopped_by is None:
            final = Path(handle.call("export", str(run_dir / "final")))
        local = getattr(handle, "instance", None)
    finally:
        launcher.shutdown()
    return SFTResult(
        model=local.model if local is not None else None,
        tokenizer=tokenizer,
        run_dir=run_dir,
        metrics=fit.history[-1] if fit.history else {},
        history=fit.history,
        checkpoint=fit.last_checkpoint,
        final_model=final,
        exit_code=stop.exit_code(),
        steps=trainer.step,
        already_complete=done_before,
    )


def main(argv: list[str] | None = None) -> int:
    """`relayrl sft [--config run.yaml] [--dotted.flags ...]`."""

    def go(cfg: SFTConfig) -> int:
        result = run_sft(cfg)
        if result.exit_code:
            print(
                f"relayrl sft: stopped at step {result.steps} by a signal; checkpoint {result.checkpoint}. "
                "Rerun the same command to continue.",
                file=sys.stderr,
            )
            return result.exit_code
        if result.already_complete:
            print(
                f"relayrl sft: already complete at step {result.steps} (the run's step total); raise "
                f"--train.max_steps (or --train.epochs) to continue; final model in {result.final_model}"
            )
            return 0
        loss = result.metrics.get("train/loss", float("nan"))
        eval_loss = result.metrics.get("eval/loss")
        tail = f", eval loss {eval_loss:.4f}" if eval_loss is not None else ""
        print(
            f"sft done: {result.metrics.get('step', 0)} steps, train loss {loss:.4f}{tail}; run folder {result.run_dir}"
        )
        print(f"relayrl sft: final model in {result.final_model}")
        return 0

    return run_command(SFTConfig, argv, "relayrl sft", go, description=__doc__.split("\n")[0])
