"""ReferenceWorker: the frozen reference policy (built only when a KL term is on).

    logprobs(batch: SequenceBatch) -> Tensor [B, T]   log pi_ref(x_t | x_<t), 0 off the action mask

Same temperature as the sampler (one log-prob semantics everywhere), same micro-batching and attention
layout as the policy. LoRA adapters are not applied: the reference is the base weights, held in the
inference dtype (bf16 on a GPU unless model.dtype is fp32).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from relayrl.config.components import ModelConfig
from relayrl.models.forward import choose_layout, prepare_model
from relayrl.training.setup import compute_precision, resolve_device
from relayrl.training.step import autocast
from relayrl.workers.base import SequenceBatch
from relayrl.workers.builders import build_frozen, setup_process
from relayrl.workers.model_ops import masked_logprobs


@dataclass(kw_only=True, slots=True)
class ReferenceSpec:
    """What the reference role reads."""

    model: ModelConfig
    """The policy's model config (path, dtype)."""
    micro_batch_tokens: int = 4096
    """Token budget of one forward."""
    temperature: float = 1.0
    """The sampling temperature."""
    seed: int = 0
    device: str = "auto"


class ReferenceWorker:
    """The frozen reference model."""

    def __init__(self, spec: ReferenceSpec) -> None:
        setup_process(spec.seed)
        self.spec = spec
        self.device = resolve_device(spec.device)
        self.model = build_frozen(spec.model, self.device)
        self.layout = choose_layout(self.model, self.device)
        prepare_model(self.model, self.layout)
        self.precision = compute_precision(spec.model.dtype, self.device)

    def logprobs(self, batch: SequenceBatch) -> Tensor:
        """Reference log-probs [B, T] (float32, CPU)."""
        return masked_logprobs(
            self.model,
            batch,
            self.spec.micro_batch_tokens,
            self.spec.temperature,
            self.layout,
            lambda: autocast(self.precision, self.device),
        )
