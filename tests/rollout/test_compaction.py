"""Native engine slot compaction: when samples finish at different steps, the live ones move down into the
lowest empty slots so the decode batch shrinks; the samples (tokens, log-probs) are exactly those of an engine
that never moves them (fp32, seeded sampling: each slot's uniforms move with it)."""

from __future__ import annotations

import asyncio

import torch

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine


def _run(model, tok, reqs, compact: bool):
    engine = build_engine(
        "native",
        model,
        tok,
        max_slots=8,
        max_seq_len=128,
        eos_token_id=[],
        driver="loop",
        compact=compact,
        prefix_cache=False,
    )

    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    try:
        return asyncio.run(go()), engine.compactions, engine.decode_steps
    finally:
        engine.close()


def test_live_samples_move_down_and_the_samples_do_not_change(lively_model, tiny_tokenizer, prompts):
    # slots 0-4: short requests; slots 5-7: an n=3 request that runs longest; then one more short request
    lengths = [2, 3, 2, 4, 3]
    reqs = [
        GenerationRequest(
            prompt_ids=prompts[i % len(prompts)],
            params=SamplingParams(n=1, temperature=1.0, max_new_tokens=n, seed=10 + i),
        )
        for i, n in enumerate(lengths)
    ]
    reqs.append(
        GenerationRequest(
            prompt_ids=prompts[1], params=SamplingParams(n=3, temperature=1.0, max_new_tokens=20, seed=7)
        )
    )
    moved, moves, _ = _run(lively_model, tiny_tokenizer, reqs, compact=True)
    kept, none, _ = _run(lively_model, tiny_tokenizer, reqs, compact=False)
    assert moves > 0 and none == 0
    for a, b in zip(moved, kept, strict=True):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        for ca, cb in zip(a.completions, b.completions, strict=True):
            assert torch.equal(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs))
            assert ca.finish_reason == cb.finish_reason
    assert [len(c.token_ids) for c in moved[-1].completions] == [20, 20, 20]
