"""Tiny Qwen3-MoE / Mixtral models with large random weights, so routes differ between tokens and greedy
outputs are diverse (the default init routes near-uniformly)."""

from __future__ import annotations

from typing import Any

import torch

from relayrl.models.tiny import TinyModelSpec, build_tiny_moe_model, build_tiny_tokenizer

MOE_LAYOUTS = ("qwen3", "mixtral")


def lively_moe(layout: str, seed: int = 0, experts: int = 8, top_k: int = 2) -> Any:
    """A 2-layer hidden-64 MoE model of `layout`, fp32, eval mode: matrices and expert weights re-drawn from
    N(0, 0.3^2), router weights from N(0, 1)."""
    spec = TinyModelSpec(hidden=64, layers=2, moe=layout, experts=experts, top_k=top_k, seed=seed)
    model = build_tiny_moe_model(build_tiny_tokenizer(), spec)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()
