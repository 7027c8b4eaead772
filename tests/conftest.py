"""Shared fixtures: tiny models and tokenizers are built here, never downloaded."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from relayrl.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    """A fresh fp32 2-layer Qwen2 (hidden 64) per test."""
    from relayrl.models.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=64, layers=2, seed=0))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A saved tiny model + tokenizer folder, loadable by from_pretrained."""
    from relayrl.models.tiny import save_tiny

    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
