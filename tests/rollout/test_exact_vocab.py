"""Exact mode computes the SAME distribution as the default mode on a large vocabulary (relayrl/rollout/exact.py
and, in Triton's interpreter, exact_kernels.py), not only the same values on the engine's and the trainer's
side: a bug shared by both sides (a masked tail of the head's columns, a wrong `other=` value, an offset
overflow) would keep engine == trainer bit for bit and still change what is sampled.

fp32 on the CPU. Tolerances: logits within 1e-5 absolute of the HF forward's (values of order 1; the
summation order is the only difference: measured 3e-7), the probability of the EOS id within 1e-4 relative,
and the engine's default and exact runs sample the same tokens with log-probs within 1e-5 (log-probs of order
-12 on a 151,936-row vocabulary)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, exact, generate_all
from relayrl.rollout.exact import ExactRunner
from relayrl.rollout.kernels import usable

QWEN_VOCAB = 151936
"""Qwen2.5's vocabulary rows: bench/rl_step.py's qwen0.5b shape beside the ~100-token char tokenizer."""


def _model(vocab: int, hidden: int = 64, inter: int = 256, eos: int = 1) -> Qwen2ForCausalLM:
    """A random Qwen2 at HF's default init (std 0.02, as bench/rl_step.py's): near-uniform logits over the
    vocabulary, so P(EOS) ~ 1/vocab and samples practically never stop early."""
    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float().eval()


def _check_logits(model: Qwen2ForCausalLM, triton: bool) -> None:
    ids = torch.randint(4, 100, (2, 11), generator=torch.Generator().manual_seed(1))  # char-tokenizer ids
    with torch.no_grad():
        ref = model(ids).logits.float()
        runner = ExactRunner(model, 32, triton_kernels=triton)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        got = runner._head(runner._stack(ids, pos, lambda li, k, v: (k, v), causal=True)).float()
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5
    p_ref, p_got = ref.softmax(-1)[..., 1], got.softmax(-1)[..., 1]  # the EOS id's probability
    assert ((p_got - p_ref).abs() <= 1e-4 * p_ref).all()
    assert p_ref.max().item() < 50 / model.config.vocab_size  # near uniform: the premise of the test


def _sample(model, tokenizer, prompts, exact_mode: bool, n: int, new_tokens: int):
    engine = build_engine(
        "native", model, tokenizer, max_slots=8, max_seq_len=64, driver="loop", exact=exact_mode
    )  # the tokenizer's EOS stops a sample, as in `relayrl rl`
    reqs = [
        GenerationRequest(
            prompt_ids=p, params=SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, seed=i)
        )
        for i, p in enumerate(prompts)
    ]
    try:
        return [c for res in generate_all(engine, reqs) for c in res.completions]
    finally:
        engine.close()


def _check_engine(model, tokenizer, prompts, n: int, new_tokens: int) -> None:
    default = _sample(model, tokenizer, prompts, False, n, new_tokens)
    exact_ = _sample(model, tokenizer, prompts, True, n, new_tokens)
    for a, b in zip(default, exact_, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert len(a.token_ids) == new_tokens  # no sample met EOS (P ~ 1/vocab per token)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=1e-5)


def test_torch_path_matches_the_default_distribution_on_qwens_vocabulary(tiny_tokenizer, prompts):
    model = _model(QWEN_VOCAB)
    _check_logits(model, triton=False)
    _check_engine(model, tiny_tokenizer, prompts[:3], n=2, new_tokens=12)


@pytest.mark.skipif(not usable(torch.device("cpu")), reason="triton not installed or TRITON_INTERPRET unset")
def test_kernels_match_the_default_distribution_with_ragged_tiles(tiny_tokenizer, prompts, monkeypatch):
    """The kernels with every tile ragged: vocabulary 20,011 (the head's last 128-column tile holds 43 rows
    of the weight), hidden 80 (K = 64 + 16; 32-column tiles, the last 16 wide; head_dim 20 in a 32-wide
    tile), intermediate 200 (gate/up: the last 32-column tile 8 wide; down: K = 3 x 64 + 8). (A smaller
    vocabulary than Qwen's: the interpreter runs each of the head's column tiles in numpy.)"""
    monkeypatch.setattr(exact, "use_kernels", lambda device: True)
    model = _model(20011, hidden=80, inter=200)
    _check_logits(model, triton=True)
    _check_engine(model, tiny_tokenizer, prompts[2:3], n=1, new_tokens=3)
