"""Fused q/k/v and gate/up projections for the native engine's own weight copies.

A decode step at 7B is a handful of matrix-vector products per layer; one [q; k; v] GEMM instead of three and
one [gate; up] GEMM instead of two saves launches and reads each activation once. `fuse_projections(model)`
lays each layer's q/k/v weights (and biases) out as row blocks of ONE contiguous buffer, and gate/up likewise,
and rebinds the parameters to views of it (`param.data = fused[a:b]`): the parameters keep their HF names and
objects, so every weight transport that writes them in place (LocalWeights' cast-copy and FSDP gather,
`load_named_tensors`, the broadcast receivers, the tensor-parallel refresh) writes the fused buffer, and the
weight canary, which compares those parameters, covers exactly what the fused GEMMs read. Nothing to refresh
separately, no second copy.

    fused = fuse_projections(model)     layers fused (0: nothing plain to fuse)
    qkv_weights(attn) -> (weight [(H + 2 Hkv) D, hidden], bias or None, (nq, nk, nv)) or None
    gate_up_weight(mlp) -> weight [2 I, hidden] or None

Only plain `nn.Linear` projections without hooks are fused (LoRA-wrapped or hooked ones are left alone), and
only in a model none of whose parameters train (`requires_grad` False everywhere: an engine's own copy,
LocalWeights' copy / gather, a tensor-parallel shard, a frozen model loaded to generate or serve). A module
that trains, even partly (a LoRA model's frozen base), is never re-laid out: views of one buffer share a
storage, which `save_pretrained` would take for tied weights, and an optimizer or a device move that rebinds
`param.data` would leave the fused buffer stale.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

QKV_ATTR = "_relayrl_qkv"
GATE_UP_ATTR = "_relayrl_gate_up"

FusedQKV = tuple[torch.Tensor, torch.Tensor | None, tuple[int, int, int]]
"""(weight [nq + nk + nv, hidden], bias [nq + nk + nv] or None, (nq, nk, nv))."""


def _plain(modules: Sequence[object]) -> bool:
    return all(type(m) is torch.nn.Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in modules)


@torch.no_grad()
def _fuse(linears: Sequence[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One buffer holding the linears' weights as row blocks (biases likewise, all or none); the parameters
    become views of it."""
    weight = torch.cat([m.weight.data for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.data for m in linears if m.bias is not None]) if all(has_bias) else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = weight[row : row + n]
        if bias is not None and m.bias is not None:
            m.bias.data = bias[row : row + n]
        row += n
    return weight, bias


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse every decoder layer's q/k/v (when their biases are all present or all absent) and gate/up (no
    biases) projections of a Llama-layout HF model whose parameters are all frozen (module doc); returns the
    layers whose q/k/v were fused."""
    if any(p.requires_grad for p in model.parameters()):
        return 0
    body = getattr(model, "model", None)
    layers = getattr(body, "layers", None) or []
    fused = 0
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        qkv = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if _plain(qkv) and getattr(attn, QKV_ATTR, None) is None:
            linears = [m for m in qkv if isinstance(m, torch.nn.Linear)]
            if len({m.bias is None for m in linears}) == 1:
                weight, bias = _fuse(linears)
                sizes = (linears[0].weight.shape[0], linears[1].weight.shape[0], linears[2].weight.shape[0])
                setattr(attn, QKV_ATTR, (weight, bias, sizes))
                fused += 1
        gu = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
        if _plain(gu) and getattr(mlp, GATE_UP_ATTR, None) is None:
            linears = [m for m in gu if isinstance(m, torch.nn.Linear)]
            if all(m.bias is None for m in linears) and linears[0].weight.shape == linears[1].weight.shape:
                setattr(mlp, GATE_UP_ATTR, _fuse(linears)[0])
    return fused


def qkv_weights(attn: object) -> FusedQKV | None:
    """The fused q/k/v of an attention module (`fuse_projections`), or None."""
    return getattr(attn, QKV_ATTR, None)


def gate_up_weight(mlp: object) -> torch.Tensor | None:
    """The fused [gate; up] weight of an MLP module (`fuse_projections`), or None."""
    return getattr(mlp, GATE_UP_ATTR, None)
