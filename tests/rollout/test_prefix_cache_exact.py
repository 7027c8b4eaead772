"""Prefix cache + exact mode (relayrl/rollout/prefix_cache.py, exact.py): multi-turn episodes come out
IDENTICAL with the cache on and off -- every token id and every log-prob bit for bit (==, no tolerance), in
fp32 and bf16 -- although the two engines run different forwards (the cache: one batched suffix prefill
after each episode's cached K/V; without it: a prefill of the whole conversation, in other batches). The
exact forward gives each token one computation whatever the batch, the padding and whether its K/V came from
a prefill, a decode step or the cache; this is the CPU run of the argument the module doc makes for GPUs."""

from __future__ import annotations

import asyncio
import copy
import random

import pytest
import torch

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, prefix_cache
from relayrl.rollout.native import NativeEngine


def _episodes(model, tok, *, cache: bool, exact: bool, episodes: int = 6, turns: int = 3):
    """`episodes` concurrent conversations: each turn's prompt = the previous prompt + its completion + an
    observation of 4-9 seeded random tokens (an agent's tool output). Returns (per episode: every turn's
    (token ids, log-probs)), engine counters."""
    engine = build_engine(
        "native", model, tok, max_slots=8, max_seq_len=160, eos_token_id=[], driver="loop",
        prefix_cache=cache, exact=exact,
    )  # fmt: skip
    assert isinstance(engine, NativeEngine)
    vocab = len(tok)

    async def episode(e: int):
        rng = random.Random(e)
        prompt = [rng.randrange(3, vocab) for _ in range(10 + 3 * e)]
        out = []
        for turn in range(turns):
            params = SamplingParams(n=1, temperature=1.0, max_new_tokens=6 + e % 3, seed=100 * e + turn)
            c = (await engine.generate(GenerationRequest(prompt_ids=prompt, params=params))).completions[0]
            out.append((c.token_ids, c.logprobs))
            prompt = prompt + c.token_ids + [rng.randrange(3, vocab) for _ in range(rng.randint(4, 9))]
        return out

    async def run():
        return await asyncio.gather(*(episode(e) for e in range(episodes)))

    try:
        trajs = asyncio.run(run())
    finally:
        engine.close()
    return trajs, dict(prefilled=engine.prefill_tokens, cached=engine.cached_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_exact_mode_episodes_are_bit_identical_with_and_without_the_cache(
    lively_model, tiny_tokenizer, dtype
):
    model = lively_model.to(dtype)
    on, on_counts = _episodes(model, tiny_tokenizer, cache=True, exact=True)
    off, off_counts = _episodes(copy.deepcopy(model), tiny_tokenizer, cache=False, exact=True)
    assert off_counts["cached"] == 0 and on_counts["cached"] > off_counts["prefilled"] / 2  # the cache ran
    assert on_counts["prefilled"] + on_counts["cached"] == off_counts["prefilled"]
    assert on == off  # token ids and float log-probs, every turn of every episode


def test_without_exact_mode_bf16_episodes_drift(lively_model, tiny_tokenizer):
    """The contrast: the default (non-exact) bf16 forward rounds a suffix prefill after cached K/V and a full
    prefill differently, so some log-prob differs (which is why exactness needs exact mode; module doc)."""
    model = lively_model.to(torch.bfloat16)
    on, _ = _episodes(model, tiny_tokenizer, cache=True, exact=False)
    off, _ = _episodes(copy.deepcopy(model), tiny_tokenizer, cache=False, exact=False)
    assert on != off


def test_the_gpu_default_is_the_one_switch(monkeypatch):
    """Engines built with prefix_cache=None: always on for a CPU model; on CUDA exactly PREFIX_CACHE_ON_CUDA (so
    flipping that one line turns the cache on for agents on GPUs)."""
    for value in (False, True):
        monkeypatch.setattr(prefix_cache, "PREFIX_CACHE_ON_CUDA", value)
        assert prefix_cache.default_prefix_cache(torch.device("cpu"))
        assert prefix_cache.default_prefix_cache(torch.device("cuda", 0)) is value
