"""The one-model recipe runner: what SFT, reward models, PRM, DPO, KTO and KD share. A recipe is a loss, a data
builder and a few lines; everything else (run folder, config check, data parallelism, loop, checkpoints,
exact resume, signals, logging, final export) is this file plus relayrl/training.

    recipe = Recipe(name="dpo", cfg=cfg, loss_fn=dpo_loss, load_data=..., to_batch=..., frozen=..., prepare=...)
    result = run_recipe(recipe)          -> RecipeResult(model, tokenizer, run_dir, metrics, final_model, ...)

`cfg` is the command's config: it has model, data, optim, train, ckpt, logger and dist (DistConfig)
sections, plus the recipe's own. The data builder returns typed samples with a `num_tokens` property;
`to_batch(samples, layout)` turns one micro-batch's samples into the loss's batch record. Micro-batches are
planned per optimizer step from the samples' token counts (train.packing with
train.max_tokens_per_micro_batch, else train.micro_batch_size samples each) by relayrl.data.packing.

Hooks: `before_fit(handle, train, evals, layout)` runs after the model role exists and before the loop (DPO
precomputes reference log-probs there); `after_fit(handle, result)` after the final export (the reward model
writes its reward statistics there).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.config.base import ConfigError, save_yaml, to_dict
from relayrl.config.command_line import run_command
from relayrl.config.components import ModelConfig, OneModelConfig
from relayrl.config.dist import DistConfig
from relayrl.data.packing import chunk_by_count, count_ranges, make_collate
from relayrl.distributed.group import shares
from relayrl.distributed.launch import build_launcher
from relayrl.distributed.launch.base import Launcher, RoleHandle
from relayrl.distributed.launch.local import LocalRole
from relayrl.distributed.launch.rows import StoredItems
from relayrl.models.loading import load_tokenizer
from relayrl.training.checkpoint import CheckpointManager, LoadedCheckpoint, timed_write
from relayrl.training.loop import FitResult, LoopSettings, ModelParts, Trainer
from relayrl.training.sampler import ResumableSampler
from relayrl.training.setup import (
    build_checkpoint_manager,
    build_logger,
    check_config_change,
    freeze_heap,
    prepare_run_dir,
    release_run_dir,
    resume_if_asked,
    run_dir_of,
    seed_everything,
    thaw_heap,
    total_steps_of,
)
from relayrl.training.signals import SignalFlag
from relayrl.training.step import LossFn, StepOutput
from relayrl.workers.base import Items
from relayrl.workers.proxies import WorkerFolder
from relayrl.workers.trained import ModelSpec, ModelWorker


@dataclass(kw_only=True, slots=True)
class Recipe:
    """One one-model training recipe (see module doc)."""

    name: str
    """Command name ("sft", "rm", "dpo", ...): the run folder default runs/<name> and message prefix."""
    cfg: OneModelConfig
    """The command's config (model, data, optim, train, ckpt, logger, dist + the recipe's section)."""
    loss_fn: LossFn
    """The loss (module-level: it travels to Ray ranks by reference)."""
    load_data: Callable[[Any], tuple[list, list]]
    """tokenizer -> (train samples, eval samples); prints the data summary."""
    to_batch: Callable[[list[Any], str], Any]
    """(one micro-batch's samples, layout) -> the loss's batch record (with num_tokens)."""
    describe: str = ""
    """What is trained, for the start-up banner (e.g. "dpo, beta 0.1")."""
    head: str = "lm"
    """"lm" causal LM, "value" value-head model (relayrl.workers.trained.ModelSpec.head)."""
    frozen: ModelConfig | None = None
    """Reference / teacher model."""
    prepare: Callable[..., None] | None = None
    """Fills micro-batches from the frozen model before the loss (ModelSpec.prepare)."""
    before_fit: Callable[..., None] | None = None
    """(handle, train, evals, layout) -> None, before the loop."""
    after_fit: Callable[..., object] | None = None
    """(handle, result: RecipeResult) -> None, after the export (not after a signal stop)."""
    collate: Callable[..., Callable[[list[int]], list[Any]]] | None = None
    """(samples, train config, layout) -> collate, when micro-batches need the whole step (KTO pairs each
    sample with another of the step); default make_collate(samples, train, layout, to_batch)."""


@dataclass(kw_only=True, slots=True)
class RecipeResult:
    """What `run_recipe` returns."""

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
    train_samples: list[Any] | None = None
    """The training samples (for after_fit hooks)."""
    layout: str = "padded"
    """The attention layout the micro-batches were built for (for after_fit hooks)."""


# ---------------------------------------------------------------------------------------------- batching
def _collate(
    recipe: Recipe, samples: Sequence[Any], layout: str, parts: int = 1
) -> Callable[[list[int]], list[Any]]:
    """The step collate; `parts` data-parallel ranks: with a token budget each rank's micro-batches are packed
    from its token-balanced share of the step (relayrl.data.packing.make_collate -> RankBatches)."""
    if recipe.collate is not None:
        return recipe.collate(samples, recipe.cfg.train, layout)
    return make_collate(samples, recipe.cfg.train, layout, recipe.to_batch, parts=parts)


class TimedCollate:
    """A collate that keeps how long its last call took (the driver's packing time, `timing/pack_s`)."""

    def __init__(self, collate: Callable[[list[int]], list[Any]]) -> None:
        self.collate = collate
        self.last_s = 0.0

    def __call__(self, indices: list[int]) -> list[Any]:
        t0 = time.perf_counter()
        out = self.collate(indices)
        self.last_s = time.perf_counter() - t0
        return out


def rank_loads(micro_batches: Sequence[Any], parts: int) -> dict[str, float]:
    """Per-step balance metrics over `parts` data-parallel ranks: real tokens of the busiest and the idlest
    rank, the most micro-batches (forward + backward passes) a rank runs, and the most tokens a rank runs
    counting its padding passes (a rank short of passes re-runs its last micro-batch with weight 0)."""
    tokens = [int(getattr(m, "num_tokens", 0)) for m in micro_batches]
    counts = getattr(micro_batches, "counts", None)
    if counts is None:
        ranges = shares([getattr(m, "num_tokens", 1) for m in micro_batches], parts)
    else:
        ranges = count_ranges(counts)
    passes = max((len(r) for r in ranges), default=0)
    real = [sum(tokens[i] for i in r) for r in ranges]
    run = [t + (passes - len(r)) * tokens[r[-1] if len(r) else 0] for t, r in zip(real, ranges, strict=True)]
    return {
        "perf/rank_tokens_max": float(max(real, default=0)),
        "perf/rank_tokens_min": float(min(real, default=0)),
        "perf/rank_passes_max": float(passes),
        "perf/rank_run_tokens_max": float(max(run, default=0)),
    }


def _eval_batches(recipe: Recipe, samples: Sequence[Any], layout: str) -> Callable[[], list[list[Any]]]:
    """Every eval sample once, in order, batched like training."""
    collate = _collate(recipe, samples, layout)
    return lambda: [collate(c) for c in chunk_by_count(len(samples), recipe.cfg.train.batch_size)]


# ---------------------------------------------------------------------------------------------- driver side
class RemoteStep:
    """The loop's step runner for a ModelWorker role: step / evaluate run on the role's ranks. With `stored`
    (ray mode) each call's micro-batches go into Ray's object store one per object, serialised once, and
    each rank fetches only its share (relayrl.distributed.launch.rows.StoredItems); else the list itself."""

    def __init__(
        self,
        handle: RoleHandle[ModelWorker],
        stored: bool = False,
        parts: int = 1,
        collate: TimedCollate | None = None,
    ) -> None:
        self.handle = handle
        self.stored = stored
        self.parts = parts
        """Data-parallel ranks of the role (for the per-rank balance metrics)."""
        self.collate = collate
        """The loop's collate, when timed: its last call's time is the step's timing/pack_s."""
        self.nonfinite_total = 0

    def _items(self, micro_batches: list[Any]) -> list[Any] | Items[Any]:
        return StoredItems(micro_batches) if self.stored else micro_batches

    def step(self, micro_batches: list[Any]) -> StepOutput:
        """One step on the role; adds timing/pack_s (the driver's collate) and the rank_loads metrics."""
        loads = rank_loads(micro_batches, self.parts)
        counts = getattr(micro_batches, "counts", None)
        t0 = time.perf_counter()
        items = self._items(micro_batches)
        put_s = time.perf_counter() - t0
        out, self.nonfinite_total = self.handle.call(ModelWorker.step, items, counts)
        out.metrics.update(loads)
        out.metrics["timing/put_s"] = put_s
        if self.collate is not None:
            out.metrics["timing/pack_s"] = self.collate.last_s
        return out

    def evaluate(self, batches: Iterable[Sequence[Any]]) -> dict[str, float]:
        if self.stored:
            return self.handle.call(ModelWorker.evaluate, self._items([mb for b in batches for mb in b]))
        return self.handle.call(ModelWorker.evaluate, [list(b) for b in batches])

    def full_precision(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the workers save and load their exact weights themselves


class RoleModelState:
    """The loop's checkpoint face of a ModelWorker role: the checkpoint's model/ folder is the workers' own
    save (WorkerFolder), and they load it themselves."""

    def __init__(self, handle: RoleHandle[ModelWorker]) -> None:
        self.handle = handle

    def saved(self) -> ModelParts:
        return {"models": {"model": WorkerFolder(self.handle)}, "optimizers": {}, "schedulers": {}}

    def load(self, ckpt: CheckpointManager, path: Path) -> LoadedCheckpoint:
        loaded = ckpt.load(path, models={}, optimizers={}, schedulers={})
        self.handle.call(ModelWorker.load, str(Path(loaded.path) / "model"))
        return loaded


# ---------------------------------------------------------------------------------------------- run
def _settings(cfg: OneModelConfig, total: int) -> LoopSettings:
    return LoopSettings(
        total_steps=total,
        eval_every=cfg.train.eval_every,
        save_every=cfg.ckpt.save_every,
        save_final=cfg.ckpt.save_final,
        best_metric=cfg.ckpt.best_metric,
        log_every=cfg.train.log_every,
    )


def _total_steps(cfg: OneModelConfig, num_samples: int) -> int:
    total = total_steps_of(cfg.train, num_samples)
    if total <= 0:
        raise ValueError(
            f"no optimizer step to run: {num_samples} training samples < train.batch_size "
            f"{cfg.train.batch_size}; lower train.batch_size or set train.max_steps"
        )
    return total


def _model_role(
    recipe: Recipe, launcher: Launcher, dist: DistConfig, total: int, run_dir: Path
) -> tuple[RoleHandle[ModelWorker], str]:
    """Spawn the model role and print the start-up banner; returns (handle, attention layout)."""
    cfg = recipe.cfg
    spec = ModelSpec(
        model=cfg.model,
        optim=cfg.optim,
        total_steps=total,
        loss_fn=recipe.loss_fn,
        seed=cfg.train.seed,
        device=cfg.train.device,
        dist=dist,
        hf_format=cfg.ckpt.save_hf_model,
        head=recipe.head,
        frozen=recipe.frozen,
        prepare=recipe.prepare,
    )
    handle = launcher.spawn("model", ModelWorker, spec)
    info = handle.call(ModelWorker.info)
    print(
        f"relayrl {recipe.name}: {recipe.describe or recipe.name} on {cfg.model.name_or_path} "
        f"({info['params'] / 1e6:.1f}M params, {info['precision']}, {info['layout']} attention), "
        f"{info['ranks']} rank(s), {total} steps of {cfg.train.batch_size} samples; run folder {run_dir}",
        flush=True,
    )
    return handle, info["layout"]


@dataclass(kw_only=True, slots=True)
class _Fitted:
    """What the loop over the role left (see `_fit`)."""

    fit: FitResult
    steps: int
    exit_code: int
    already_complete: bool


def _fit(
    recipe: Recipe, handle: RoleHandle[ModelWorker], data: _Data, run_dir: Path, stored: bool
) -> _Fitted:
    """The shared loop (relayrl.training.loop.Trainer) over the role: resume per ckpt.resume, then fit until
    the step total or a signal. `stored`: micro-batches travel through Ray's object store (RemoteStep)."""
    cfg, label = recipe.cfg, f"relayrl {recipe.name}"
    parts = cfg.dist.ranks("model") // cfg.dist.sp_size if stored else 1
    collate = TimedCollate(_collate(recipe, data.train, data.layout, parts))
    trainer = Trainer(
        train_step=RemoteStep(handle, stored=stored, parts=parts, collate=collate),
        state=RoleModelState(handle),
        sampler=ResumableSampler(len(data.train), cfg.train.batch_size, seed=cfg.train.seed),
        collate=collate,
        settings=_settings(cfg, data.total),
        ckpt=build_checkpoint_manager(cfg.ckpt, run_dir),
        eval_batches=_eval_batches(recipe, data.evals, data.layout) if data.evals else None,
        tokenizer=data.tokenizer,
    )
    resumed = resume_if_asked(trainer, cfg.ckpt)
    done_before = resumed and trainer.step >= data.total
    stop = SignalFlag(label)
    with (
        build_logger(
            cfg.logger, run_dir, total_steps=data.total, config=to_dict(cfg), start_step=trainer.step
        ) as logger,
        stop.installed(),
    ):
        trainer.logger = logger
        if resumed:
            print(f"resumed from step {trainer.step} ({run_dir / 'checkpoints'})")
        fit = trainer.fit(stop)
    return _Fitted(fit=fit, steps=trainer.step, exit_code=stop.exit_code(), already_complete=done_before)


@dataclass(kw_only=True, slots=True)
class _Data:
    """The run's tokenizer, samples and step total, and the layout the role's micro-batches use."""

    tokenizer: Any
    train: list[Any]
    evals: list[Any]
    total: int
    layout: str = "padded"


def _prepare(recipe: Recipe) -> tuple[Path, _Data]:
    """Run folder (checked against a run it continues, config.yaml written), tokenizer, data, step total."""
    cfg, label = recipe.cfg, f"relayrl {recipe.name}"
    m = cfg.model
    if not m.name_or_path:
        raise ConfigError(
            "model.name_or_path is required: the model to train, a local folder or Hub id "
            "(--model.name_or_path PATH)",
            field="model.name_or_path",
        )
    seed_everything(cfg.train.seed)
    tokenizer = load_tokenizer(  # a wrong model path fails here, before the run folder is touched
        m.tokenizer_name_or_path or m.name_or_path,
        trust_remote_code=m.trust_remote_code,
        what="model.tokenizer_name_or_path" if m.tokenizer_name_or_path else "model.name_or_path",
    )
    folder = run_dir_of(cfg.train, recipe.name)
    created = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    run_dir = prepare_run_dir(folder, cfg.ckpt, label)
    try:
        check_config_change(run_dir, cfg, label)
        train_samples, eval_samples = recipe.load_data(tokenizer)
        total = _total_steps(cfg, len(train_samples))
    except BaseException:
        release_run_dir(run_dir, remove=folder in created)
        for p in created:  # a run that never started leaves no folder behind
            if any(p.iterdir()):
                break
            p.rmdir()
        raise
    save_yaml(cfg, run_dir / "config.yaml")
    return run_dir, _Data(tokenizer=tokenizer, train=train_samples, evals=eval_samples, total=total)


def run_recipe(recipe: Recipe) -> RecipeResult:
    """Train per the recipe; writes the run folder; returns the model, metrics and paths.

    One code path for one process and for N ranks: this process reads the data and runs the loop (sampler,
    eval cadence, logging, checkpoints: relayrl.training.loop.Trainer over RemoteStep / RoleModelState); the
    model lives in a ModelWorker role (relayrl.workers.trained), in this process (dist.mode=local) or as
    `dist.num_nodes x dist.num_gpus_per_node` Ray ranks holding FSDP2 shards (dist.mode=ray). Each optimizer
    step's micro-batches go to the role; each rank trains on its share, gradients are reduced over all
    ranks and the loss is normalised by the global count, so the update equals the one-process update on the
    same global batch. The trained model is exported to <run>/final."""
    cfg = recipe.cfg
    run_dir, data = _prepare(recipe)
    launcher = build_launcher(cfg.dist, {"model": cfg.dist.ranks("model")}, run_dir)
    try:
        handle, data.layout = _model_role(recipe, launcher, cfg.dist, data.total, run_dir)
        if recipe.before_fit is not None:
            recipe.before_fit(handle, data.train, data.evals, data.layout)
        freeze_heap()  # the data and (local mode) the model live the whole run
        done = _fit(recipe, handle, data, run_dir, stored=launcher.mode == "ray")
        final = None
        if done.fit.stopped_by is None and cfg.ckpt.save_final:
            export = lambda: handle.call(ModelWorker.export, str(run_dir / "final"))  # noqa: E731
            final = timed_write("final model", export)
        result = RecipeResult(
            model=handle.instance.model if isinstance(handle, LocalRole) else None,
            tokenizer=data.tokenizer,
            run_dir=run_dir,
            metrics=done.fit.history[-1] if done.fit.history else {},
            history=done.fit.history,
            checkpoint=done.fit.last_checkpoint,
            final_model=final,
            exit_code=done.exit_code,
            steps=done.steps,
            already_complete=done.already_complete,
            train_samples=data.train,
            layout=data.layout,
        )
        if final is not None and recipe.after_fit is not None:
            recipe.after_fit(handle, result)
    finally:
        launcher.shutdown()
        release_run_dir(run_dir)
        thaw_heap()  # frozen before the loop: the run's worker and data become collectable again
    return result


def recipe_main(
    argv: list[str] | None,
    name: str,
    config_cls: type,
    run: Callable[[Any], RecipeResult],
    shown: Sequence[tuple[str, str]],
    doc: str | None,
) -> int:
    """`relayrl <name>`: parse `config_cls`, run, print the end-of-run lines with the `shown` metrics
    ((key, label) pairs, those present in the last row), return the exit code."""

    def go(cfg: Any) -> int:
        result = run(cfg)
        m = result.metrics
        headline = ", ".join(f"{label} {m[key]:.4f}" for key, label in shown if key in m)
        return finish_message(name, result, headline or "no metrics row")

    return run_command(config_cls, argv, f"relayrl {name}", go, description=(doc or "").split("\n\n")[0])


def finish_message(name: str, result: RecipeResult, headline: str) -> int:
    """Print the end-of-run lines of a recipe command and return its exit code."""
    if result.exit_code:
        print(
            f"relayrl {name}: stopped at step {result.steps} by a signal; checkpoint {result.checkpoint}. "
            "Rerun the same command to continue.",
            file=sys.stderr,
        )
        return result.exit_code
    if result.already_complete:
        print(
            f"relayrl {name}: already complete at step {result.steps} (the run's step total); raise "
            f"--train.max_steps (or --train.epochs) to continue; final model in {result.final_model}"
        )
        return 0
    print(f"{name} done: {result.metrics.get('step', 0)} steps, {headline}; run folder {result.run_dir}")
    print(f"relayrl {name}: final model in {result.final_model or 'none (ckpt.save_final false)'}")
    return 0
