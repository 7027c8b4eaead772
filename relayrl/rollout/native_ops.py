"""The native engine's per-layer operations over a Hugging Face decoder's live modules (DecoderRunner's parts).

Each function returns a callable equal to the HF module it stands in for, reading the module's live weights (so a
weight update needs no refresh): RMSNorm (`norm_fn`), Linear (`linear_fn`), the gated MLP (`mlp_fn`, optionally
through one fused gate/up GEMM and the fused SiLU x up kernel), rotary embedding (`rope`); a module they do not
recognise (LoRA-wrapped, hooked, another norm) is returned as it is and called. `norm_params` gives a plain
RMSNorm's (weight, eps) for the fused kernels, and `want_kernels` resolves whether decode uses them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.nn.functional as F

from relayrl.rollout.kernels import silu_mul_ref, usable
from relayrl.rollout.native_fused import gate_up_weight

TensorFn = Callable[[torch.Tensor], torch.Tensor]
"""A module or a fused function standing in for one (`norm_fn`, `linear_fn`, `mlp_fn`)."""


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) written as roll(x) = cat(x2, x1)
    times a sin table whose first half is negated (`DecoderRunner._rope_table`): the same products, one op
    fewer."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class _RMSNorm(Protocol):
    weight: torch.Tensor
    variance_epsilon: float


_PLAIN_RMSNORMS = {f"{name}RMSNorm" for name in ("Qwen2", "Qwen3", "Llama", "Mistral", "Qwen3Moe", "Mixtral")}


def norm_fn(module: torch.nn.Module) -> TensorFn:
    """A fused callable equal to HF's plain RMSNorm module (fp32 normalise, cast, times weight), reading the
    module's live weight; other norm modules are called as they are. Fewer kernels per decode step."""
    if type(module).__name__ not in _PLAIN_RMSNORMS or not hasattr(module, "variance_epsilon"):
        return module
    rms = cast(_RMSNorm, module)
    weight, eps = rms.weight, float(rms.variance_epsilon)
    shape = tuple(weight.shape)

    def norm(x: torch.Tensor) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype)

    def norm_fp32(x: torch.Tensor) -> torch.Tensor:  # the same products, the weight inside: one call
        return F.rms_norm(x, shape, weight, eps)

    return norm_fp32 if weight.dtype == torch.float32 else norm


def hooked(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def linear_fn(module: torch.nn.Module) -> TensorFn:
    """F.linear over a plain nn.Linear's live weight and bias (no module-call overhead per decode step);
    other modules (LoRA-wrapped projections) and hooked ones are called as they are."""
    if type(module) is not torch.nn.Linear or hooked(module):
        return module
    linear = cast(torch.nn.Linear, module)
    return lambda x: F.linear(x, linear.weight, linear.bias)


_PLAIN_MLPS = {f"{name}MLP" for name in ("Qwen2", "Qwen3", "Llama", "Mistral", "Qwen3Moe")}


def norm_params(module: torch.nn.Module) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a plain HF RMSNorm (the fused kernel's inputs), else None."""
    if type(module).__name__ not in _PLAIN_RMSNORMS or not hasattr(module, "variance_epsilon"):
        return None
    rms = cast(_RMSNorm, module)
    return rms.weight, float(rms.variance_epsilon)


def mlp_fn(mlp: torch.nn.Module, glu: Callable[..., torch.Tensor] = silu_mul_ref) -> TensorFn:
    """down(glu(gate(x), up(x))) over a plain HF gated MLP's live Linears, glu = silu(gate) * up (torch, the
    product in place, or the fused kernel: kernels.silu_mul); other MLP modules are called as they are."""
    projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = type(getattr(mlp, "act_fn", None)).__name__
    if type(mlp).__name__ not in _PLAIN_MLPS or act not in ("SiLUActivation", "SiLU") or hooked(mlp):
        return mlp
    if any(not isinstance(p, torch.nn.Module) for p in projs):
        return mlp
    down = linear_fn(cast(torch.nn.Module, projs[2]))  # a module (tensor-parallel row split) is called
    gate_up = gate_up_weight(mlp)
    if gate_up is not None:  # one GEMM for gate and up (native_fused.py)
        inter = gate_up.shape[0] // 2

        def fused(x: torch.Tensor) -> torch.Tensor:
            gu = F.linear(x, gate_up)
            return down(glu(gu[..., :inter], gu[..., inter:]))

        return fused
    if any(type(p) is not torch.nn.Linear or hooked(p) for p in projs[:2]):
        return mlp
    gate, up = (linear_fn(cast(torch.nn.Linear, p)) for p in projs[:2])

    def forward(x: torch.Tensor) -> torch.Tensor:
        return down(glu(gate(x), up(x)))

    return forward


def want_kernels(kernels: bool | None, device: torch.device, plain_norms: bool) -> bool:
    """Resolve DecoderRunner's `kernels` (None: on for CUDA when triton imports); True where they cannot run
    raises, naming why."""
    if kernels is False or (kernels is None and device.type != "cuda"):
        return False
    if not usable(device) or not plain_norms:
        if kernels:
            why = "a norm is not a plain HF RMSNorm" if usable(device) else "triton does not import here"
            raise ValueError(
                f"native engine: fused_kernels=True but {why} ({device}); pass fused_kernels=False"
            )
        return False
    return True
