"""Partial rollout: `load_weights` between rounds does not abort in-flight requests; they continue under the
new weights and every token carries the weight version that produced it (Completion.versions)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine

NEW = 24


def _request(prompt: list[int], n: int = 1) -> GenerationRequest:
    return GenerationRequest(
        prompt_ids=prompt, params=SamplingParams(n=n, temperature=0.0, max_new_tokens=NEW, seed=1)
    )


def _other_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every matrix scaled and flipped: a different greedy continuation."""
    return [(n, -1.7 * p.detach().clone()) for n, p in model.named_parameters() if p.dim() == 2]


async def _generate_with_update_after_first_round(engine, request, named):
    """Loop driver: rounds run on this loop between awaits. Let the first round (prefill + up to
    sync_every decode steps) run, then load new weights between rounds, then let the request finish."""
    task = asyncio.create_task(engine.generate(request))
    for _ in range(200):
        await asyncio.sleep(0)
        if engine.decode_steps > 0:
            break
    steps_at_update = engine.decode_steps
    engine.load_weights(named, version=7)
    return await task, steps_at_update


@pytest.mark.parametrize("n", [1, 3])
def test_versions_split_at_the_update_and_the_request_finishes(lively_model, tiny_tokenizer, prompts, n):
    model = copy.deepcopy(lively_model)
    engine = build_engine(
        "native",
        model,
        tiny_tokenizer,
        max_slots=4,
        max_seq_len=128,
        sync_every=4,
        eos_token_id=[],
        driver="loop",
    )
    try:
        assert engine.version == 0
        result, steps = asyncio.run(
            _generate_with_update_after_first_round(engine, _request(prompts[1], n), _other_weights(model))
        )
    finally:
        engine.close()
    assert engine.version == 7
    before = 1 + steps  # the prefill's token, then one per decode step before the update
    assert 0 < before < NEW
    for comp in result.completions:
        assert comp.finish_reason == "length" and len(comp.token_ids) == NEW  # not aborted
        assert comp.versions == [0] * before + [7] * (NEW - before)

    # the tokens after the update come from the new weights: a run without the update differs there only
    reference = build_engine(
        "native", copy.deepcopy(lively_model), tiny_tokenizer, max_slots=4, max_seq_len=128, eos_token_id=[]
    )
    try:
        plain = asyncio.run(reference.generate(_request(prompts[1], n)))
    finally:
        reference.close()
    for comp, ref in zip(result.completions, plain.completions, strict=True):
        assert ref.versions == [0] * NEW
        assert comp.token_ids[:before] == ref.token_ids[:before]
        assert comp.token_ids[before:] != ref.token_ids[before:]


def test_requests_admitted_after_the_update_carry_only_the_new_version(lively_model, tiny_tokenizer, prompts):
    engine = build_engine(
        "native", lively_model, tiny_tokenizer, max_slots=4, max_seq_len=128, eos_token_id=[]
    )
    try:
        engine.load_weights(None)  # no version given: + 1
        engine.load_weights(None)
        result = asyncio.run(engine.generate(_request(prompts[0])))
    finally:
        engine.close()
    assert result.completions[0].versions == [2] * NEW


def test_hf_engine_tags_its_tokens_with_the_version(lively_model, tiny_tokenizer, prompts):
    engine = build_engine("hf", lively_model, tiny_tokenizer, max_seq_len=128, eos_token_id=[])
    try:
        engine.load_weights(None, version=4)
        result = asyncio.run(engine.generate(_request(prompts[0], 2)))
    finally:
        engine.close()
    assert [c.versions for c in result.completions] == [[4] * NEW] * 2


def test_paused_blocks_rounds_until_the_block_ends(lively_model, tiny_tokenizer, prompts):
    """`paused()` holds rounds off (the policy copies new weights inside it); a request submitted meanwhile
    waits and then runs."""
    import threading

    engine = build_engine(
        "native", lively_model, tiny_tokenizer, max_slots=4, max_seq_len=128, eos_token_id=[], driver="thread"
    )
    done = threading.Event()
    try:
        with engine.paused():
            t = threading.Thread(
                target=lambda: (asyncio.run(engine.generate(_request(prompts[0]))), done.set())
            )
            t.start()
            assert not done.wait(0.5)  # no round can run while paused
            assert engine.decode_steps == 0
        assert done.wait(30)
        t.join()
    finally:
        engine.close()
