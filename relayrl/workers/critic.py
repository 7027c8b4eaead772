"""CriticWorker: the value model of PPO (`gae`), built only for estimators that need values.

    values(batch: SequenceBatch) -> Tensor [B, T]      V(x_<t) at every action token (0 elsewhere)
    update(exp: Experience) -> metrics                 clipped value loss, epochs x mini-batches x packed
                                                       micro-batches, token-mean over each optimizer step
    save(folder) / load(folder)                        HF value-head folder + worker_state.pt

The critic is an `AutoModelForSequenceClassification` value-head model (relayrl.models.value_head), initialised
from `critic.model_path` (default: the policy's path) with a zero head, so V starts at 0.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from relayrl.algorithms.aggregation import AGGREGATIONS, step_denominators
from relayrl.algorithms.value_loss import value_loss
from relayrl.config.rl import RLConfig
from relayrl.workers.base import Experience, SequenceBatch, split_rows
from relayrl.workers.builders import build_policy_optim, resolve_device, setup_process
from relayrl.workers.model_ops import critic_values, micro_batches
from relayrl.workers.policy import STATE_FILE, _rng_state, _set_rng_state


class CriticWorker:
    """The critic role."""

    def __init__(self, cfg: RLConfig, total_steps: int) -> None:
        from relayrl.models.loading import load_tokenizer
        from relayrl.models.value_head import build_value_model

        setup_process(cfg.train.seed + 1)
        self.cfg = cfg
        m = replace(cfg.model, name_or_path=cfg.critic.model_path or cfg.model.name_or_path)
        self.tokenizer = load_tokenizer(m.tokenizer_name_or_path or cfg.model.name_or_path)
        self.model = build_value_model(
            m, init="zeros", pad_token_id=self.tokenizer.pad_token_id, device=resolve_device(cfg.train.device)
        )
        optim = replace(cfg.optim, lr=cfg.critic.lr)
        steps = total_steps * cfg.critic.epochs * max(1, cfg.algo.mini_batches)
        self.optimizer, self.scheduler = build_policy_optim(self.model, optim, steps)

    @torch.no_grad()
    def values(self, batch: SequenceBatch) -> Tensor:
        """V(x_<t) [B, T] (float32, CPU), 0 off the action mask."""
        self.model.eval()
        out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
        for rows in micro_batches(batch, self.cfg.algo.micro_batch_tokens):
            v = critic_values(self.model, batch, rows)
            out[rows, : v.shape[1]] = v.float().cpu()
        return out * batch.action_mask

    def update(self, exp: Experience) -> dict[str, float]:
        """Critic epochs over the experience; returns critic/* metrics averaged over optimizer steps."""
        self.model.train()
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(self.cfg.critic.epochs):
            for rows in split_rows(len(exp.rewards), self.cfg.algo.mini_batches):
                for k, v in self._optimizer_step(exp.select(rows)).items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        return {f"critic/{k}": v / max(1, steps) for k, v in sums.items()}

    def _optimizer_step(self, mb: Experience) -> dict[str, float]:
        num_tokens, num_seqs = step_denominators([mb.tokens.action_mask])
        totals: dict[str, float] = {"loss": 0.0}
        for rows in micro_batches(mb.tokens, self.cfg.algo.micro_batch_tokens):
            micro = mb.select(rows)
            mask = micro.tokens.action_mask
            v = critic_values(self.model, mb.tokens, rows)
            per_tok, metrics = value_loss(
                v,
                micro.values.to(v.device),
                micro.returns.to(v.device),
                mask.to(v.device),
                clip_eps=self.cfg.algo.value_clip or None,
            )
            loss, _ = AGGREGATIONS["token_mean"](
                per_tok, mask.to(v.device), num_tokens=num_tokens, num_seqs=num_seqs
            )
            loss.backward()
            share = float(mask.sum()) / num_tokens
            totals["loss"] += float(loss.detach())
            for k, val in metrics.items():
                totals[k] = totals.get(k, 0.0) + val * share
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return totals

    def save(self, folder: str) -> None:
        path = Path(folder)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_state(),
        }
        torch.save(state, path / STATE_FILE)

    def load(self, folder: str) -> None:
        from relayrl.trainers.checkpoint import load_weights_into

        path = Path(folder)
        load_weights_into(self.model, path)
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
