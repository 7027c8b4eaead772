"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the 2-D hidden weights; AdamW for the rest.

    opt = Muon(muon_param_groups(named_params, weight_decay=0.01), lr=1e-3, momentum=0.95)

Papers: K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024, the quintic
Newton-Schulz iteration and its coefficients); J. Liu et al. (Moonshot AI), "Muon is Scalable for LLM Training"
(2025, the update scale and decoupled weight decay). Per 2-D hidden weight W of shape (A, B), with gradient G:

    M  <- mu M + G                               momentum buffer (fp32, sharded like W)
    U  <- G + mu M                               Nesterov (Moonshot's form)
    O  <- NS5(U)                                 ~ U V^T of U's SVD: every singular value pushed to ~[0.7, 1.2]
    W  <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O

NS5 is Jordan's quintic: X <- X / ||X||_F, then 5 times X <- a X + (b S + c S^2) X with S = X X^T (on the
shorter side), (a, b, c) = (3.4445, -4.7750, 2.0315). The scale is Moonshot's 0.2 sqrt(max(A, B)), NOT
Jordan's sqrt(max(1, A/B)): it makes the update's RMS ~0.2, that of a typical AdamW update, so Muon takes the
same `lr` and `weight_decay` as the AdamW parameters beside it (one schedule drives both). The iteration runs
in bf16 on CUDA (as Jordan's), in the gradient's own dtype elsewhere (fp32 on CPU; fp64 in the tests).

Embeddings, the LM head, value / reward heads (`score`) and every 1-D parameter (norms, biases) use AdamW (the
same formula as torch.optim.AdamW, weight decay on matrices only), as in both papers: `muon_param_groups`.

Gradient clipping: TrainStep clips the RAW gradient (global norm) before `step()`; Muon's momentum therefore
accumulates clipped gradients and Newton-Schulz runs on them. The orthogonalised update is never clipped: its
norm is fixed by construction (every singular value ~1), so clipping it would only rescale the learning rate of
whichever step happened to have a large norm elsewhere (OpenRLHF's warning about clipping after Newton-Schulz).

FSDP2 (DTensor parameters sharded on dim 0): the iteration needs the whole matrix. Each rank all-gathers U
(`full_tensor()`), runs NS5 on the full matrix, and keeps its own rows (`distribute_tensor(...,
src_data_rank=None)`: a local slice, no communication). Every rank computes the same full update from the same
gathered input, so the shards agree. Chosen over round-robin ownership + broadcast because it needs one
collective per matrix (an all-gather, the size FSDP's own forward gathers) instead of a gather to the owner plus
a broadcast back, keeps no ownership table, and is exact whatever the rank count; the cost is NS5 computed
N times (small next to the forward/backward of a training step: ~15 (A x B x min(A, B)) flops per matrix).
Momentum buffers stay sharded (elementwise ops on DTensors).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFS = (3.4445, -4.7750, 2.0315)
"""Jordan's quintic Newton-Schulz coefficients (a, b, c)."""
NS_STEPS = 5
"""Newton-Schulz iterations per update."""
ADAMW_NAMES = ("embed", "lm_head", "wte", "wpe", "score", "value_head", "v_head")
"""A 2-D parameter whose (lower-cased) name contains one of these is an embedding or an output head: AdamW."""


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, eps: float = 1e-7) -> torch.Tensor:
    """Jordan's quintic Newton-Schulz orthogonalisation of a 2-D tensor (see module doc), in `g`'s dtype (bf16
    on CUDA); returns a tensor of `g`'s shape and dtype."""
    if g.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D tensor, got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFS
    x = g.to(torch.bfloat16) if g.is_cuda else g
    x = x / (x.norm() + eps)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    for _ in range(steps):
        s = x @ x.mT
        x = a * x + (b * s + c * (s @ s)) @ x
    if tall:
        x = x.mT
    return x.to(g.dtype)


def muon_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """Moonshot's update scale 0.2 sqrt(max(A, B)) for a matrix of shape (A, B): the update's RMS ~0.2."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """True for a 2-D hidden weight (both sides > 1, not an embedding or head by `ADAMW_NAMES`)."""
    lowered = name.lower()
    return p.ndim == 2 and min(p.shape) > 1 and not any(k in lowered for k in ADAMW_NAMES)


def muon_param_groups(
    named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Groups for `Muon`: the 2-D hidden weights (`uses_muon`, weight decay `weight_decay`); AdamW matrices
    (embeddings, heads; decay) and AdamW 1-D / norm parameters (no decay). Empty groups are dropped."""
    muon, decay, no_decay = [], [], []
    for name, p in named:
        if not p.requires_grad:
            continue
        if uses_muon(name, p):
            muon.append(p)
        elif p.ndim < 2 or name.endswith(".bias") or "norm" in name.lower():
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": muon, "weight_decay": weight_decay, "use_muon": True},
        {"params": decay, "weight_decay": weight_decay, "use_muon": False},
        {"params": no_decay, "weight_decay": 0.0, "use_muon": False},
    ]
    return [g for g in groups if g["params"]]


def _orthogonalised(u: torch.Tensor) -> torch.Tensor:
    """NS5(u) scaled; for a sharded DTensor: gather, orthogonalise the whole matrix, keep this rank's shard."""
    full = getattr(u, "full_tensor", None)
    if full is None:
        return newton_schulz(u) * muon_scale(u.shape)
    assert isinstance(u, DTensor)
    whole = newton_schulz(full()) * muon_scale(u.shape)
    return distribute_tensor(whole, u.device_mesh, u.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """Muon for the groups marked `use_muon`, AdamW for the others (module doc has the formulas).

    Group keys: lr, weight_decay, use_muon; momentum (Muon); betas, eps (AdamW). State: `momentum_buffer`
    (Muon); `step` (0-dim tensor), `exp_avg`, `exp_avg_sq` (AdamW)."""

    def __init__(
        self,
        params: list[dict[str, Any]],
        *,
        lr: float,
        momentum: float = 0.95,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"optim.muon_momentum must be in [0, 1), got {momentum}")
        defaults = {"lr": lr, "momentum": momentum, "betas": betas, "eps": eps, "weight_decay": 0.0}
        super().__init__(params, defaults)
        for g in self.param_groups:
            g.setdefault("use_muon", False)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon(group, params)
            else:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in params:
            grad = p.grad
            assert grad is not None
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(grad)
            update = _orthogonalised(grad.add(buf, alpha=mu))
            p.mul_(1.0 - lr * wd)
            p.add_(update, alpha=-lr)

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in params:
            grad = p.grad
            assert grad is not None
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] = state["step"] + 1  # a new tensor: a loaded state_dict may share the old one
            t = float(state["step"])
            p.mul_(1.0 - lr * wd)
            state["exp_avg"].lerp_(grad, 1.0 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1.0 - beta2**t)).add_(eps)
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1.0 - beta1**t))
