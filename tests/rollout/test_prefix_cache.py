"""Native engine prefix cache: a finished sample's K/V stays in its slot, and a later n=1 request that starts
with the same tokens (the next turn of a multi-turn episode, a repeated prompt) prefills only the rest. The
results equal those of an engine without the cache; weight changes drop the cache."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine


def _engine(model, tok, cache: bool):
    return build_engine(
        "native", model, tok, max_slots=4, max_seq_len=256, eos_token_id=[], prefix_cache=cache, driver="loop"
    )


def _req(prompt: list[int], temperature: float = 0.0, seed: int | None = None, new: int = 12):
    params = SamplingParams(n=1, temperature=temperature, max_new_tokens=new, seed=seed)
    return GenerationRequest(prompt_ids=list(prompt), params=params)


def _two_turns(engine, prompt: list[int], feedback: list[int], **kw):
    first = asyncio.run(engine.generate(_req(prompt, **kw))).completions[0]
    before = (engine.prefill_tokens, engine.cached_tokens)
    turn2 = prompt + first.token_ids + feedback
    second = asyncio.run(engine.generate(_req(turn2, **kw))).completions[0]
    return first, second, turn2, (engine.prefill_tokens - before[0], engine.cached_tokens - before[1])


@pytest.mark.parametrize("kw", [{}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"])
def test_second_turn_prefills_only_the_new_tokens_and_matches_no_cache(
    lively_model, tiny_tokenizer, prompts, kw
):
    prompt, feedback = prompts[3], tiny_tokenizer(" then?")["input_ids"]
    cached = _engine(lively_model, tiny_tokenizer, True)
    plain = _engine(copy.deepcopy(lively_model), tiny_tokenizer, False)
    try:
        a1, a2, turn2, (prefilled, reused) = _two_turns(cached, prompt, feedback, **kw)
        b1, b2, _, (plain_prefilled, plain_reused) = _two_turns(plain, prompt, feedback, **kw)
    finally:
        cached.close()
        plain.close()
    assert a1.token_ids == b1.token_ids
    # the slot held prompt + first completion except its last token (sampled, never fed back)
    assert reused == len(prompt) + len(a1.token_ids) - 1 and prefilled == len(turn2) - reused
    assert plain_reused == 0 and plain_prefilled == len(turn2)
    assert a2.token_ids == b2.token_ids
    assert torch.allclose(torch.tensor(a2.logprobs), torch.tensor(b2.logprobs), atol=1e-5)


def test_a_repeated_prompt_reuses_all_but_a_few_of_its_tokens(lively_model, tiny_tokenizer, prompts):
    """The cache indexes every PREFIX_STRIDE-th prefix length of a parked sequence: a repeated prompt reuses
    the longest such prefix shorter than itself (its last token always runs, for the logits)."""
    engine = _engine(lively_model, tiny_tokenizer, True)
    try:
        first = asyncio.run(engine.generate(_req(prompts[1]))).completions[0]
        again = asyncio.run(engine.generate(_req(prompts[1]))).completions[0]
    finally:
        engine.close()
    from relayrl.rollout.slots import PREFIX_STRIDE

    assert len(prompts[1]) - 1 - PREFIX_STRIDE < engine.cached_tokens <= len(prompts[1]) - 1
    assert again.token_ids == first.token_ids


def test_weight_change_drops_the_cache(lively_model, tiny_tokenizer, prompts):
    engine = _engine(lively_model, tiny_tokenizer, True)
    try:
        asyncio.run(engine.generate(_req(prompts[1])))
        engine.load_weights(None)
        asyncio.run(engine.generate(_req(prompts[1])))
    finally:
        engine.close()
    assert engine.cached_tokens == 0


def test_short_prompts_and_n_samples_do_not_use_the_cache(lively_model, tiny_tokenizer, prompts):
    engine = _engine(lively_model, tiny_tokenizer, True)
    try:
        asyncio.run(engine.generate(_req(prompts[2])))  # "a": shorter than min_prefix_tokens
        asyncio.run(engine.generate(_req(prompts[2])))
        asyncio.run(engine.generate(_req(prompts[1])))
        n2 = GenerationRequest(
            prompt_ids=prompts[1], params=SamplingParams(n=2, temperature=0.0, max_new_tokens=4)
        )
        asyncio.run(engine.generate(n2))  # n > 1: one shared prefill into fresh slots
    finally:
        engine.close()
    assert engine.cached_tokens == 0


def test_parked_slots_are_reused_when_slots_run_out(lively_model, tiny_tokenizer, prompts):
    """More distinct requests than slots: parked slots are taken back (oldest first), nothing waits forever."""
    engine = _engine(lively_model, tiny_tokenizer, True)
    texts = [f"question number {i} is here" for i in range(10)]
    reqs = [_req(tiny_tokenizer(t)["input_ids"], new=6) for t in texts]
    try:

        async def run():
            out = []
            for r in reqs:  # one after another: each finishes and parks before the next arrives
                out.append(await engine.generate(r))
            return out

        results = asyncio.run(run())
    finally:
        engine.close()
    assert all(len(r.completions[0].token_ids) == 6 for r in results)
    assert len(engine.pool.parked) <= 4


def test_multi_turn_episodes_reuse_their_conversation_and_stay_identical(tiny_model, tiny_tokenizer):
    """The built-in guess task (up to 4 turns, each turn's prompt = the conversation so far): with the cache the
    same seeded episodes come out, prefilling a fraction of the tokens (bench/multiturn.py measures the time)."""
    from relayrl.data.records import PromptSample
    from relayrl.data.templates import encode
    from relayrl.tasks import get_task

    task = get_task("guess")
    rows = task.make_rows("train", 6, 0)
    samples = [
        PromptSample(
            index=i, prompt=r["input"], prompt_ids=encode(tiny_tokenizer, r["input"]), label=r["label"]
        )
        for i, r in enumerate(rows)
    ]

    def play(cache: bool):
        engine = build_engine(
            "native", tiny_model, tiny_tokenizer, max_slots=12, max_seq_len=256, prefix_cache=cache
        )
        ex = task.executor(engine, tiny_tokenizer, max_total_len=256)

        async def run():
            params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=s.index) for s in samples]
            return [t for g in await asyncio.gather(*map(ex.execute, samples, params)) for t in g]

        try:
            trajs = asyncio.run(run())
        finally:
            engine.close()
        return [(t.token_ids, t.reward) for t in trajs], engine.prefill_tokens, engine.cached_tokens, trajs

    off, off_prefilled, off_cached, trajs = play(False)
    on, on_prefilled, on_cached, _ = play(True)
    assert on == off
    assert sum(t.num_turns for t in trajs) > len(trajs)  # several turns per episode
    assert off_cached == 0 and on_cached > 0
    assert on_prefilled + on_cached == off_prefilled and on_prefilled < off_prefilled / 2


def test_a_step_of_next_turns_and_fresh_prompts_is_one_batched_prefill(
    lively_model, tiny_tokenizer, prompts, monkeypatch
):
    """Three episodes' next turns (each continuing its parked slot) and a fresh n=2 prompt arrive together:
    the engine runs ONE prefill forward for all four (ragged suffixes, right-padded), and every sample equals
    the cache-off engine's (fp32, seeded sampling: tokens exact, log-probs within 1e-5; the fresh prompt's
    second sample would differ if its slot had not received the prompt's K/V)."""
    kw = {"temperature": 1.0, "seed": 3}
    from relayrl.rollout.native_model import DecoderRunner

    calls: list[tuple[str, int]] = []
    for name in ("prefill", "extend"):
        orig = getattr(DecoderRunner, name)

        def counted(self, ids, *a, _orig=orig, _name=name, **k):
            calls.append((_name, ids.shape[0]))
            return _orig(self, ids, *a, **k)

        monkeypatch.setattr(DecoderRunner, name, counted)
    feedback = tiny_tokenizer(" and?")["input_ids"]
    fresh = GenerationRequest(prompt_ids=prompts[4], params=SamplingParams(n=2, max_new_tokens=7, **kw))

    def play(cache: bool):
        engine = build_engine(
            "native", lively_model, tiny_tokenizer, max_slots=8, max_seq_len=256, eos_token_id=[],
            prefix_cache=cache, driver="loop",
        )  # fmt: skip

        async def turns():
            firsts = await asyncio.gather(*(engine.generate(_req(prompts[i], **kw)) for i in (0, 1, 3)))
            nexts = [
                _req(prompts[i] + r.completions[0].token_ids + feedback, **kw)
                for i, r in zip((0, 1, 3), firsts, strict=True)
            ]
            calls.clear()
            before = engine.prefill_batches
            second = await asyncio.gather(*(engine.generate(r) for r in [*nexts, fresh]))
            return firsts, second, engine.prefill_batches - before, list(calls)

        try:
            return asyncio.run(turns()), engine.cached_tokens
        finally:
            engine.close()

    (on_first, on_second, on_batches, on_calls), on_cached = play(True)
    (off_first, off_second, _, _), off_cached = play(False)
    assert on_cached > 0 and off_cached == 0
    assert on_batches == 1 and on_calls == [("extend", 4)]  # one forward: 3 cached suffixes + 1 fresh prompt
    for a, b in zip(on_first + on_second, off_first + off_second, strict=True):
        assert [c.token_ids for c in a.completions] == [c.token_ids for c in b.completions]
        for ca, cb in zip(a.completions, b.completions, strict=True):
            assert torch.allclose(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5)
    assert len(on_second[3].completions) == 2
