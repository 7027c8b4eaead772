"""Construction of what the role workers own, in one place: models, optimizers, engine, executor, reward
source, and the per-micro-batch policy / critic loss. Workers call these; the controller never does.

    setup_process(seed)                        threads + seeds of a worker process (local or Ray actor)
    build_policy_model(model_cfg)              -> (causal LM, tokenizer)   via relayrl.models.loading
    build_policy_optim(model, optim_cfg, n)    -> (AdamW, LambdaLR)        via relayrl.trainers.core
    build_engine_for(cfg, model, tokenizer)    -> RolloutEngine           via relayrl.rollout.build_engine
    build_executor(cfg, engine, tokenizer)     -> AgentExecutorBase        single / multi-turn / user file
    build_policy_loss(algo)                    -> fn(PolicyLossInputs): the named loss, clip settings bound
    policy_loss_step(model, micro, mb, ...)    forward + loss + backward of one micro-batch -> metrics

The loss pieces are looked up by name in the algorithm registries (POLICY_LOSSES, KL_ESTIMATORS,
OFF_POLICY, AGGREGATIONS); there is no branching on algorithm names here.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from relayrl.config.rl import AlgoConfig, RLConfig, resolve_algo
from relayrl.workers.base import Experience


def setup_process(seed: int) -> None:
    """Seed python / numpy / torch; cap torch threads at the CPUs this process may use (2 on the demo box)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """ "auto" -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_policy_model(cfg: RLConfig, *, trainable: bool = True) -> tuple[torch.nn.Module, Any]:
    """The causal LM and tokenizer of `cfg.model` on `cfg.train.device` (a missing path is a clear error).
    A frozen copy (reference model) skips LoRA adapters and gradients."""
    from relayrl.models.loading import load_causal_lm, load_tokenizer

    m = cfg.model
    tokenizer = load_tokenizer(
        m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
    )
    model = load_causal_lm(m, device=resolve_device(cfg.train.device), lora=trainable)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model, tokenizer


def build_policy_optim(model: torch.nn.Module, optim_cfg: Any, total_steps: int) -> tuple[Any, Any]:
    """AdamW + warmup/decay schedule from the shared training core."""
    from relayrl.trainers.core import build_optimizer, build_scheduler

    opt = build_optimizer(
        model,
        lr=optim_cfg.lr,
        weight_decay=optim_cfg.weight_decay,
        betas=tuple(optim_cfg.adam_betas),
        eps=optim_cfg.eps,
    )
    sched = build_scheduler(
        opt,
        total_steps=max(1, total_steps),
        warmup_steps=optim_cfg.warmup_steps,
        warmup_ratio=optim_cfg.warmup_ratio,
        schedule=optim_cfg.scheduler,
        min_lr_ratio=optim_cfg.min_lr_ratio,
    )
    return opt, sched


def build_engine_for(cfg: RLConfig, model: torch.nn.Module, tokenizer: Any) -> Any:
    """The rollout engine colocated with the policy (reads `model`'s parameters in place)."""
    from relayrl.rollout import build_engine

    r = cfg.rollout
    opts: dict[str, Any] = {}
    if r.engine == "native":
        opts["max_slots"] = max(r.engine_slots or r.prompts_per_step * r.n_samples, cfg.eval.n_samples)
    return build_engine(r.engine, model, tokenizer, max_seq_len=r.max_len, **opts)


def build_executor(cfg: RLConfig, engine: Any, tokenizer: Any) -> Any:
    """single -> SingleTurnExecutor; multi -> the multi-turn task's executor (`rollout.agent_file` naming a
    built-in task, default `task.name`) or a MultiTurnExecutor over a user file's AgentInstance; a path
    ending in .py -> the user's AgentExecutor / AgentInstance."""
    from relayrl.agents.executors import SingleTurnExecutor, load_agent_from_file

    r = cfg.rollout
    if r.agent == "single":
        return SingleTurnExecutor(engine, tokenizer, max_total_len=r.max_len)
    source = (r.agent_file or cfg.task.name) if r.agent == "multi" else r.agent
    if source.endswith(".py"):
        return load_agent_from_file(
            source,
            engine,
            tokenizer,
            max_total_len=r.max_len,
            max_turns=r.max_turns,
            step_timeout=cfg.reward.timeout_s,
        )
    from relayrl.tasks import get_task

    task = get_task(source) if source else None
    if task is None or not hasattr(task, "executor"):
        raise ValueError(
            f"rollout.agent=multi needs a multi-turn agent: rollout.agent_file={source!r} is neither a .py file "
            "defining AgentInstance / AgentExecutor nor a multi-turn task (e.g. guess)"
        )
    return task.executor(engine, tokenizer, max_total_len=r.max_len, step_timeout=cfg.reward.timeout_s)


# --------------------------------------------------------------------------------------------- losses
def _no_correction(old: Tensor, rollout: Tensor, mask: Tensor, **_: Any) -> tuple[Tensor, Tensor, dict]:
    """Off-policy correction "none": weight 1, nothing masked."""
    return mask.to(old.dtype), torch.ones_like(mask, dtype=torch.bool), {}


def off_policy_registry() -> dict[str, Any]:
    """OFF_POLICY plus "none"."""
    from relayrl.algorithms.off_policy import OFF_POLICY

    return {"none": _no_correction, **OFF_POLICY}


def build_policy_loss(algo: AlgoConfig) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """POLICY_LOSSES[policy_loss] with the clip settings bound: `fn(PolicyLossInputs) -> (loss [B, T], m)`.
    Clip ranges the user and the preset left unset (None) go to the loss as None, so each loss applies its
    own documented default (ppo 0.2 / = eps_low, gspo 3e-4 / 4e-4, cispo 1.0 / 0.28)."""
    from relayrl.algorithms.policy_losses import POLICY_LOSSES

    a = resolve_algo(algo)
    return functools.partial(
        POLICY_LOSSES[a.policy_loss],
        eps_low=a.clip_eps_low,
        eps_high=a.clip_eps_high,
        dual_clip=a.dual_clip_c or None,
    )


def policy_loss_step(
    model: torch.nn.Module,
    mb: Experience,
    rows: list[int],
    cfg: RLConfig,
    *,
    kl_coef: float,
    num_tokens: float,
    num_seqs: float,
) -> dict[str, float]:
    """Forward the micro-batch `rows` of mini-batch `mb`, build its policy loss normalised by the mini-batch's
    global denominators (`num_tokens`, `num_seqs`, Dr. GRPO's `max_new_tokens`), so the sum of micro-batch
    gradients equals the whole mini-batch's gradient; backward. Returns this micro-batch's metrics weighted by
    its share of the mini-batch's action tokens (sum them over micro-batches)."""
    from relayrl.algorithms.aggregation import AGGREGATIONS
    from relayrl.algorithms.kl import kl_loss
    from relayrl.algorithms.policy_losses import PolicyLossInputs
    from relayrl.workers.model_ops import token_logprobs

    a = resolve_algo(cfg.algo)  # a no-op for a trainer's (already resolved) config
    micro = mb.select(rows)
    t = micro.tokens
    device = next(model.parameters()).device
    mask = t.action_mask.to(device)
    lp, ent = token_logprobs(model, mb.tokens, rows, temperature=cfg.rollout.temperature, entropy=True)
    old = micro.old_logprobs.to(device)
    is_weight, keep, off_metrics = off_policy_registry()[a.off_policy](
        old, t.rollout_logprobs.to(device), mask, low=a.off_policy_low, high=a.off_policy_high
    )
    inputs = PolicyLossInputs(
        logprobs=lp,
        old_logprobs=old,
        advantages=micro.advantages.to(device),
        action_mask=mask & keep,
        is_weight=is_weight if a.off_policy != "none" else None,
    )
    per_token, metrics = build_policy_loss(a)(inputs)
    if a.kl_mode == "loss" and micro.ref_logprobs is not None:
        kl_tok, kl_metrics = kl_loss(
            lp, micro.ref_logprobs.to(device), mask, coef=kl_coef, estimator=a.kl_estimator
        )
        per_token = per_token + kl_tok
        metrics["kl_loss"] = kl_metrics["kl"]
    if a.entropy_coef:
        per_token = per_token - a.entropy_coef * ent * mask
    loss, _ = AGGREGATIONS[a.aggregation](
        per_token,
        mask,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        norm_const=float(cfg.rollout.max_new_tokens),
    )
    loss.backward()
    share = float(mask.sum()) / max(1.0, num_tokens)
    summed = {k: v for k, v in {**metrics, **off_metrics}.items() if k not in ("ratio_min", "ratio_max")}
    out = {k: v * share for k, v in summed.items()}
    out["policy_loss"] = float(loss.detach())
    out["entropy"] = float((ent.detach() * mask).sum()) / max(1.0, num_tokens)
    return out
