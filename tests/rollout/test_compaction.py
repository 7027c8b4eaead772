"""Native engine slot compaction: when samples finish at different steps, the live ones move down into the
lowest empty slots so the decode batch shrinks; the samples (tokens, log-probs) are exactly those of an engine
that never moves them (fp32, seeded sampling: each slot's uniforms move with it)."""

from __future__ import annotations

import asyncio

import torch

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine


def _run(model, tok, reqs, compact: bool, sync_every: int = 16):
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
        sync_every=sync_every,
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


def test_a_request_whose_samples_end_apart_moves_into_its_own_freed_slot(
    lively_model, tiny_tokenizer, prompts
):
    """n=2 where sample 0 stops early: sample 1 (slot 1) moves into slot 0, the slot its own sibling just
    freed; the request still finishes with both samples in order."""
    base = dict(n=2, temperature=1.0, max_new_tokens=24, seed=4)
    free_run, _, _ = _run(
        lively_model,
        tiny_tokenizer,
        [GenerationRequest(prompt_ids=prompts[0], params=SamplingParams(**base))],
        compact=False,
    )
    first, second = (c.token_ids for c in free_run[0].completions)
    stop = next(t for t in first[1:6] if t not in second)  # ends sample 0 early, never sample 1
    req = GenerationRequest(prompt_ids=prompts[0], params=SamplingParams(**base, stop_token_ids=(stop,)))
    moved, moves, _ = _run(lively_model, tiny_tokenizer, [req], compact=True, sync_every=4)
    kept, _, _ = _run(lively_model, tiny_tokenizer, [req], compact=False, sync_every=4)
    assert moves == 1
    assert [c.token_ids for c in moved[0].completions] == [c.token_ids for c in kept[0].completions]
    a, b = moved[0].completions
    assert a.token_ids[-1] == stop and len(a.token_ids) < 6 and len(b.token_ids) == 24
