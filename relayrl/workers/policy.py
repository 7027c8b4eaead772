"""PolicyWorker: the actor. Owns the policy model, its optimizer / scheduler, optional EMA, and the rollout
engine + agent executor colocated with it (the engine reads the policy's parameters in place).

Methods (called by the controller through a RoleHandle, in-process or on a Ray actor):

    rollout(samples, seed, eval=False) -> list[Trajectory]     sample n per prompt through the executor
    logprobs(batch: SequenceBatch) -> Tensor [B, T]               old log-probs (no grad)
    update(exp: Experience, kl_coef) -> metrics                epochs x mini-batches x token-budget micro-batches
    sync() -> None                                             weights to the engine (load_weights(None))
    save(folder) / load(folder)                                full state for checkpoints (HF model folder +
                                                               worker_state.pt: optimizer, scheduler, EMA, RNG)
    export(folder)                                             HF model + tokenizer (EMA weights when on)

The update normalises every micro-batch's loss by the *global* denominator of its optimizer step (number of
action tokens / sequences of the whole mini-batch, or Dr. GRPO's constant), so gradients do not depend on
how the mini-batch is split into micro-batches (relayrl.algorithms.aggregation).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from relayrl.agents.base import PromptSample, Trajectory
from relayrl.algorithms.aggregation import step_denominators
from relayrl.config.rl import RLConfig
from relayrl.rollout.base import SamplingParams
from relayrl.workers.base import Experience, SequenceBatch, split_rows
from relayrl.workers.builders import (
    build_engine_for,
    build_executor,
    build_policy_model,
    build_policy_optim,
    policy_loss_step,
    setup_process,
)
from relayrl.workers.model_ops import masked_logprobs, micro_batches

STATE_FILE = "worker_state.pt"


class PolicyWorker:
    """The actor role (see module doc)."""

    def __init__(self, cfg: RLConfig, total_steps: int) -> None:
        setup_process(cfg.train.seed)
        self.cfg = cfg
        self.model, self.tokenizer = build_policy_model(cfg)
        self.device = next(self.model.parameters()).device
        self.optimizer, self.scheduler = build_policy_optim(
            self.model, cfg.optim, total_steps * self._opt_steps()
        )
        self.ema = (
            {k: v.detach().clone() for k, v in self.model.state_dict().items()} if cfg.ema > 0 else None
        )
        self.engine = build_engine_for(cfg, self.model, self.tokenizer)
        self.executor = build_executor(cfg, self.engine, self.tokenizer)

    def _opt_steps(self) -> int:
        return max(1, self.cfg.algo.epochs * self.cfg.algo.mini_batches)

    # ----------------------------------------------------------------------------------------- rollout
    def sampling_params(self, *, eval: bool = False, seed: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        if eval:
            e = self.cfg.eval
            return SamplingParams(
                n=e.n_samples, temperature=e.temperature, max_new_tokens=r.max_new_tokens, seed=seed
            )
        return SamplingParams(
            n=r.n_samples,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            seed=seed,
        )

    def rollout(self, samples: list[PromptSample], seed: int, eval: bool = False) -> list[Trajectory]:
        """n trajectories per prompt, grouped (a prompt's samples are contiguous). Request seeds derive from
        `seed` and the prompt's dataset index, so a resumed run samples exactly what the original did."""
        self.model.eval()
        base = self.sampling_params(eval=eval)

        async def run() -> list[list[Trajectory]]:
            jobs = [
                self.executor.execute(s, replace(base, seed=(seed * 1_000_003 + s.index * 7919) % (2**31)))
                for s in samples
            ]
            return list(await asyncio.gather(*jobs))

        with torch.no_grad():
            groups = asyncio.run(run())
        return [t for g in groups for t in g]

    # ----------------------------------------------------------------------------------------- experience
    @torch.no_grad()
    def logprobs(self, batch: SequenceBatch) -> Tensor:
        """log pi_old(x_t | x_<t) [B, T] under the sampling temperature (0 where not an action)."""
        self.model.eval()
        return masked_logprobs(
            self.model, batch, self.cfg.algo.micro_batch_tokens, self.cfg.rollout.temperature
        )

    # ----------------------------------------------------------------------------------------- update
    def update(self, exp: Experience, kl_coef: float) -> dict[str, float]:
        """Policy update over epochs x mini-batches; returns train/* metrics averaged over optimizer steps."""
        self.model.train()
        a = self.cfg.algo
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(a.epochs):
            for rows in split_rows(len(exp.rewards), a.mini_batches):
                metrics = self._optimizer_step(exp.select(rows), kl_coef)
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + v
                steps += 1
        self._ema_update()
        out = {f"train/{k}": v / steps for k, v in sums.items()}
        out["train/lr"] = float(self.scheduler.get_last_lr()[0])
        return out

    def _optimizer_step(self, mb: Experience, kl_coef: float) -> dict[str, float]:
        num_tokens, num_seqs = step_denominators([mb.tokens.action_mask])
        totals: dict[str, float] = {}
        if num_tokens > 0:
            for rows in micro_batches(mb.tokens, self.cfg.algo.micro_batch_tokens):
                metrics = policy_loss_step(
                    self.model, mb, rows, self.cfg, kl_coef=kl_coef, num_tokens=num_tokens, num_seqs=num_seqs
                )
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + v
        max_norm = self.cfg.optim.max_grad_norm or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        totals["grad_norm"] = float(grad_norm)
        return totals

    def _ema_update(self) -> None:
        if self.ema is None:
            return
        d = self.cfg.ema
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                if v.is_floating_point():
                    self.ema[k].mul_(d).add_(v.detach(), alpha=1 - d)

    # ----------------------------------------------------------------------------------------- sync
    def sync(self) -> None:
        """The weights changed in place: tell the colocated engine (drops weight-dependent caches)."""
        self.engine.load_weights(None)

    # ----------------------------------------------------------------------------------------- state
    def save(self, folder: str) -> None:
        """Model (HF folder, + tokenizer) and worker_state.pt (optimizer, scheduler, EMA, this process's RNG)."""
        path = Path(folder)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "ema": self.ema,
                "rng": _rng_state(),
            },
            path / STATE_FILE,
        )

    def load(self, folder: str) -> None:
        """Restore everything `save` wrote, in place."""
        from relayrl.trainers.checkpoint import load_weights_into

        path = Path(folder)
        load_weights_into(self.model, path)
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.ema = state["ema"]
        _set_rng_state(state["rng"])
        self.sync()

    def export(self, folder: str) -> str:
        """Save the final HF model (EMA weights when EMA is on) and tokenizer; returns the folder."""
        path = Path(folder)
        if self.ema is not None:
            current = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(self.ema)
            self.model.save_pretrained(path)
            self.model.load_state_dict(current)
        else:
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return str(path)

    def info(self) -> dict[str, Any]:
        """Facts the controller needs: pad / eos ids, parameter count."""
        return {
            "pad_id": int(self.tokenizer.pad_token_id),
            "eos_id": int(self.tokenizer.eos_token_id),
            "params": sum(p.numel() for p in self.model.parameters()),
        }

    def close(self) -> None:
        self.engine.close()


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(s: dict[str, Any]) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])
