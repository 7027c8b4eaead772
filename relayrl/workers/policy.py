"""PolicyWorker: the actor. Owns the policy model (fp32 master weights), its TrainStep (optimizer, schedule,
mixed precision), the policy objective, optional EMA, and the rollout engine + agent executor colocated with
it. The engine runs on `LocalWeights` (relayrl/distributed/weights/local.py): the policy module itself when its
compute weights have the engine's dtype (fp32 on a CPU; on a GPU the bf16 compute weights that TrainStep
refreshes from the fp32 masters after every optimizer step) and rollout.engine_copy does not ask for a copy
(auto: a fused copy on a GPU when it is small, workers/builders.py `engine_copy`), else its own copy refreshed
on the device by `sync`; an engine that loads its own weights (vllm) is streamed them. With separate engines
(dist.num_engines) the policy keeps a full replica and its rank 0 broadcasts it (distributed/weights/broadcast).
With dist.engine_tp > 1 (colocated, native) each block of engine_tp consecutive ranks runs ONE tensor-parallel
engine (rollout/native_tp.py): every rank holds 1/TP of the weights (TensorParallelWeights, refreshed from the
FSDP shards by fsdp.full_tensors), the block's first rank generates the block's share of the prompts and the
others follow its rounds (their `rollout` returns nothing).

Methods (called by the controller through a RoleHandle, in-process or on a Ray actor):

    rollout(samples, seed, eval=False) -> list[Trajectory]     sample n per prompt through the executor
    logprobs(batch: SequenceBatch) -> Tensor [B, T]               old log-probs (no grad); skipped by the
                                                               controller when the update is exactly on-policy
    update(exp: Experience, kl_coef) -> metrics                epochs x mini-batches x token-budget micro-batches
    sync() -> metrics                                          weights to the engine (timing/engine_refresh)
    save(folder) / load(folder)                                HF model folder + worker_state.pt (optimizer,
                                                               scheduler, EMA, RNG; loads with weights_only)
    export(folder)                                             HF model + tokenizer (EMA weights when on)
    weight_canary() -> float                                   max |engine - trainer| weight difference
    weight_endpoint() / weight_layout() / join_weights(channel)  the sending end of the weight group (separate
                                                               engines; the controller's connect_engines)

Every optimizer step is one `TrainStep.step` over the mini-batch's micro-batches: the objective returns each
micro-batch's (loss_sum, count) and the step divides by the mini-batch's total count (relayrl/training/step.py),
so the update does not depend on how the mini-batch is split.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from relayrl.agents.base import AgentExecutorBase, Trajectory
from relayrl.algorithms.objective import PolicyObjective, PolicyTerms
from relayrl.config.components import ModelConfig, OptimConfig
from relayrl.config.dist import DistConfig
from relayrl.config.rl import AlgoConfig, EvalConfig, RolloutConfig
from relayrl.data.packing import plan_micro_batches
from relayrl.data.records import PromptSample
from relayrl.distributed.group import merged, rank, sharded_role, world
from relayrl.distributed.hf_export import export_sharded
from relayrl.distributed.sharded_load import is_empty
from relayrl.distributed.sharded_load import wanted as sharded_load
from relayrl.distributed.weights.base import Channel, Layout, module_layout
from relayrl.distributed.weights.broadcast import BroadcastSender, free_endpoint
from relayrl.distributed.weights.local import LocalWeights
from relayrl.distributed.weights.tensor_parallel import TensorParallelWeights, tp_groups
from relayrl.models.budget import DEFAULT_TOKENS
from relayrl.models.forward import to_device
from relayrl.models.loading import resolve_device
from relayrl.rollout.base import RolloutEngine
from relayrl.rollout.build import engine_capabilities
from relayrl.rollout.native_tp import TPNativeEngine
from relayrl.training.checkpoint import check_finite_weights, load_weights_into
from relayrl.training.host_states import HostStates
from relayrl.training.step import LossOutput
from relayrl.workers.base import Experience, Rows, SequenceBatch, my_update_parts
from relayrl.workers.builders import (
    build_generation,
    build_policy_objective,
    build_trainable,
    engine_copy,
    inference_dtype,
    setup_process,
)
from relayrl.workers.ema import PolicyEma
from relayrl.workers.engine import generate_share, generate_tp_share, sampling_params
from relayrl.workers.model_ops import TokenBudgets, masked_logprobs, on_my_rows, row_logprobs
from relayrl.workers.role_state import RoleState
from relayrl.workers.trained import build_trained


@dataclass(kw_only=True, slots=True)
class PolicySpec:
    """What the policy role reads: its component configs plus a few run facts."""

    model: ModelConfig
    """Policy weights, compute dtype, LoRA."""
    optim: OptimConfig
    """Optimizer and schedule."""
    algo: AlgoConfig
    """The resolved algorithm (objective, epochs, mini-batches, micro-batch tokens)."""
    rollout: RolloutConfig
    """Engine, sampling, agent executor."""
    eval: EvalConfig
    """Eval sampling."""
    seed: int = 0
    """Process seed."""
    device: str = "auto"
    """auto / cpu / cuda."""
    total_steps: int = 1
    """RL steps of the run (the schedule spans total_steps x epochs x mini_batches optimizer steps)."""
    ema: float = 0.0
    """EMA decay of the saved weights (0 = off)."""
    task_name: str = ""
    """Built-in multi-turn task driving a `multi` agent."""
    step_timeout: float = 60.0
    """Timeout of one agent environment step."""
    decode_queries: bool = False
    """Set `Trajectory.query_text` on each rank (workers.engine.generate_share): the reward source reads the
    decode of all ids (a reward_func file, a remote RM) and the trajectories go to the driver through Ray."""
    dist: DistConfig | None = None
    """Sharding and memory options when the role runs on several ranks (ray mode); None: defaults."""
    separate_engines: bool = False
    """The engines are actors of their own (dist.num_engines > 0): this role keeps a full replica of the
    weights for them (no engine, no KV cache) and its rank 0 broadcasts it at every `sync`."""
    async_train: bool = False
    """Rollout overlaps training (train.async_train): the engine gets its own weight copy, refreshed only at
    `sync` while its rounds are paused, so an optimizer step never changes weights under a running round."""


def check_experience(exp: Experience) -> None:
    """ValueError naming the field and rows when the experience's advantages or old log-probs are not finite,
    or its reference log-probs are NaN, on an action token. These are host tensors: on an accelerator the
    loss functions skip their own per-micro-batch check (a device sync each), so the update checks them here,
    once; a non-finite value the model itself produces reaches the train step's non-finite guard."""
    mask = exp.tokens.action_mask.bool()
    for name, x, bad in (
        ("advantages", exp.advantages, lambda t: ~torch.isfinite(t)),
        ("old_logprobs", exp.old_logprobs, lambda t: ~torch.isfinite(t)),
        ("ref_logprobs", exp.ref_logprobs, torch.isnan),
    ):
        if x is not None and (rows := (bad(x) & mask).any(dim=1).nonzero().flatten().tolist()):
            raise ValueError(
                f"Experience.{name} is not finite on action tokens of rows {rows[:10]} of this update's share; "
                "check the advantage estimator / log-prob pass that produced it"
            )


class PolicyWorker:
    """The actor role (see module doc)."""

    def __init__(self, spec: PolicySpec) -> None:
        setup_process(spec.seed)
        self.spec = spec
        self.device = resolve_device(spec.device)
        grouped = sharded_role(spec.dist)  # dist.replicate: the whole model on every rank, as on one
        # N ranks: load on the CPU, copy the engine's full replica, then shard (FSDP moves each layer's shard
        # to the device), so no rank ever holds the full fp32 model on its GPU
        self.model, self.tokenizer = build_trainable(
            spec.model, torch.device("cpu") if grouped else self.device, sharded=sharded_load(spec.dist)
        )
        empty = is_empty(self.model)  # filled by shards after sharding: the engine's copy is refreshed then
        a = spec.algo
        engine_dtype = inference_dtype(spec.model, self.device)
        engine_device = torch.device(spec.rollout.engine_device) if spec.rollout.engine_device else None
        # an engine holding its own copy (vllm) is streamed the weights; separate engines take a broadcast
        stream = engine_capabilities(spec.rollout.engine).own_weights and not spec.separate_engines
        self.weights: LocalWeights | TensorParallelWeights
        self.tp_group: Any = None
        """This rank's tensor-parallel engine group (dist.engine_tp > 1, colocated): its engine is a TP shard."""
        engine_tp = spec.dist.engine_tp if spec.dist is not None and not spec.separate_engines else 1

        def gather_replica(layout: str) -> None:
            """The engine's full replica (or its TP shard), copied before the model is sharded."""
            if engine_tp > 1:  # 1/TP of the weights, refreshed from gathered parameters
                self.tp_group = tp_groups(engine_tp)
                self.weights = TensorParallelWeights(
                    self.model, dtype=engine_dtype, group=self.tp_group, device=engine_device or self.device
                )
                return
            self.weights = LocalWeights(
                self.model,
                dtype=engine_dtype,
                gather=True,
                device=engine_device or self.device,
                stream=stream,
            )

        built = build_trained(
            self.model,
            device=self.device,
            dtype=spec.model.dtype,
            optim=spec.optim,
            opt_steps=spec.total_steps * max(1, a.epochs * a.mini_batches),
            dist=spec.dist,
            before_shard=gather_replica if grouped else None,
            role="policy",
        )
        self.layout, self.train = ("exact" if spec.rollout.exact else built.layout), built.train
        if empty:
            self.weights.refresh()
        self.objective: PolicyObjective = build_policy_objective(a, spec.rollout.max_new_tokens)
        self.budgets = self._token_budgets()
        """Micro-batch token budgets (algo.micro_batch_tokens / infer_micro_batch_tokens; 0: auto)."""
        self.ema: PolicyEma | None = None
        if spec.ema > 0:  # fp32, sharded like the policy under N ranks (relayrl.workers.ema)
            with self.train.full_precision():
                self.ema = PolicyEma(self.model, spec.ema)
        if not grouped:
            params = sum(p.numel() for p in self.model.parameters())
            device = engine_device or self.device
            fused = engine_copy(spec.rollout, spec.model, params, engine_dtype, device, spec.dist)
            self.weights = LocalWeights(
                self.model,
                dtype=engine_dtype,
                device=engine_device,
                own_copy=spec.async_train or engine_device is not None or spec.separate_engines or fused,
                stream=stream,
            )
        self.state = RoleState(self.model, self.train, self.tokenizer, self._full_weights)
        self._start_engine(spec)

    def _start_engine(self, spec: PolicySpec) -> None:
        """The colocated engine over `self.weights` (none with separate engines) and its sleep settings."""
        sleep = spec.dist.engine_sleep if spec.dist else "auto"
        self.engine_sleep = sleep == "yes"
        self.offload_optimizer = bool(spec.dist and spec.dist.offload_optimizer_in_rollout)
        self.host_states = HostStates()
        self._asleep = False
        self.engine: RolloutEngine | None = None
        self.executor: AgentExecutorBase | None = None
        self.sender: BroadcastSender | None = None
        if not spec.separate_engines:
            self.engine, self.executor = build_generation(
                spec.rollout,
                spec.eval,
                self.weights.model,
                self.tokenizer,
                source=spec.model,
                task_name=spec.task_name,
                step_timeout=spec.step_timeout,
                group=self.tp_group,
            )

    def _token_budgets(self) -> TokenBudgets:
        """The algorithm's micro-batch budgets for this rank; exact mode's batch-invariant forward
        (rollout/exact.py) attends over padded rows, so it keeps DEFAULT_TOKENS instead of `auto`."""
        a = self.spec.algo
        fixed = DEFAULT_TOKENS if self.layout == "exact" else 0
        return TokenBudgets(
            model=self.model,
            device=self.device,
            update=a.micro_batch_tokens or fixed,
            infer=a.infer_micro_batch_tokens or fixed,
            precision=self.train.precision,
            optimizer=self.train.optimizer,
        )

    # ----------------------------------------------------------------------------------------- rollout
    @merged("concat")
    def rollout(self, samples: list[PromptSample], seed: int, eval: bool = False) -> list[Trajectory]:
        """n trajectories per prompt, grouped (a prompt's samples are contiguous). Request seeds derive from
        `seed` and the prompt's dataset index, so a resumed run samples exactly what the original did. Under
        N ranks each rank's engine generates a contiguous share of the prompts (balanced by expected tokens:
        prompt + max_new_tokens), and the shares concatenate back in order (workers/engine.generate_share)."""
        if self.engine is None or self.executor is None:
            raise RuntimeError(
                "the policy has no engine of its own (dist.num_engines > 0): call the engine role"
            )
        if self.weights.model is self.model and not self.weights.stream:  # the engine runs on the trained
            self.model.eval()  # module itself (never in async mode; vllm holds its own copy)
        if self.offload_optimizer:  # parked at the sync (_wake) already, except before the first one
            self.host_states.park(self.train.optimizer)
        if self.device.type == "cuda" and not eval and not self.spec.async_train:
            torch.cuda.reset_peak_memory_stats(self.device)  # perf/peak_mem_gib covers one whole step
        base = sampling_params(self.spec.rollout, self.spec.eval, eval=eval)
        budget = self.spec.rollout.max_new_tokens
        q = self.spec.decode_queries
        if isinstance(self.engine, TPNativeEngine):  # the block's leader generates, the others follow
            return generate_tp_share(self.engine, self.executor, base, samples, seed, budget, q)
        return generate_share(self.executor, base, samples, seed, budget, decode_queries=q)

    # ----------------------------------------------------------------------------------------- experience
    @merged("concat")
    @torch.no_grad()
    def logprobs(self, batch: Rows[SequenceBatch]) -> Tensor:
        """log pi_old(x_t | x_<t) [B, T] under the sampling temperature (0 where not an action); under N ranks
        each rank computes its share of the rows."""
        self.model.eval()
        return on_my_rows(
            batch,
            lambda sub: masked_logprobs(
                self.model,
                sub,
                self.infer_budget,
                self.spec.rollout.temperature,
                self.layout,
                self.train.autocast,
            ),
        )

    # ----------------------------------------------------------------------------------------- update
    def update(self, exp: Rows[Experience], kl_coef: float) -> dict[str, float]:
        """Policy update over epochs x mini-batches; returns train/* metrics averaged over optimizer steps.
        Each rank reads only its share of each mini-batch (workers.base.my_update_parts; a rank left without
        rows runs a padding pass on the mini-batch's first row, weight 0)."""
        a = self.spec.algo
        parts = my_update_parts(exp, a.mini_batches)
        sums: dict[str, float] = {}
        steps = 0
        self._prepare_update()
        if self.device.type != "cpu":  # (on a CPU the loss functions check them per micro-batch, for free)
            for part, _ in parts:
                check_experience(part)
        for _ in range(a.epochs):
            for part, real in parts:
                for k, v in self._optimizer_step(part, kl_coef, real).items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        self._ema_update()
        out = {f"train/{k}": v / steps for k, v in sums.items()}
        out["train/lr"] = float(self.train.scheduler.get_last_lr()[0])
        out["train/nonfinite_skips"] = float(self.train.nonfinite_total)
        if self.device.type == "cuda":  # rank 0's peak since this step's rollout began (ranks are alike)
            out["perf/peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return out

    def _optimizer_step(self, part: Experience, kl_coef: float, real: bool) -> dict[str, float]:
        """One optimizer step on this rank's share `part` of the mini-batch (all of it on one rank); `real`
        False: a padding pass (weight 0) of a rank without rows."""
        groups = plan_micro_batches(part.tokens.lengths, self.update_budget, self.layout)

        def loss_fn(model: torch.nn.Module, r: list[int]) -> LossOutput:
            return self._loss(model, part, r, kl_coef)

        out = self.train.step(groups, loss_fn, num_real=len(groups) if real else 0)
        return {**out.metrics, "grad_norm": out.grad_norm, "loss": out.loss}

    @property
    def update_budget(self) -> int:
        """Tokens of one training micro-batch (resolved at first use; relayrl.models.budget)."""
        return self.budgets.get()[0]

    @property
    def infer_budget(self) -> int:
        """Tokens of one no-gradient forward (old log-probs)."""
        return self.budgets.get()[1]

    def _prepare_update(self) -> None:
        """Before training: the engine frees its KV cache (engine_sleep) and offloaded optimizer states
        come back to the device. When rollout overlaps (async) or runs elsewhere (separate engines), the peak
        memory metric starts here: it covers the update (and whatever generation ran beside it)."""
        if self.device.type == "cuda" and (self.spec.async_train or self.engine is None):
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.engine_sleep and not self._asleep and self.engine is not None:
            self.engine.sleep()
            self._asleep = True
        if self.offload_optimizer:
            self.host_states.unpark(self.train.optimizer)

    def _loss(self, model: torch.nn.Module, mb: Experience, rows: list[int], kl_coef: float) -> LossOutput:
        micro = mb.select(rows)
        dev = self.device
        coef = self.spec.algo.aux_loss_coef
        aux: list[Tensor] | None = [] if coef > 0 else None  # a MoE policy's router load-balancing loss
        lp, ent = row_logprobs(
            model, mb.tokens, rows, self.layout, temperature=self.spec.rollout.temperature, entropy=True,
            aux_losses=aux,
        )  # fmt: skip

        def on(x: Tensor | None) -> Tensor | None:
            return None if x is None else to_device(x, dev)

        terms = PolicyTerms(
            logprobs=lp,
            entropy=ent,
            action_mask=to_device(micro.tokens.action_mask, dev),
            advantages=to_device(micro.advantages, dev),
            rollout_logprobs=to_device(micro.tokens.rollout_logprobs, dev),
            old_logprobs=on(micro.old_logprobs),
            ref_logprobs=on(micro.ref_logprobs),
        )
        o = self.objective(terms, kl_coef=kl_coef)
        loss_sum, metrics = o.loss_sum, dict(o.metrics)
        if aux:  # weighted by the loss's own count: the step's average over micro-batches
            loss_sum = loss_sum + coef * aux[0] * o.count
            metrics["aux_loss"] = aux[0].detach() * o.count
        return LossOutput(loss_sum=loss_sum, count=o.count, metrics=metrics, metric_counts=o.metric_counts)

    def _ema_update(self) -> None:
        if self.ema is not None:
            with self.train.full_precision():
                self.ema.update(self.model)

    # ----------------------------------------------------------------------------------------- sync
    def weight_endpoint(self) -> tuple[str, int]:
        """(address, free port) on this rank's host: where the weight group's store listens (rank 0's)."""
        return free_endpoint()

    def weight_layout(self) -> Layout:
        """(name, shape, dtype) of every parameter of the replica the engines receive, in broadcast order."""
        return module_layout(self.weights.model)

    def join_weights(self, channel: Channel) -> None:
        """Rank 0 enters the weight group as its sender (rank 0); the other ranks only help gather."""
        if rank() == 0:
            self.sender = BroadcastSender()
            self.sender.join(channel)

    def sync(self, version: int | None = None) -> dict[str, float]:
        """New weights to the engine, as weight version `version` (the RL step; None: the engine's + 1):
        cast-copy into its buffers (or nothing when it runs on the policy's own parameters), or stream named
        tensors to an engine holding its own copy (vllm); the engine then drops weight-dependent caches.
        Rounds are paused meanwhile: requests in flight (async training) continue under the new weights.
        Separate engines: the replica is refreshed (every rank: a gather is a collective) and rank 0
        broadcasts it."""
        t0 = time.perf_counter()
        if self.engine is None:
            seconds = self.train.last_refresh_s + self.weights.refresh()
            if self.sender is not None:
                self.sender.send(self.weights.model)
        else:
            seconds = self.train.last_refresh_s + self.weights.load_into(self.engine, version, self._wake)
        return {"timing/engine_refresh": max(seconds, time.perf_counter() - t0)}

    def _wake(self) -> None:
        """Before the engine's weights load: the optimizer states go to the host (offload_optimizer_in_rollout),
        then an engine that slept through the update (dist.engine_sleep) wakes, so its KV cache and graphs
        are allocated in the memory the states left. (Parked at the next rollout instead, the wake ran with
        52 GB of states still on the GPU: a 7B sync took 10-13 s on one H200 against 0.7 s at the first
        step, 2026-11-28; the cause is not isolated.)"""
        if self.offload_optimizer:
            self.host_states.park(self.train.optimizer)
        if self._asleep and self.engine is not None:
            self.engine.wake_up()
            self._asleep = False

    @merged("max")
    def weight_canary(self) -> float:
        """max |engine weight - trained fp32 weight cast to the engine's dtype| over every parameter: 0 when
        the engine generates from exactly the weights the optimizer produced."""
        master = self.train.master.max_abs_diff() if self.train.master is not None else 0.0
        return max(master, self.weights.max_abs_diff())

    # ----------------------------------------------------------------------------------------- state
    def save(self, folder: str) -> None:
        """Model, optimizer, schedule, EMA, RNG (relayrl.workers.trained: HF folder on 1 rank, DCP on N)."""
        self.state.save(folder, self.ema.extra() if self.ema is not None else {"ema": None})
        if self.ema is not None:
            self.ema.save(folder)

    def load(self, folder: str) -> None:
        """Restore everything `save` wrote, in place (from a checkpoint of any rank count). The engines get
        the restored weights from the controller's next `sync` (RLTrainer.resume calls it)."""
        state = self.state.load(folder)
        if self.ema is not None and not self.ema.load(folder, state.get("ema")):
            with self.train.full_precision():  # a checkpoint without an EMA: it restarts from its weights
                self.ema = PolicyEma(self.model, self.spec.ema)

    def _full_weights(self, folder: Path) -> dict[str, Tensor]:
        """The full state dict of a 1-rank checkpoint folder, named as this model's (a CPU model built like
        this one, loaded from the folder): how a full checkpoint reaches the shards."""

        cpu, _ = build_trainable(self.spec.model, torch.device("cpu"))
        load_weights_into(cpu, folder)
        return cpu.state_dict()

    def export(self, folder: str) -> str:
        """Save the final HF model (EMA weights when EMA is on) and tokenizer; returns the folder."""
        path = Path(folder)
        if self.ema is None:
            return self.state.export(path)
        # a NaN / inf anywhere in the EMA stops the export (every rank counts its shards when sharded)
        check_finite_weights(self.ema.state, f"the final (EMA) model to {path}", reduce=self.ema.sharded)
        if self.ema.sharded:  # each rank writes its rows (distributed/hf_export.py), else through rank 0
            export_sharded(self.model, path, self.tokenizer, lambda: self._gathered_ema(path), self.ema.state)
            return str(path)
        self.state.export_whole(path, self.ema.state)  # one rank, or replicated ranks' shared EMA
        return str(path)

    def _gathered_ema(self, path: Path) -> None:
        """The old export of a sharded EMA: gathered on every rank, written by rank 0."""
        full = self.ema.full(keep=rank() == 0) if self.ema is not None else {}
        if rank() == 0:
            self.state.save_hf(path, full)
        torch.distributed.barrier()

    def info(self) -> dict[str, Any]:
        """Facts the controller needs: pad / eos ids, parameter count, layout and precision."""
        return {
            "pad_id": int(self.tokenizer.pad_token_id),
            "eos_id": int(self.tokenizer.eos_token_id),
            "params": sum(p.numel() for p in self.model.parameters()),
            "layout": self.layout,
            "precision": self.train.precision,
            "engine_weights": self.weights.kind,
            "ranks": world(),
        }

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
