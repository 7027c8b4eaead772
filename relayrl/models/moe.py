"""Mixture-of-experts models (Qwen3-MoE, Mixtral) in training: the sparse blocks run the native engine's routing
(rollout/native_moe.py: fp32 router logits, grouped experts), routes can be replayed, router logits collected
for the load-balancing (aux) loss.

    install_moe(model)                     once after loading (models/loading.py does it): every sparse block's
                                           forward becomes `_block_forward` (no-op for a dense model)
    with moe_pass(lengths, routes=r, collect=True) as p:       around ONE forward of sequences of `lengths`
        logp, _ = token_logprobs(model, seqs, layout)
    aux = p.aux_loss()                     Switch-Transformer load balancing, as transformers'
                                           load_balancing_loss_func (OpenRLHF's aux_loss_coef multiplies it)

Routing replay (rollout.routing_replay): `routes` [N, MoE layers, k] int (N = sum(lengths), the sequences'
tokens in order, as the engine recorded them: Completion.routes) forces each token's experts in each MoE layer
(rows with -1 route freely); the weights are still the router's current probabilities of those experts, so
the router trains. The engine and the trainer then agree on every route, which removes the route flips that
are the main source of MoE train-inference mismatch (R3, "Rollout Routing Replay", Ma et al. 2025; verl's
routing replay). Without it a bf16 rounding difference can send a token to another expert on one side only.

The blocks see the trunk's [B, T, hidden] input: one packed row (varlen: B = 1, T = N) or right-padded rows
(padded: B = len(lengths), T = max(lengths)); `_Pass.real_rows` maps flat token i to its row there. Padding
tokens route freely and are left out of the aux loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from relayrl.rollout.native_moe import (
    RouterSpec,
    experts_forward,
    is_sparse_block,
    router_logits,
    router_spec,
    select_experts,
)

_INSTALLED = "_relayrl_moe"


@dataclass(slots=True)
class _Pass:
    """One forward's routing inputs and outputs (see module doc)."""

    lengths: list[int]
    routes: Tensor | None = None
    """[N, MoE layers, k] routes to force, or None."""
    collect: bool = False
    logits: list[Tensor] = field(default_factory=list)
    """fp32 [N, E] router logits of the real tokens, one per MoE layer called (when `collect`)."""
    taken: list[Tensor] = field(default_factory=list)
    """long [N, k] experts each MoE layer chose for the real tokens (always recorded; tests, metrics)."""
    spec: RouterSpec | None = None

    def real_rows(self, b: int, t: int, device: torch.device) -> Tensor | None:
        """Index of each real token's row in the block's flattened [b * t] input; None for another layout
        (a sequence-parallel rank's slice) when no routes are replayed (every row then counts)."""
        n = sum(self.lengths)
        if b == 1 and t == n:
            return torch.arange(n, device=device)
        if b == len(self.lengths) and t == max(self.lengths):
            return torch.cat([torch.arange(L, device=device) + i * t for i, L in enumerate(self.lengths)])
        if self.routes is None:
            return None
        raise ValueError(
            f"mixture-of-experts pass over {len(self.lengths)} sequences ({n} tokens) met a [{b}, {t}] block "
            "input: only the varlen (one packed row) and padded (one row per sequence) layouts are supported"
        )

    def aux_loss(self) -> Tensor | None:
        """E * sum_e f_e * P_e over every MoE layer's real tokens (transformers' load_balancing_loss_func):
        f_e the share of top-k assignments to expert e, P_e its mean router probability. None if nothing was
        collected."""
        if not self.logits or self.spec is None:
            return None
        logits = torch.cat(self.logits)
        probs = torch.softmax(logits, dim=-1)
        top = torch.topk(probs, self.spec.top_k, dim=-1).indices
        counts = torch.zeros(self.spec.num_experts, device=logits.device).index_add_(
            0, top.reshape(-1), torch.ones(top.numel(), device=logits.device)
        )
        rows = logits.shape[0]
        return self.spec.num_experts * torch.sum((counts / rows) * (probs.sum(0) / rows))


_ACTIVE: contextvars.ContextVar[_Pass | None] = contextvars.ContextVar("relayrl_moe_pass", default=None)


def _block_forward(self: Any, hidden: Tensor) -> Tensor:
    """A sparse block's forward (bound to the block by `install_moe`): route with fp32 logits (replayed when
    the active pass has routes), run the experts grouped (rollout/native_moe.py). Activation checkpointing
    re-runs this forward during backward, after the pass has ended: it then routes as the forward did (the
    forward's routing inputs are kept on the block, `_Recompute`), so the replayed experts and the saved
    tensors match."""
    b, t, h = hidden.shape
    flat = hidden.reshape(-1, h)
    spec: RouterSpec = self._relayrl_spec
    logits = router_logits(flat, self.gate.weight)
    state, forced, real, collect = _ACTIVE.get(), None, None, False
    if state is not None:
        state.spec = spec
        real = state.real_rows(b, t, flat.device)
        if state.routes is not None and real is not None:
            forced = torch.full((b * t, spec.top_k), -1, dtype=torch.long, device=flat.device)
            forced[real] = state.routes[:, self._relayrl_moe_index].to(flat.device, torch.long)
        collect = state.collect
        self._relayrl_recompute = (
            _Recompute(b * t, forced, real, collect) if torch.is_grad_enabled() else None
        )
    elif torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:  # a checkpointed recompute
        again: _Recompute | None = getattr(self, "_relayrl_recompute", None)
        if again is not None:
            if again.tokens != b * t:
                raise RuntimeError(
                    f"mixture-of-experts recompute over {b * t} tokens, the forward had {again.tokens}: "
                    "activation checkpointing must recompute each forward before the next one runs"
                )
            forced, real, collect = again.forced, again.real, again.collect
    else:
        self._relayrl_recompute = None
    if collect:  # (in a recompute only to save the same tensors as the forward; the pass keeps the forward's)
        kept = logits if real is None else logits[real]
        if state is not None:
            state.logits.append(kept)
    weights, idx = select_experts(logits, spec, forced)
    if state is not None:
        state.taken.append((idx if real is None else idx[real]).detach())
    return experts_forward(flat, idx, weights, self.experts).view(b, t, h)


@dataclass(slots=True)
class _Recompute:
    """A sparse block's routing inputs of its last forward with grad inside a pass, for its recompute."""

    tokens: int
    forced: Tensor | None
    real: Tensor | None
    collect: bool


def install_moe(model: torch.nn.Module) -> int:
    """Make every sparse MoE block of `model` (under a peft wrapper too) run `_block_forward`; returns the
    number of MoE layers (0 for a dense model). Idempotent."""
    base = getattr(model, "get_base_model", None)
    hf: Any = base() if callable(base) else model
    layers = getattr(getattr(hf, "model", None), "layers", None) or []
    blocks = [layer.mlp for layer in layers if is_sparse_block(getattr(layer, "mlp", None))]
    if not blocks or getattr(hf, _INSTALLED, False):
        return len(blocks)
    spec = router_spec(hf.config)
    for i, block in enumerate(blocks):
        block._relayrl_spec = spec
        block._relayrl_moe_index = i
        block.forward = types.MethodType(_block_forward, block)
    setattr(hf, _INSTALLED, True)
    return len(blocks)


@contextlib.contextmanager
def moe_pass(
    lengths: Sequence[int], *, routes: Tensor | None = None, collect: bool = False
) -> Iterator[_Pass]:
    """The routing context of one forward over sequences of `lengths` (module doc): `routes` [sum(lengths),
    MoE layers, k] to replay, `collect` router logits for `aux_loss()`."""
    if routes is not None and routes.shape[0] != sum(lengths):
        raise ValueError(f"routes cover {routes.shape[0]} tokens but the sequences hold {sum(lengths)}")
    state = _Pass(lengths=list(lengths), routes=routes, collect=collect)
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)
