"""ReferenceWorker: the frozen reference policy (built only when a KL term is on).

    logprobs(batch: SequenceBatch) -> Tensor [B, T]   log pi_ref(x_t | x_<t), 0 off the action mask

Same temperature as the sampler (one log-prob semantics everywhere), same micro-batching and attention
layout as the policy. LoRA adapters are not applied: the reference is the base weights, held in the
inference dtype (bf16 on a GPU unless model.dtype is fp32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from relayrl.config.components import ModelConfig
from relayrl.config.dist import DistConfig
from relayrl.distributed.fsdp import ShardSpec, is_sharded, shard_model
from relayrl.distributed.group import merged, sharded_role
from relayrl.distributed.sequence_parallel import setup_sequence_parallel
from relayrl.distributed.sharded_load import wanted as sharded_load
from relayrl.models.forward import choose_layout, hf_model, prepare_model
from relayrl.models.loading import resolve_device
from relayrl.training.setup import compute_precision
from relayrl.training.step import autocast
from relayrl.workers.base import Rows, SequenceBatch
from relayrl.workers.builders import build_frozen, setup_process
from relayrl.workers.model_ops import TokenBudgets, masked_logprobs, on_my_rows


@dataclass(kw_only=True, slots=True)
class ReferenceSpec:
    """What the reference role reads."""

    model: ModelConfig
    """The policy's model config (path, dtype)."""
    micro_batch_tokens: int = 0
    """The policy's training budget (algo.micro_batch_tokens; 0: auto): the automatic inference budget is a
    multiple of it."""
    infer_micro_batch_tokens: int = 0
    """Token budget of one forward (algo.infer_micro_batch_tokens; 0: auto, relayrl/models/budget.py)."""
    temperature: float = 1.0
    """The sampling temperature."""
    seed: int = 0
    """Seed of the role's process."""
    device: str = "auto"
    """auto, cpu or cuda (train.device)."""
    dist: DistConfig | None = None
    """Sharding options when the role runs on several ranks (ray mode)."""


class ReferenceWorker:
    """The frozen reference model."""

    def __init__(self, spec: ReferenceSpec) -> None:
        setup_process(spec.seed)
        self.spec = spec
        self.device = resolve_device(spec.device)
        grouped = sharded_role(spec.dist)
        self.model = build_frozen(
            spec.model,
            torch.device("cpu") if grouped else self.device,
            like=self.device,
            sharded=sharded_load(spec.dist),
        )
        setup_sequence_parallel(spec.dist.sp_size if spec.dist else 1, self.model, "reference")
        self.layout = choose_layout(self.model, self.device)
        prepare_model(self.model, self.layout)
        self.precision = compute_precision(spec.model.dtype, self.device)
        self.budgets = TokenBudgets(
            model=self.model,
            device=self.device,
            update=spec.micro_batch_tokens,
            infer=spec.infer_micro_batch_tokens,
            precision=self.precision,
        )
        """Micro-batch token budgets; the forwards use the inference one."""
        if grouped:  # sharded for inference: held in the inference dtype, gathered layer by layer
            d = spec.dist or DistConfig()
            shard_model(
                self.model,
                ShardSpec(device=self.device, offload=d.offload, reshard_after_forward=True),
            )

    @merged("concat")
    def logprobs(self, batch: Rows[SequenceBatch]) -> Tensor:
        """Reference log-probs [B, T] (float32, CPU); under N ranks each rank computes its share of rows."""
        out = on_my_rows(
            batch,
            lambda sub: masked_logprobs(
                self.model,
                replace(sub, routes=None),  # routes a MoE reference itself: recorded routes are the policy's
                self.infer_budget,
                self.spec.temperature,
                self.layout,
                lambda: autocast(self.precision, self.device),
            ),
        )
        if is_sharded(self.model):
            hf_model(self.model).reshard()  # the root unit stays gathered after an inference forward
        return out

    @property
    def infer_budget(self) -> int:
        """Tokens of one forward (resolved at first use; relayrl.models.budget)."""
        return self.budgets.get()[1]
