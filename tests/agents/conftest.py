"""Fixtures for agent tests: a real engine over the tiny model, and helpers to check token exactness."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture()
def engine(tiny_model, tiny_tokenizer):
    """The reference `hf` engine over a fresh tiny model (closed after the test)."""
    from relayrl.rollout.hf import HFEngine

    eng = HFEngine(tiny_model.eval(), tiny_tokenizer, max_seq_len=512)
    yield eng
    eng.close()


@pytest.fixture(params=["hf", "native"])
def any_engine(request, tiny_model, tiny_tokenizer):
    """Each engine over a fresh tiny model: the executors only use the protocol."""
    from relayrl.rollout import build_engine

    eng = build_engine(request.param, tiny_model.eval(), tiny_tokenizer, max_seq_len=512)
    yield eng
    eng.close()


def teacher_forced_logprobs(model, token_ids: list[int], temperature: float = 1.0) -> list[float]:
    """log pi(token_t | tokens_<t) of every token t >= 1 under softmax(logits / T); entry 0 is 0.0."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, torch.tensor(token_ids[1:])[:, None])[:, 0]
    return [0.0, *lp.tolist()]


@pytest.fixture()
def tf_logprobs():
    """`teacher_forced_logprobs` (conftest helpers cannot be imported under --import-mode=importlib)."""
    return teacher_forced_logprobs


def build_tiny_rm(tokenizer, seed: int = 0):
    """A tiny Qwen2 sequence-classification reward model (num_labels=1) with random weights."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForSequenceClassification(config).eval()


@pytest.fixture(scope="session")
def tiny_rm_path(tmp_path_factory, tiny_tokenizer):
    """A saved tiny reward model folder (model + tokenizer)."""
    path = tmp_path_factory.mktemp("tiny_rm") / "rm"
    build_tiny_rm(tiny_tokenizer).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture()
def free_port():
    """A function returning a TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    def _free() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return _free
