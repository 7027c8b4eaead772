"""ReferenceWorker: the frozen reference policy (built only when a KL term is on).

    ref_logprobs(batch: SequenceBatch) -> Tensor [B, T]   log pi_ref(x_t | x_<t), 0 off the action mask

Same temperature as the sampler (one log-prob semantics everywhere), same packed micro-batching as the
policy. LoRA adapters are not applied: the reference is the base weights.
"""

from __future__ import annotations

from torch import Tensor

from relayrl.config.rl import RLConfig
from relayrl.workers.base import SequenceBatch
from relayrl.workers.builders import build_policy_model, setup_process
from relayrl.workers.model_ops import masked_logprobs


class ReferenceWorker:
    """The frozen reference model."""

    def __init__(self, cfg: RLConfig) -> None:
        setup_process(cfg.train.seed)
        self.cfg = cfg
        self.model, _ = build_policy_model(cfg, trainable=False)

    def logprobs(self, batch: SequenceBatch) -> Tensor:
        """Reference log-probs [B, T] (float32, CPU)."""
        return masked_logprobs(
            self.model, batch, self.cfg.algo.micro_batch_tokens, self.cfg.rollout.temperature
        )
