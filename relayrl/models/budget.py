"""Micro-batch token budgets: 0 ("auto") picks one from the model's shape and the device's free memory.

    update, infer = token_budgets(model, device, update=0, infer=0, pending_bytes=...)

A training micro-batch costs a fixed host time (the Python of the forward, a kernel launch per op, the
loss's bookkeeping) whatever its size, so on a GPU a small model with a small budget is host-bound: the
GPU finishes each micro-batch's kernels long before the host has issued the next. Larger micro-batches
amortise that time; the loss contract (relayrl/training/step.py) keeps the update independent of the split.

    update budget (an explicit int > 0 is used as given)
        CPU      DEFAULT_TOKENS (4096), as before this module: the tests' numerics stay bit-identical
        CUDA     fraction x memory left / activation bytes per token, rounded down to a multiple of 1024
                 and clamped to [DEFAULT_TOKENS, MAX_TOKENS], where
                   memory left = free device memory + what torch holds reserved but unallocated
                                 - `pending_bytes` (optimizer states and gradients not allocated yet)
                   bytes per token = layers x (32 hidden + 5 intermediate x experts per token) x (2 for
                                 bf16 compute, 4 for fp32), or with activation checkpointing one layer
                                 of that plus layers x 2 hidden x (2 or 4) (the saved layer inputs)
                 The estimate is an upper bound of what docs/benchmarks.md's SFT runs measured (16,384-token
                 micro-batches: ~2.1 MiB a token for Qwen2.5-0.5B, ~3.9 MiB for 1.5B; estimate 2.4 / 5.0).
    inference budget (no gradient: only one layer's activations live at a time)
        CPU      the update budget
        CUDA     INFER_FACTOR (4) x the update budget, at most MAX_INFER_TOKENS

A mixture-of-experts config counts its expert width (moe_intermediate_size, else intermediate_size) times the
experts per token. In exact on-policy mode (rollout.exact: padded rows through the batch-invariant forward)
the policy uses DEFAULT_TOKENS where its budgets are left at 0. Budgets are resolved once per worker (at its
first pass, when the engine's KV cache and the weights are in place) and logged once; under a process group
the automatic ones are the smallest over the role's ranks (relayrl.workers.model_ops.TokenBudgets), so
sequence-parallel ranks cut the same micro-batches.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 4096
"""The CPU budget, and the smallest automatic GPU budget."""
MAX_TOKENS = 65536
"""The largest automatic update budget: beyond it a micro-batch's fixed host cost is already small."""
INFER_FACTOR = 4
"""Automatic inference budget = this x the update budget on a GPU."""
MAX_INFER_TOKENS = 262144
"""The largest automatic inference budget."""
MEMORY_FRACTION = 0.5
"""Share of the memory left that one micro-batch's activations may take (the rest: allocator fragmentation,
the LM-head chunks, the engine's cache growth)."""


def _base(model: Any) -> Any:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def _config(model: Any) -> Any:
    cfg = getattr(_base(model), "config", None)
    return getattr(cfg, "text_config", None) or cfg


def _checkpointing(model: Any) -> bool:
    base = _base(model)  # transformers 5 renamed is_gradient_checkpointing (deprecated) to this
    flag = getattr(base, "is_activation_checkpointing", None)
    return bool(flag if flag is not None else getattr(base, "is_gradient_checkpointing", False))


def bytes_per_token(model: Any, compute_bytes: int) -> int | None:
    """Activation bytes a training forward keeps per token (see module doc); None when the model's config
    does not say its shape (then the default budget is used)."""
    cfg = _config(model)
    hidden = getattr(cfg, "hidden_size", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(hidden, int) or not isinstance(layers, int):
        return None
    inter = (
        getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None) or 4 * hidden
    )
    k = max(1, int(getattr(cfg, "num_experts_per_tok", 1) or 1))  # a MoE token runs k experts' MLPs
    per_layer = (32 * hidden + 5 * int(inter) * k) * compute_bytes
    if _checkpointing(model):
        return per_layer + layers * 2 * hidden * compute_bytes
    return layers * per_layer


def _memory_left(device: torch.device) -> int:
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def token_budgets(
    model: Any,
    device: torch.device,
    *,
    update: int = 0,
    infer: int = 0,
    pending_bytes: int = 0,
    compute_dtype: torch.dtype = torch.bfloat16,
) -> tuple[int, int]:
    """(update budget, inference budget) in tokens: each explicit value > 0 as given, 0 automatic (module doc).
    `pending_bytes`: device memory the role will still allocate (optimizer states, fp32 gradients)."""
    if update < 0 or infer < 0:
        raise ValueError(f"token budgets must be >= 0 (0: auto), got update={update}, infer={infer}")
    auto_update = update == 0
    if auto_update:
        update = _auto_update(model, device, pending_bytes, compute_dtype)
    if infer == 0:
        infer = update if device.type != "cuda" else min(MAX_INFER_TOKENS, INFER_FACTOR * update)
    if auto_update or infer != update:
        log.info("micro-batch token budgets: update %d, inference %d (%s)", update, infer, device)
    return update, infer


def _auto_update(model: Any, device: torch.device, pending_bytes: int, compute_dtype: torch.dtype) -> int:
    if device.type != "cuda":
        return DEFAULT_TOKENS
    per_token = bytes_per_token(model, torch.finfo(compute_dtype).bits // 8)
    if per_token is None:
        return DEFAULT_TOKENS
    room = MEMORY_FRACTION * max(0, _memory_left(device) - pending_bytes)
    tokens = int(room // per_token) // 1024 * 1024
    return max(DEFAULT_TOKENS, min(MAX_TOKENS, tokens))


def pending_optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Device bytes a not-yet-stepped AdamW-like optimizer will add: two fp32 states and an fp32 gradient per
    trainable element (12 bytes; what this rank holds under FSDP). Once its states exist: the bytes of those
    not on their parameter's device, i.e. parked in host memory (dist.offload_optimizer_in_rollout) and back
    for the update (a resumed run resolves its budgets while they are parked)."""
    if optimizer.state:
        away = 0
        for p, state in optimizer.state.items():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and k != "step" and v.device != p.device:
                    away += _local_numel(v) * v.element_size()
        return away
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    return 12 * sum(_local_numel(p) for p in params)


def _local_numel(p: torch.Tensor) -> int:
    local = getattr(p, "to_local", None)  # a DTensor shard (FSDP2): this rank's part
    return int(cast(torch.Tensor, local()).numel()) if callable(local) else int(p.numel())
