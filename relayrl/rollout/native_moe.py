"""Mixture-of-experts layers (Qwen3-MoE, Mixtral) for the native engine and the trainer: top-k routing with
fp32 router logits, experts as grouped matmuls, routes that can be recorded and forced (routing replay).

Both transformers layouts (5.x) hold a sparse block `mlp` with a router `mlp.gate` (weight [E, hidden]) and
`mlp.experts` whose weights are 3-D: gate_up_proj [E, 2 I, hidden] (gate rows first, then up), down_proj
[E, hidden, I]. They differ only in the router's details, read from the config (`RouterSpec`):

    qwen3_moe   probs = softmax(logits); top-k of probs; renormalised to sum 1 when norm_topk_prob
    mixtral     the same, always renormalised

Departure from transformers, on purpose and on both sides (engine and trainer run this same code): the router
logits are computed in fp32 (hidden and router weight cast up) instead of the model dtype, and the expert
outputs are combined in fp32 (sum over k of weight * expert output, one cast at the end). In fp32 models this is
HF's maths exactly; in bf16 it removes most of the route flips that bf16 router logits cause.

    spec = router_spec(config)
    logits = router_logits(x [N, hidden], gate_weight)          fp32 [N, E]
    weights, idx = select_experts(logits, spec, forced=None)     fp32 [N, k], long [N, k]
        forced [N, k] (routing replay): these experts instead of the top-k (rows holding -1 keep their own
        top-k); the weights are still the router's probabilities of the chosen experts (renormalised), so
        the router keeps its gradient.
    out = experts_forward(x, idx, weights, experts)              [N, hidden] in x's dtype

`experts_forward` runs grouped: the N * k (token, expert) pairs sorted by expert, one grouped GEMM for every
expert's gate/up and one for down (`torch.nn.functional.grouped_mm`, offsets computed on the device: static
shapes, so a decode step with it can be captured in a CUDA graph), the results put back in token order and
summed over k in a fixed order (deterministic: no atomics). Where grouped_mm cannot run (no kernel, or a
gradient is needed on a CPU, where torch has no grouped_mm backward) it loops over the experts hit, with the
same products.

`MoEForward` is the callable DecoderRunner (native_model.py) uses for a sparse block: it keeps the last call's
chosen experts in `last_idx` (the engine records them per token for routing replay). With the engine's fused
kernels on, it routes (softmax + top-k + renormalise) and runs the experts of small calls (decode) through
moe_kernels.py's Triton kernels instead: the same products and roundings in 4 launches a layer instead of ~25
(no sort, no host sync; docs/rollout.md, "Mixture-of-experts decode").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from relayrl.rollout import moe_kernels

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""Model types whose sparse blocks this module runs."""

_HAS_GROUPED_MM = hasattr(F, "grouped_mm")


@dataclass(frozen=True, slots=True)
class RouterSpec:
    """How a model type routes (read from its config)."""

    top_k: int
    """Experts per token (num_experts_per_tok)."""
    num_experts: int
    """Experts per layer."""
    normalize: bool
    """Renormalise the top-k probabilities to sum 1."""


def router_spec(config: Any) -> RouterSpec:
    """The routing rule of a qwen3_moe or mixtral config."""
    mtype = getattr(config, "model_type", None)
    if mtype == "mixtral":
        return RouterSpec(
            top_k=config.num_experts_per_tok, num_experts=config.num_local_experts, normalize=True
        )
    if mtype == "qwen3_moe":
        return RouterSpec(
            top_k=config.num_experts_per_tok,
            num_experts=config.num_experts,
            normalize=bool(config.norm_topk_prob),
        )
    raise NotImplementedError(
        f"mixture-of-experts routing: model type {mtype!r} is not one of {MOE_MODEL_TYPES}"
    )


def is_sparse_block(mlp: object) -> bool:
    """A transformers sparse MoE block with 3-D expert weights (router `gate`, `experts.gate_up_proj`)."""
    experts = getattr(mlp, "experts", None)
    gate = getattr(mlp, "gate", None)
    return isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor) and isinstance(
        getattr(gate, "weight", None), torch.Tensor
    )


def moe_layer_indices(model: torch.nn.Module) -> list[int]:
    """Indices of the decoder layers whose `mlp` is a sparse block (routes are recorded for these only)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return [i for i, layer in enumerate(layers) if is_sparse_block(getattr(layer, "mlp", None))]


def router_logits(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [N, E] of hidden states x [N, hidden] (autocast off: it would compute them in bf16)."""
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), gate_weight.float())


def select_experts(
    logits: torch.Tensor, spec: RouterSpec, forced: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [N, k], expert ids long [N, k]) from fp32 logits [N, E]; `forced` [N, k] replays routes
    (rows with -1 take their own top-k; module doc)."""
    probs = torch.softmax(logits, dim=-1)
    weights, idx = torch.topk(probs, spec.top_k, dim=-1)
    if forced is not None:
        forced = forced.to(device=idx.device, dtype=torch.long)
        idx = torch.where(forced[:, :1] >= 0, forced, idx)
        weights = probs.gather(-1, idx)
    if spec.normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, idx


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _HAS_GROUPED_MM:
        return F.grouped_mm(x, w, offs=offs)
    return torch._grouped_mm(x, w, offs=offs)  # torch < 2.10  # pyright: ignore[reportPrivateImportUsage]


def _grouped_ok(x: torch.Tensor, gate_up: torch.Tensor) -> bool:
    if not (_HAS_GROUPED_MM or hasattr(torch, "_grouped_mm")):
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and gate_up.dtype == torch.bfloat16
    grad = torch.is_grad_enabled() and (x.requires_grad or gate_up.requires_grad)
    return _HAS_GROUPED_MM and not grad  # torch has no CPU grouped_mm backward


def _act(h: torch.Tensor, act: Any) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return act(gate) * up


Weights = tuple[torch.Tensor, torch.Tensor, Any]
"""(gate_up [E, 2 I, hidden], down [E, hidden, I], activation)."""


def _grouped(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w: Weights) -> torch.Tensor:
    gate_up, down, act = w
    n, k = idx.shape
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]  # [N k, hidden], grouped by expert
    h = _grouped_mm(xs, gate_up.transpose(1, 2), offs)
    y = _grouped_mm(_act(h, act), down.transpose(1, 2), offs)
    y = y.float() * weights.reshape(-1)[order, None]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=x.device)
    return y[inv].view(n, k, -1).sum(dim=1)


def _looped(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w: Weights) -> torch.Tensor:
    gate_up, down, act = w
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == e)
        h = _act(F.linear(x[tok], gate_up[e]), act)
        y = F.linear(h, down[e]).float() * weights[tok, slot, None]
        out = out.index_add(0, tok, y)
    return out


def experts_forward(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts: Any) -> torch.Tensor:
    """sum_k weights[:, k] * expert_{idx[:, k]}(x), expert(x) = down(act(gate(x)) * up(x)); x [N, hidden],
    returned in x's dtype (under CUDA autocast: the expert weights and x cast to the autocast dtype, as
    autocast would cast a Linear's)."""
    w: Weights = (experts.gate_up_proj, experts.down_proj, experts.act_fn)
    dtype = x.dtype
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        w, x = (w[0].to(dtype), w[1].to(dtype), w[2]), x.to(dtype)
    out = _grouped(x, idx, weights, w) if _grouped_ok(x, w[0]) else _looped(x, idx, weights, w)
    return out.to(dtype)


class MoEForward:
    """A sparse block as the native engine runs it (module doc); `last_idx` [N, k]: the experts of the last
    call's tokens. With `kernels` (the engine's fused decode kernels are on and the experts use SiLU) the
    routing's softmax / top-k and the routed experts run as moe_kernels.py's Triton kernels (the experts for
    calls of at most moe_kernels.MAX_PAIRS (token, expert) pairs: decode; prefill keeps the grouped GEMMs)."""

    def __init__(self, block: torch.nn.Module, spec: RouterSpec, kernels: bool = False) -> None:
        sparse: Any = block  # a transformers sparse block (is_sparse_block)
        self.gate_weight: torch.Tensor = sparse.gate.weight
        self.experts = sparse.experts
        self.spec = spec
        self.kernels = kernels and moe_kernels.supports(self.experts)
        """Route and run the experts through moe_kernels.py (set from the engine's fused_kernels)."""
        self.last_idx: torch.Tensor | None = None
        self.forced: torch.Tensor | None = None
        """Routes to force on the next call ([N, k], -1 rows route freely); used once, then cleared."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = router_logits(flat, self.gate_weight)
        if self.kernels and self.forced is None:
            weights, idx = moe_kernels.select_experts(logits, self.spec.top_k, self.spec.normalize)
        else:
            weights, idx = select_experts(logits, self.spec, self.forced)
        self.forced = None
        self.last_idx = idx
        gate_up = self.experts.gate_up_proj
        if self.kernels and moe_kernels.fits(flat, gate_up, self.spec.top_k):
            out = moe_kernels.fused_experts(flat.contiguous(), idx, weights, gate_up, self.experts.down_proj)
        else:
            out = experts_forward(flat, idx, weights, self.experts)
        return out.view(shape)
