"""Fixtures for task tests: the reference engine over the tiny model."""

from __future__ import annotations

import pytest


@pytest.fixture()
def engine(tiny_model, tiny_tokenizer):
    from relayrl.rollout.hf import HFEngine

    eng = HFEngine(tiny_model.eval(), tiny_tokenizer, max_seq_len=512)
    yield eng
    eng.close()
