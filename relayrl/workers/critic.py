"""CriticWorker: the value model of PPO (`gae`), built only for estimators that need values.

    values(batch: SequenceBatch) -> Tensor [B, T]      V(x_<t) at every action token (0 elsewhere)
    update(exp: Experience) -> metrics                 clipped value loss (ValueObjective), epochs x
                                                       mini-batches x token-budget micro-batches, one
                                                       TrainStep per mini-batch (token mean over the step)
    save(folder) / load(folder)                        HF value-head folder + worker_state.pt

The critic is an `AutoModelForSequenceClassification` value-head model (relayrl.models.value_head), initialised
from `critic.model_path` (default: the policy's path) with a zero head, so V starts at 0. Like the policy it
keeps fp32 master weights and computes with bf16 weights on a GPU (relayrl/training/precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from relayrl.algorithms.objective import ValueObjective, ValueTerms
from relayrl.config.components import ModelConfig, OptimConfig
from relayrl.config.dist import DistConfig
from relayrl.data.packing import plan_micro_batches
from relayrl.distributed.group import merged, sharded_role
from relayrl.distributed.sharded_load import load_for_shards
from relayrl.distributed.sharded_load import wanted as sharded_load
from relayrl.models.empty import empty_value_model
from relayrl.models.forward import to_device
from relayrl.models.loading import load_tokenizer, resolve_device
from relayrl.models.value_head import build_value_model
from relayrl.training.checkpoint import load_weights_into
from relayrl.training.step import LossOutput, padded_passes
from relayrl.workers.base import Experience, Rows, SequenceBatch, my_update_parts
from relayrl.workers.builders import setup_process
from relayrl.workers.model_ops import RowGather, TokenBudgets, critic_values, on_my_rows
from relayrl.workers.role_state import RoleState
from relayrl.workers.trained import build_trained


@dataclass(kw_only=True, slots=True)
class CriticSpec:
    """What the critic role reads."""

    model: ModelConfig
    """The policy's model config (its path is the default critic init; dtype, LoRA)."""
    optim: OptimConfig
    """The critic's own optimizer and schedule (RLConfig: `critic.optimizer(optim)`: the policy's section with
    critic.lr and the critic.optim fields that are set)."""
    model_path: str = ""
    """Critic initial weights (critic.model_path); empty: `model.name_or_path`."""
    epochs: int = 1
    """Critic passes over each step's experience (critic.epochs)."""
    mini_batches: int = 1
    """Optimizer steps per epoch (algo.mini_batches)."""
    micro_batch_tokens: int = 0
    """Token budget of one training micro-batch (algo.micro_batch_tokens; 0: auto, relayrl/models/budget.py)."""
    infer_micro_batch_tokens: int = 0
    """Token budget of one value forward (algo.infer_micro_batch_tokens; 0: auto)."""
    value_clip: float = 0.2
    """Value clipping range of the loss (algo.value_clip; 0 = no clipping)."""
    seed: int = 0
    """Seed of the role's process (the critic uses seed + 1)."""
    device: str = "auto"
    """auto, cpu or cuda (train.device)."""
    total_steps: int = 1
    """RL steps of the run (the schedule spans total_steps x epochs x mini_batches optimizer steps)."""
    dist: DistConfig | None = None
    """Sharding options when the role runs on several ranks (ray mode)."""


class CriticWorker:
    """The critic role."""

    def __init__(self, spec: CriticSpec) -> None:
        setup_process(spec.seed + 1)
        self.spec = spec
        self.device = resolve_device(spec.device)
        m = spec.model
        self.tokenizer = load_tokenizer(m.tokenizer_name_or_path or m.name_or_path)
        grouped = sharded_role(spec.dist)
        self.model = self._build(torch.device("cpu") if grouped else self.device, sharded_load(spec.dist))
        built = build_trained(
            self.model,
            device=self.device,
            dtype=spec.model.dtype,
            optim=spec.optim,
            opt_steps=spec.total_steps * spec.epochs * max(1, spec.mini_batches),
            dist=spec.dist,
            role="critic",
        )
        self.layout, self.train = built.layout, built.train
        self.objective = ValueObjective(clip_eps=spec.value_clip or None)
        self.budgets = TokenBudgets(
            model=self.model,
            device=self.device,
            update=spec.micro_batch_tokens,
            infer=spec.infer_micro_batch_tokens,
            precision=self.train.precision,
            optimizer=self.train.optimizer,
        )
        """Micro-batch token budgets (update, values pass), resolved at first use."""
        self.state = RoleState(self.model, self.train, self.tokenizer, self._full_weights)

    def _build(self, device: torch.device, sharded: bool = False) -> torch.nn.Module:
        """The value model on `device`; `sharded`: built empty, filled by shards (distributed/sharded_load)."""
        m = replace(
            self.spec.model,
            name_or_path=self.spec.model_path or self.spec.model.name_or_path,
            dtype="fp32",
        )
        pad = self.tokenizer.pad_token_id
        if sharded:
            return load_for_shards(
                lambda: empty_value_model(m, init="zeros", pad_token_id=pad),
                lambda: build_value_model(m, init="zeros", pad_token_id=pad, device=device),
                what="critic",
            )
        return build_value_model(m, init="zeros", pad_token_id=pad, device=device)

    def _full_weights(self, folder: Path) -> dict[str, Tensor]:
        cpu = self._build(torch.device("cpu"))
        load_weights_into(cpu, folder)
        return cpu.state_dict()

    @merged("concat")
    @torch.no_grad()
    def values(self, batch: Rows[SequenceBatch]) -> Tensor:
        """V(x_<t) [B, T] (float32, CPU), 0 off the action mask; under N ranks each computes its rows."""
        self.model.eval()
        return on_my_rows(batch, self._values)

    def _values(self, batch: SequenceBatch) -> Tensor:
        out = RowGather(batch.input_ids.shape)  # on the device; one copy back to the host
        infer = self.budgets.get()[1]
        for rows, weight in padded_passes(plan_micro_batches(batch.lengths, infer, self.layout), None):
            with self.train.autocast():
                v = critic_values(self.model, batch, rows, self.layout)
            if weight:
                out.put(rows, v)
        return out.result() * batch.action_mask

    def update(self, exp: Rows[Experience]) -> dict[str, float]:
        """Critic epochs over the experience; returns critic/* metrics averaged over optimizer steps. Each
        rank reads only its share of each mini-batch (a rank without rows: a padding pass on its first)."""
        parts = my_update_parts(exp, self.spec.mini_batches)
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(self.spec.epochs):
            for mb, mine in parts:
                groups = plan_micro_batches(mb.tokens.lengths, self.budgets.get()[0], self.layout)
                out = self.train.step(
                    groups,
                    lambda model, batch, mb=mb: self._loss(model, mb, batch),
                    num_real=len(groups) if mine else 0,
                )
                for k, v in {**out.metrics, "loss": out.loss, "grad_norm": out.grad_norm}.items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        return {f"critic/{k}": v / max(1, steps) for k, v in sums.items()}

    def _loss(self, model: torch.nn.Module, mb: Experience, rows: list[int]) -> LossOutput:
        micro = mb.select(rows)
        assert micro.values is not None and micro.returns is not None, "critic: no values or returns"
        v = critic_values(model, mb.tokens, rows, self.layout)
        dev = v.device
        terms = ValueTerms(
            values=v,
            old_values=to_device(micro.values, dev),
            returns=to_device(micro.returns, dev),
            action_mask=to_device(micro.tokens.action_mask, dev),
        )
        o = self.objective(terms)
        return LossOutput(
            loss_sum=o.loss_sum, count=o.count, metrics=o.metrics, metric_counts=o.metric_counts
        )

    def save(self, folder: str) -> None:
        """Model, optimizer, schedule, RNG (relayrl.workers.trained: HF folder on 1 rank, DCP on N)."""
        self.state.save(folder, {})

    def load(self, folder: str) -> None:
        """Restore everything `save` wrote (from a checkpoint of any rank count)."""
        self.state.load(folder)
