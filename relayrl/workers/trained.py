"""What the trained roles (policy, critic) share about sharding and state: one place that knows whether the
role runs on one rank (plain module, HF-folder checkpoints), on N ranks with FSDP2 shards (DCP checkpoints) or
on N ranks each holding the whole model (dist.replicate: gradients summed once a step, one-rank checkpoints).

    built = build_trained(model, device=..., dtype=..., optim=..., opt_steps=..., dist=..., before_shard=...)
                                      THE construction sequence of a trained role (policy, critic, a recipe's
                                      model): forward layout, precision, FSDP2 shards when this process is one
                                      rank of a multi-rank role (or rank 0's weights broadcast to every replica
                                      under dist.replicate), the train step -> TrainedModel(layout, train)
    state = RoleState(model, train, tokenizer, full_weights)
                                      checkpoint and export in each of the three cases (workers/role_state.py)

worker_state.pt always holds the schedule, counters and (1 rank) optimizer state and RNG; the role adds its own
`extra` entries (e.g. the policy's EMA). Under N ranks the RNG of each rank is in rng/rank_<r>.pt.

`ModelWorker(ModelSpec)` is the generic trained-model role of the one-model recipes (SFT now; RM / DPO / KTO
on the same seam): the recipe's loop runs on the driver and sends each optimizer step's micro-batches; every
rank trains on its share (contiguous, balanced by tokens) with the recipe's loss function:

    info() -> {"layout", "precision", "ranks", "params"}      layout: what the driver's collate must build
    step(micro_batches, counts) -> (StepOutput, nonfinite)     one optimizer step over every rank's share
    evaluate(batches) -> {"eval/loss", ...}                    over every rank's share
    precompute(micro_batches) -> micro_batches                 `prepare` only, results on the CPU (e.g. DPO's
                                                               reference log-probs once); frees the frozen model
    infer(fn, micro_batches) -> [fn(models, mb)]              no-grad passes (e.g. the RM's score statistics)
    save(folder) / load(folder) / export(folder)               RoleState

The model is a causal LM (`head="lm"`) or a value-head model (`head="value"`: reward models). A recipe that
needs a second, frozen model (DPO / KTO reference, KD teacher) names it in `ModelSpec.frozen`; its
`prepare(Models, micro_batches)` runs without gradients before every step and eval over the rank's share of
micro-batches and fills what the loss reads (reference log-probs, teacher hidden states, KTO's reference
point). Ranks run `prepare` over equally many micro-batches (a sharded frozen model gathers its weights in
each forward), so a prepare function may also all-reduce once per call.

On the driver, relayrl.trainers.recipe runs relayrl.training.loop.Trainer over such a role (its RemoteStep and
RoleModelState adapters): the loop, sampler, logging, checkpoint atomicity and rotation stay the
single-process ones.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from relayrl.config.components import ModelConfig, OptimConfig
from relayrl.config.dist import DistConfig
from relayrl.data.packing import count_ranges
from relayrl.distributed.fsdp import ShardSpec, defer_sync, is_sharded, keep_gathered, shard_model
from relayrl.distributed.group import (
    in_group,
    merged,
    my_data_share,
    rank,
    replicated_role,
    reports,
    sharded_role,
    world,
)
from relayrl.distributed.sequence_parallel import setup_sequence_parallel
from relayrl.distributed.sharded_load import load_for_shards
from relayrl.distributed.sharded_load import wanted as sharded_load
from relayrl.models.empty import Built, Unsupported, empty_causal_lm, empty_value_model
from relayrl.models.forward import choose_layout, hf_model, prepare_model
from relayrl.models.loading import load_causal_lm, load_tokenizer, resolve_device
from relayrl.models.sequence_parallel import size as sp_size
from relayrl.models.value_head import build_value_model
from relayrl.training.checkpoint import load_weights_into
from relayrl.training.replicate import broadcast_params
from relayrl.training.rng import seed_everything
from relayrl.training.setup import build_train_step, compute_precision
from relayrl.training.step import LossFn, StepOutput, TrainStep, autocast, move_to
from relayrl.workers.base import Items, as_items
from relayrl.workers.builders import build_frozen
from relayrl.workers.role_state import RoleState


@dataclass(kw_only=True, slots=True)
class TrainedModel:
    """A trained role's model made ready on this rank by `build_trained`."""

    layout: str
    """The forward layout every batch of this rank is built in (models.forward.choose_layout)."""
    train: TrainStep
    """Its training step (optimizer, schedule, precision), over the FSDP2 shards when the role is grouped."""


def build_trained(
    model: torch.nn.Module,
    *,
    device: torch.device,
    dtype: str,
    optim: OptimConfig,
    opt_steps: int,
    dist: DistConfig | None,
    loss_fn: LossFn | None = None,
    before_shard: Callable[[str], None] | None = None,
    role: str = "model",
) -> TrainedModel:
    """The one construction sequence of a trained role, after its model is loaded (on the CPU when grouped):
    the forward layout, the compute precision of `dtype` (model.dtype), FSDP2 shards when this process is one
    rank of a group, then the train step for `opt_steps` optimizer steps. `before_shard(layout)` builds what
    must see the whole model first (the policy's gathered engine replica; a recipe's frozen model, laid out
    like this one). Under dist.sp_size > 1 the `role`'s ranks first join their sequence-parallel groups."""
    setup_sequence_parallel(dist.sp_size if dist is not None else 1, model, role)
    layout = choose_layout(model, device)
    prepare_model(model, layout)
    precision = compute_precision(dtype, device)
    if before_shard is not None:
        before_shard(layout)
    keep = keep_gathered(dist, model, device, precision)  # counted before sharding
    grouped = shard_if_grouped(model, dist, device, precision)
    replicated = replicated_role(dist)
    if replicated:  # every rank starts from rank 0's weights (a value head or LoRA adapters are random)
        broadcast_params(model)
    train = build_train_step(
        model,
        optim,
        opt_steps,
        loss_fn,
        precision=precision,
        device=device,
        sharded=grouped,
        defer_grad_sync=defer_sync(dist),
        keep_gathered=keep,
        reshard_after_forward=(dist or DistConfig()).reshard_after_forward,
        replicate_grads=replicated,
    )
    return TrainedModel(layout=layout, train=train)


def shard_if_grouped(model: Any, dist: DistConfig | None, device: torch.device, precision: str) -> bool:
    """Shard `model` with FSDP2 when this process is one rank of a multi-rank role that shards (not
    dist.replicate; see module doc)."""
    if not sharded_role(dist):
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


@dataclass(kw_only=True, slots=True)
class ModelSpec:
    """What a one-model recipe's trained role reads."""

    model: ModelConfig
    """Weights, compute dtype, LoRA."""
    optim: OptimConfig
    """Optimizer and schedule."""
    total_steps: int
    """Optimizer steps of the run (the schedule's length)."""
    loss_fn: LossFn
    """The recipe's loss (a module-level function: it travels to Ray actors by reference)."""
    seed: int = 0
    device: str = "auto"
    dist: DistConfig | None = None
    """Sharding options when the role runs on several ranks."""
    hf_format: bool = True
    """Checkpoint weights as an HF folder (False: a plain state dict; 1 rank only, N ranks write DCP)."""
    head: str = "lm"
    """"lm": a causal LM; "value": a value-head model (AutoModelForSequenceClassification, a new head
    initialised as a reward model's)."""
    frozen: ModelConfig | None = None
    """A frozen second model the loss reads through `prepare` (reference, teacher); None: none."""
    prepare: PrepareFn | None = None
    """Fills each micro-batch before the loss (module-level function; see the module doc)."""


@dataclass(kw_only=True, slots=True)
class Models:
    """What a recipe's `prepare` function sees on one rank."""

    model: torch.nn.Module
    """The trained model (run it under no_grad here)."""
    frozen: torch.nn.Module | None
    """The frozen model (ModelSpec.frozen), None when absent or released after `precompute`."""
    layout: str
    """Attention layout of the forwards."""
    autocast: Callable[[], contextlib.AbstractContextManager]
    """The compute-precision context for forwards."""


class PrepareFn(Protocol):
    """prepare(models, micro_batches, num_real): fill the micro-batches in place (no gradients). Only the first
    `num_real` are this rank's own; the rest repeat one to give every rank as many forwards (leave them out of
    any sum)."""

    def __call__(self, models: Models, micro_batches: list[Any], num_real: int) -> None: ...


def _share(
    micro_batches: Sequence[Any] | Items[Any], counts: Sequence[int] | None = None
) -> tuple[list[Any], int]:
    """(this rank's micro-batches, how many are real): a contiguous share balanced by tokens (per
    data-parallel group: an SP group's ranks share one), or with `counts` (the driver planned each
    data-parallel rank's micro-batches: relayrl.data.packing.RankBatches) the counts[r] after the earlier
    ranks'; a rank left without one runs the first micro-batch as a padding pass. On Ray the micro-batches
    are in the object store (launch.rows.StoredItems): only this rank's are fetched."""
    items = as_items(micro_batches)
    mine = items.take(_planned(counts, len(items)) if counts is not None else my_data_share(items.sizes))
    return (mine, len(mine)) if mine or not len(items) else (items.take([0]), 0)


def _planned(counts: Sequence[int], n: int) -> range:
    """This data-parallel rank's range of a step planned per rank (`counts[r]` micro-batches of rank r)."""
    groups, g = world() // sp_size(), rank() // sp_size()
    if len(counts) != groups or sum(counts) != n:
        raise ValueError(
            f"micro-batches planned as {list(counts)} for {groups} data-parallel rank(s), {n} sent"
        )
    return count_ranges(counts)[g]


def _equal_passes(mine: list[Any]) -> list[Any]:
    """`mine` extended (with copies of its last micro-batch) to the longest share over the ranks, so every
    rank runs the same number of frozen-model forwards."""
    if not in_group():
        return mine
    n = torch.tensor([len(mine)], dtype=torch.int64)
    torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)  # CPU tensor: the gloo backend
    # copies, not the same object: a prepare that skips already-filled micro-batches must still run the pad's
    # forwards, or this rank would run fewer collectives than its peers (a hang)
    return mine + [copy.copy(mine[-1]) for _ in range(int(n.item()) - len(mine))]


class ModelWorker:
    """A trained model of a one-model recipe (see module doc)."""

    def __init__(self, spec: ModelSpec) -> None:
        seed_everything(spec.seed)
        self.spec = spec
        self.device = resolve_device(spec.device)
        grouped = sharded_role(spec.dist)
        self.model, self.tokenizer = self._load(
            torch.device("cpu") if grouped else self.device, sharded_load(spec.dist)
        )
        self.frozen: Any = None

        def load_frozen(layout: str) -> None:  # before sharding: the frozen model is laid out like the model
            self.frozen = self._load_frozen(grouped, layout)

        built = build_trained(
            self.model,
            device=self.device,
            dtype=spec.model.dtype,
            optim=spec.optim,
            opt_steps=spec.total_steps,
            dist=spec.dist,
            loss_fn=spec.loss_fn,
            before_shard=load_frozen,
        )
        self.layout, self.train = built.layout, built.train
        self.state = RoleState(self.model, self.train, self.tokenizer, self._full_weights, spec.hf_format)

    def _load(self, device: torch.device, sharded: bool = False) -> tuple[Any, Any]:
        """(model, tokenizer) on `device`; `sharded`: the model built empty when the checkpoint allows, its
        shards filled by shard_model (relayrl.distributed.sharded_load)."""
        cfg = replace(self.spec.model, dtype="fp32")
        if self.spec.head not in ("lm", "value"):
            raise ValueError(f"ModelSpec.head must be 'lm' or 'value', got {self.spec.head!r}")
        tok = load_tokenizer(
            cfg.tokenizer_name_or_path or cfg.name_or_path, trust_remote_code=cfg.trust_remote_code
        )
        lm, pad = self.spec.head == "lm", tok.pad_token_id

        def whole() -> Any:
            if lm:
                return load_causal_lm(cfg, device=device)
            return build_value_model(cfg, init="normal", pad_token_id=pad, device=device)

        def empty() -> Built | Unsupported:
            return empty_causal_lm(cfg) if lm else empty_value_model(cfg, init="normal", pad_token_id=pad)

        return (load_for_shards(empty, whole, what="model") if sharded else whole()), tok

    def _load_frozen(self, grouped: bool, layout: str) -> Any:
        if self.spec.frozen is None:
            return None
        frozen = build_frozen(
            self.spec.frozen,
            torch.device("cpu") if grouped else self.device,
            like=self.device,
            sharded=sharded_load(self.spec.dist),
        )
        prepare_model(frozen, layout)
        if grouped:  # sharded for inference, like the RL reference
            d = self.spec.dist or DistConfig()
            shard_model(frozen, ShardSpec(device=self.device, offload=d.offload, reshard_after_forward=True))
        return frozen

    def _full_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        cpu, _ = self._load(torch.device("cpu"))
        load_weights_into(cpu, folder)
        return cpu.state_dict()

    def _models(self) -> Models:
        return Models(
            model=self.model,
            frozen=self.frozen,
            layout=self.layout,
            autocast=lambda: autocast(self.train.precision, self.device),
        )

    def _no_grad_passes(self, fn: Callable[..., Any], micro_batches: list[Any], real: int) -> Any:
        """fn(models, micro_batches padded to equal counts over ranks, real) without gradients; sharded roots
        are resharded after (they stay gathered after a forward without a backward)."""
        model_was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = fn(self._models(), _equal_passes(micro_batches), real)
        finally:
            self.model.train(model_was_training)
        for m in (self.model, self.frozen):
            if m is not None and is_sharded(m):
                hf_model(m).reshard()
        return out

    def _prepare(self, micro_batches: list[Any], real: int) -> None:
        if self.spec.prepare is not None and micro_batches:
            self._no_grad_passes(self.spec.prepare, micro_batches, real)

    def info(self) -> dict[str, Any]:
        return {
            "layout": self.layout,
            "precision": self.train.precision,
            "ranks": world(),
            "params": sum(p.numel() for p in self.model.parameters()),
        }

    def step(
        self, micro_batches: list[Any] | Items[Any], counts: list[int] | None = None
    ) -> tuple[StepOutput, int]:
        """One optimizer step; `counts`: the micro-batches of each data-parallel rank, in order (see _share)."""
        mine, real = _share(micro_batches, counts)
        self._prepare(mine, real)
        out = self.train.step(mine, num_real=real)
        out.tokens = sum(as_items(micro_batches).tokens)  # the step's, not this rank's
        return out, self.train.nonfinite_total

    def evaluate(self, batches: list[list[Any]] | Items[Any]) -> dict[str, float]:
        """Over every rank's share of the eval micro-batches (per step lists, or already flat as Items)."""
        mine, real = _share([mb for step in batches for mb in step] if isinstance(batches, list) else batches)
        self._prepare(mine, real)
        return self.train.evaluate([mine], num_real=real)

    @merged("concat")
    def precompute(self, micro_batches: list[Any]) -> list[Any]:
        """Run `prepare` over this rank's share and return those micro-batches (tensors on the CPU), in order;
        then release the frozen model (its outputs are now in the data)."""
        mine, real = _share(micro_batches)
        self._prepare(mine, real)
        self.frozen = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [move_to(m, "cpu") for m in mine[:real]] if reports() else []

    @merged("concat")
    def infer(self, fn: Callable[[Models, Any], Any], micro_batches: list[Any]) -> list[Any]:
        """[fn(models, micro_batch)] over every micro-batch without gradients (each rank its share; results in
        order). `fn` is module-level and returns CPU values (e.g. the RM's scores)."""
        mine, real = _share(micro_batches)
        if not micro_batches:
            return []
        outs = self._no_grad_passes(lambda models, mbs, _: [fn(models, mb) for mb in mbs], mine, real)
        return outs[:real] if reports() else []

    def save(self, folder: str) -> None:
        self.state.save(folder, {})

    def load(self, folder: str) -> None:
        self.state.load(folder)

    def export(self, folder: str) -> str:
        return self.state.export(folder)
