"""Rollout-test fixtures: a tiny Qwen2 with large random weights, so greedy outputs are diverse (the
default init is near-uniform and repeats one token, which would make equality tests weak)."""

from __future__ import annotations

import pytest
import torch


def make_lively(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Re-draw every matrix (not the norms) from N(0, std^2) under `seed`; returns the model (eval, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture()
def lively_model(tiny_model):
    return make_lively(tiny_model)


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer):
    texts = ["12+34=", "hello world, how are you", "a", "The quick brown fox jumps", "7*8="]
    return [tiny_tokenizer(t)["input_ids"] for t in texts]
