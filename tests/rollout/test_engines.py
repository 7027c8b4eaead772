"""Both in-process engines against `transformers` and against a teacher-forced forward (CPU, fp32)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from relayrl.rollout import FinishReason, GenerationRequest, SamplingParams, build_engine, generate_all

ENGINES = ["native", "hf"]
DRIVERS = ["loop", "thread"]  # CPU's default first; "thread" is CUDA's
pytestmark = pytest.mark.timeout(60)
EOS = 1  # the tiny tokenizer's <|im_end|>


def _engine(name, model, tok, **opts):
    if name == "native":
        opts.setdefault("max_slots", 8)
    return build_engine(name, model, tok, max_seq_len=opts.pop("max_seq_len", 64), **opts)


def _req(ids, rid="", **params):
    return GenerationRequest(prompt_ids=list(ids), params=SamplingParams(**params), request_id=rid)


def _hf_greedy(model, ids, max_new):
    out = model.generate(
        torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def _teacher_forced_logprobs(model, prompt, completion, temperature):
    """log_softmax(logits / T) of each completion token under one full forward of prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("name", [*ENGINES, "native-sdpa"])
def test_greedy_matches_transformers_mixed_lengths(name, lively_model, tiny_tokenizer, prompts):
    """native-sdpa: the fused decode attention (CUDA's default) instead of CPU's matmul path."""
    opts = {"decode_attention": "sdpa"} if name == "native-sdpa" else {}
    engine = _engine(name.removesuffix("-sdpa"), lively_model, tiny_tokenizer, **opts)
    results = generate_all(
        engine, [_req(p, str(i), temperature=0, max_new_tokens=16) for i, p in enumerate(prompts)]
    )
    engine.close()
    for p, res in zip(prompts, results, strict=True):
        expected = _hf_greedy(lively_model, p, 16)
        (c,) = res.completions
        assert c.token_ids == expected
        assert c.finish_reason == (FinishReason.STOP if expected[-1] == EOS else FinishReason.LENGTH)
        assert res.prompt_ids == p


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_teacher_forced_forward(name, temperature, lively_model, tiny_tokenizer, prompts):
    engine = _engine(name, lively_model, tiny_tokenizer)
    reqs = [_req(p, temperature=temperature, max_new_tokens=12, seed=i) for i, p in enumerate(prompts[:3])]
    results = generate_all(engine, reqs)
    engine.close()
    for p, res in zip(prompts, results, strict=False):
        c = res.completions[0]
        assert len(c.logprobs) == len(c.token_ids) > 0
        ref = _teacher_forced_logprobs(lively_model, p, c.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_truncated_sampling_logprobs_are_untruncated(lively_model, tiny_tokenizer, prompts):
    """top_k=1 / tiny top_p sample the argmax; the log-prob stays that of softmax(logits / T)."""
    engine = _engine("native", lively_model, tiny_tokenizer)
    greedy = generate_all(engine, [_req(prompts[1], temperature=0, max_new_tokens=10)])[0].completions[0]
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        c = generate_all(engine, [_req(prompts[1], temperature=0.7, max_new_tokens=10, **params)])[
            0
        ].completions[0]
        assert c.token_ids == greedy.token_ids
        ref = _teacher_forced_logprobs(lively_model, prompts[1], c.token_ids, 0.7)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)
        assert max(c.logprobs) < 0  # T=0.7 over 101 tokens never puts all mass on one token here
    engine.close()


@pytest.mark.parametrize("name", ENGINES)
def test_seeded_sampling_reproducible(name, lively_model, tiny_tokenizer, prompts):
    engine = _engine(name, lively_model, tiny_tokenizer)
    req = _req(prompts[0], "x", n=3, max_new_tokens=12, seed=1234)
    first = generate_all(engine, [req])[0]
    again = generate_all(engine, [req])[0]
    other_seed = generate_all(engine, [_req(prompts[0], n=3, max_new_tokens=12, seed=99)])[0]
    engine.close()
    toks = [c.token_ids for c in first.completions]
    assert toks == [c.token_ids for c in again.completions]
    assert len({tuple(t) for t in toks}) == 3  # the n samples differ from each other
    assert toks != [c.token_ids for c in other_seed.completions]


def test_native_seeded_sample_independent_of_batch(lively_model, tiny_tokenizer, prompts):
    """A seeded request gives the same samples alone and inside a batch of other requests."""
    engine = _engine("native", lively_model, tiny_tokenizer, max_slots=16)
    req = _req(prompts[3], "x", n=2, max_new_tokens=14, seed=7, top_p=0.9)
    alone = generate_all(engine, [req])[0]
    crowd = [_req(p, max_new_tokens=9, temperature=0.5, top_k=5) for p in prompts] + [req]
    mixed = generate_all(engine, crowd)[-1]
    engine.close()
    assert [c.token_ids for c in alone.completions] == [c.token_ids for c in mixed.completions]


def test_native_samples_follow_the_counter_based_uniforms(lively_model, tiny_tokenizer, prompts):
    """Token at position p of sample j = inverse CDF of softmax(logits / T) at u = uniform(mix_seed(seed, j),
    p), the logits from a teacher-forced forward: the engine's per-slot uniform table is that hash."""
    from relayrl.rollout.sampling import mix_seed, sample_tokens, uniform

    engine = _engine("native", lively_model, tiny_tokenizer)
    res = generate_all(engine, [_req(prompts[0], n=2, max_new_tokens=10, temperature=0.8, seed=5)])[0]
    engine.close()
    for j, c in enumerate(res.completions):
        ids = torch.tensor([prompts[0] + c.token_ids])
        with torch.no_grad():
            logits = lively_model(ids).logits[0, len(prompts[0]) - 1 : -1]
        positions = torch.arange(len(prompts[0]), ids.shape[1])
        n = len(c.token_ids)
        tok, _ = sample_tokens(
            logits,
            torch.full((n,), 0.8),
            torch.ones(n),
            torch.zeros(n, dtype=torch.long),
            uniform(torch.full((n,), mix_seed(5, j)), positions),
            "sample",
        )
        assert tok.tolist() == c.token_ids


def test_native_kv_bucket_only_pads(lively_model, tiny_tokenizer, prompts):
    """Eager decode attends over fine length buckets by default; graph-sized buckets (padding to 64) give
    the same samples and log-probs (the padding is masked)."""
    reqs = [_req(p, str(i), n=2, max_new_tokens=12, seed=i) for i, p in enumerate(prompts)]
    out = {}
    for bucket in (None, 64):
        engine = _engine("native", lively_model, tiny_tokenizer, kv_bucket=bucket)
        out[bucket] = [c for r in generate_all(engine, reqs) for c in r.completions]
        engine.close()
    assert [c.token_ids for c in out[None]] == [c.token_ids for c in out[64]]
    for a, b in zip(out[None], out[64], strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ENGINES)
def test_stop_tokens_and_length_limits(name, lively_model, tiny_tokenizer, prompts):
    p = prompts[1]  # 24 tokens
    greedy = _hf_greedy(lively_model, p, 10)
    stop = greedy[4]
    first = greedy.index(stop)
    engine = _engine(name, lively_model, tiny_tokenizer, max_seq_len=30)
    r_stop, r_new, r_total, r_full = generate_all(
        engine,
        [
            _req(p, temperature=0, max_new_tokens=10, stop_token_ids=(stop,)),
            _req(p, temperature=0, max_new_tokens=3),
            _req(p, temperature=0, max_new_tokens=50),  # 30 - 24 = 6 tokens fit
            _req(list(range(5, 35)), temperature=0, max_new_tokens=5),  # prompt fills the 30 limit
        ],
    )
    engine.close()
    c = r_stop.completions[0]
    assert (c.token_ids, c.finish_reason) == (greedy[: first + 1], FinishReason.STOP)
    c = r_new.completions[0]
    assert (c.token_ids, c.finish_reason) == (greedy[:3], FinishReason.LENGTH)
    c = r_total.completions[0]
    assert (c.token_ids, c.finish_reason) == (greedy[:6], FinishReason.LENGTH)
    assert len(p) + len(c.token_ids) == 30
    c = r_full.completions[0]
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([], [], FinishReason.LENGTH)


def test_native_n_samples_share_one_prefill(lively_model, tiny_tokenizer, prompts):
    engine = _engine("native", lively_model, tiny_tokenizer)
    res = generate_all(engine, [_req(prompts[1], n=5, max_new_tokens=8, seed=3)])[0]
    assert (engine.prefill_count, engine.prefill_tokens) == (1, len(prompts[1]))
    assert len(res.completions) == 5
    assert len({tuple(c.token_ids) for c in res.completions}) == 5
    engine.close()


def test_native_continuous_batching_more_requests_than_slots(lively_model, tiny_tokenizer, prompts):
    """12 requests (some n=2) through 3 slots: every result equals the request run alone."""
    reqs = [
        _req(
            prompts[i % 5],
            str(i),
            n=1 + i % 2,
            temperature=0.8 * (i % 3 > 0),
            max_new_tokens=4 + 3 * (i % 4),
            seed=i,
        )
        for i in range(12)
    ]
    engine = _engine("native", lively_model, tiny_tokenizer, max_slots=3, sync_every=4)
    together = generate_all(engine, reqs)
    assert engine.prefill_count == 12
    alone = [generate_all(engine, [r])[0] for r in reqs]
    engine.close()
    for t, a, r in zip(together, alone, reqs, strict=True):
        assert t.request_id == r.request_id
        assert [c.token_ids for c in t.completions] == [c.token_ids for c in a.completions]
        assert all(len(c.token_ids) <= r.params.max_new_tokens for c in t.completions)


def test_native_reads_live_weights(lively_model, tiny_tokenizer, prompts):
    engine = _engine("native", lively_model, tiny_tokenizer)
    req = _req(prompts[0], temperature=0, max_new_tokens=12)
    before = generate_all(engine, [req])[0].completions[0].token_ids
    with torch.no_grad():  # an "optimizer step" done in place on the shared parameters
        lively_model.model.layers[0].mlp.down_proj.weight.mul_(-1.5)
    engine.load_weights(None)
    after = generate_all(engine, [req])[0].completions[0].token_ids
    engine.close()
    assert after != before
    assert after == _hf_greedy(lively_model, prompts[0], 12)


@pytest.mark.parametrize("name", ENGINES)
def test_load_weights_named_copies_in_place(name, lively_model, tiny_tokenizer, prompts):
    engine = _engine(name, lively_model, tiny_tokenizer)
    w = lively_model.model.norm.weight
    ptr = w.data_ptr()
    engine.load_weights([("model.norm.weight", torch.full_like(w, 2.0))])
    assert w.data_ptr() == ptr and torch.equal(w, torch.full_like(w, 2.0))
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        engine.load_weights([("nope", w)])
    engine.close()


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("name", ENGINES)
def test_sleep_wake_up_round_trip(name, driver, lively_model, tiny_tokenizer, prompts):
    engine = _engine(name, lively_model, tiny_tokenizer, driver=driver)
    req = _req(prompts[2], n=2, max_new_tokens=10, seed=5)
    before = generate_all(engine, [req])[0]
    engine.sleep()
    if name == "native":
        assert engine.state is None  # KV cache released
    engine.wake_up()
    after = generate_all(engine, [req])[0]
    engine.close()
    assert [c.token_ids for c in after.completions] == [c.token_ids for c in before.completions]


@pytest.mark.parametrize("driver", DRIVERS)
def test_requests_wait_while_asleep_and_close_aborts(driver, lively_model, tiny_tokenizer, prompts):
    engine = _engine("native", lively_model, tiny_tokenizer, driver=driver)
    engine.sleep()

    async def run():
        task = asyncio.ensure_future(engine.generate(_req(prompts[0], temperature=0, max_new_tokens=4)))
        await asyncio.sleep(0.05)
        assert not task.done()  # queued until wake_up
        engine.wake_up()
        served = await task
        engine.sleep()
        pending = asyncio.ensure_future(engine.generate(_req(prompts[0], n=2, max_new_tokens=4)))
        await asyncio.sleep(0.05)
        engine.close()
        return served, await pending

    served, aborted = asyncio.run(run())
    assert served.completions[0].token_ids == _hf_greedy(lively_model, prompts[0], 4)
    assert [c.finish_reason for c in aborted.completions] == [FinishReason.ABORT] * 2


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_failing_round_fails_its_callers(driver, lively_model, tiny_tokenizer, prompts, monkeypatch):
    engine = _engine("native", lively_model, tiny_tokenizer, driver=driver)

    def broken(*args):
        raise RuntimeError("decode blew up")

    monkeypatch.setattr(engine.runner, "decode", broken)
    with pytest.raises(RuntimeError, match="decode blew up"):
        generate_all(engine, [_req(p, max_new_tokens=4) for p in prompts[:2]])
    monkeypatch.undo()
    res = generate_all(engine, [_req(prompts[0], temperature=0, max_new_tokens=4)])[0]  # still serves
    engine.close()
    assert res.completions[0].token_ids == _hf_greedy(lively_model, prompts[0], 4)


def test_loop_driver_serves_a_loop_while_another_blocks(lively_model, tiny_tokenizer, prompts):
    """Each event loop with requests in flight runs its own driver: loop A drives, then blocks its thread;
    a request from loop B (another thread) still completes, and A's completes once A runs again."""
    engine = _engine("native", lively_model, tiny_tokenizer, driver="loop")
    b_done = threading.Event()
    a_submitted = threading.Event()

    async def loop_a():
        task = asyncio.ensure_future(engine.generate(_req(prompts[1], temperature=0, max_new_tokens=30)))
        await asyncio.sleep(0)  # A's driver starts and takes the request
        a_submitted.set()
        assert b_done.wait(30)  # blocks loop A's thread until B is served
        return await task

    def run_b():
        a_submitted.wait(30)
        asyncio.run(engine.generate(_req(prompts[0], temperature=0, max_new_tokens=5)))
        b_done.set()

    b = threading.Thread(target=run_b)
    b.start()
    res_a = asyncio.run(loop_a())
    b.join()
    engine.close()
    assert res_a.completions[0].token_ids == _hf_greedy(lively_model, prompts[1], 30)


def test_native_validation_errors(lively_model, tiny_tokenizer):
    engine = _engine("native", lively_model, tiny_tokenizer, max_slots=2)
    with pytest.raises(ValueError, match="n=3 exceeds the engine's max_slots=2"):
        generate_all(engine, [_req([5, 6], n=3)])
    with pytest.raises(ValueError, match=r"prompt ids \[500\] outside the vocabulary"):
        generate_all(engine, [_req([5, 500])])
    engine.close()
    with pytest.raises(ValueError, match=r"driver must be one of \('thread', 'loop'\)"):
        _engine("native", lively_model, tiny_tokenizer, driver="process")
    with pytest.raises(RuntimeError, match="closed"):
        generate_all(engine, [_req([5, 6])])


def test_unsupported_architecture_names_the_model_type(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=101, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(NotImplementedError, match=r"model type 'gpt2' is not supported.*\"hf\" engine"):
        build_engine("native", gpt2, tiny_tokenizer)
    with pytest.raises(ValueError, match="unknown rollout engine 'fast'"):
        build_engine("fast", gpt2, tiny_tokenizer)


@pytest.mark.parametrize("name", ENGINES)
def test_unseeded_samples_differ_between_calls(name, lively_model, tiny_tokenizer, prompts):
    engine = _engine(name, lively_model, tiny_tokenizer)
    req = _req(prompts[0], max_new_tokens=12)
    a, b = (generate_all(engine, [req])[0].completions[0].token_ids for _ in range(2))
    engine.close()
    assert a != b


def test_vllm_engine_missing_package_error():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match='rollout engine "vllm" needs the vllm package'):
            build_engine("vllm", "some/model")
    else:
        pytest.skip("vllm is installed; the adapter is exercised on GPU machines")


def test_native_runs_peft_lora_model_in_place(lively_model, tiny_tokenizer, prompts):
    """A LoRA-wrapped policy: the engine calls the wrapped projections, so adapters apply (no merge)."""
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(
        lively_model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    ).eval()
    engine = _engine("native", lora, tiny_tokenizer)
    got = (
        generate_all(engine, [_req(prompts[1], temperature=0, max_new_tokens=10)])[0].completions[0].token_ids
    )
    engine.close()
    ids = torch.tensor([prompts[1]])
    ref = lora.generate(input_ids=ids, do_sample=False, max_new_tokens=10, eos_token_id=EOS, pad_token_id=0)
    with lora.disable_adapter():
        base = lora.generate(
            input_ids=ids, do_sample=False, max_new_tokens=10, eos_token_id=EOS, pad_token_id=0
        )
    assert got == ref[0, len(prompts[1]) :].tolist() != base[0, len(prompts[1]) :].tolist()


def test_native_calls_hooked_modules(lively_model, tiny_tokenizer, prompts):
    """Plain Linears and MLPs run as direct functional calls; one with a forward hook is called as a module,
    so its hook fires on every prefill and decode step."""
    shapes = []
    lively_model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: shapes.append(o.shape))
    engine = _engine("native", lively_model, tiny_tokenizer)
    generate_all(engine, [_req(prompts[0], temperature=0, max_new_tokens=5)])
    engine.close()
    assert len(shapes) == 5  # 1 prefill + 4 decode steps


@pytest.mark.parametrize("driver", DRIVERS)
def test_cancelled_request_frees_its_slots(driver, lively_model, tiny_tokenizer, prompts):
    engine = _engine(
        "native", lively_model, tiny_tokenizer, max_slots=2, sync_every=1, max_seq_len=200, driver=driver
    )

    async def run():
        slow = asyncio.ensure_future(engine.generate(_req(prompts[0], n=2, max_new_tokens=190, seed=1)))
        await asyncio.sleep(0.02)
        assert slow.cancel()  # still running: 190 decode steps take far longer than 20 ms
        # needs both slots: served only once the cancelled request's slots are freed
        return await asyncio.wait_for(
            engine.generate(_req(prompts[2], n=2, temperature=0, max_new_tokens=5)), 30
        )

    res = asyncio.run(run())
    engine.close()
    assert [c.token_ids for c in res.completions] == [_hf_greedy(lively_model, prompts[2], 5)] * 2


@pytest.mark.parametrize("driver", DRIVERS)
def test_burst_of_requests_starts_as_one_batch(driver, lively_model, tiny_tokenizer, prompts):
    """generate_all's concurrent submissions are coalesced: one generate call / one prefill batch."""
    reqs = [_req(p, temperature=0.5, max_new_tokens=4) for p in prompts]
    hf = _engine("hf", lively_model, tiny_tokenizer, driver=driver)
    generate_all(hf, reqs)
    assert hf.generate_calls == 1
    hf.close()
    native = _engine("native", lively_model, tiny_tokenizer, driver=driver)
    generate_all(native, reqs)
    assert (native.prefill_batches, native.prefill_count) == (1, 5)
    native.close()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_native_greedy_matches_transformers_other_architectures(arch, tiny_tokenizer, prompts):
    """Qwen3 (per-head q/k norms, no q/k/v bias) and Llama (no bias) through the same native forward."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls, cfg_cls = (Qwen3ForCausalLM, Qwen3Config) if arch == "qwen3" else (LlamaForCausalLM, LlamaConfig)
    cfg = cfg_cls(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=EOS,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = cls(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=gen) * 0.3
                if p.dim() == 2
                else 1 + 0.1 * torch.randn(p.shape, generator=gen)
            )
    model.eval()
    engine = _engine("native", model, tiny_tokenizer)
    results = generate_all(engine, [_req(p, temperature=0, max_new_tokens=12) for p in prompts])
    engine.close()
    for p, res in zip(prompts, results, strict=True):
        assert res.completions[0].token_ids == _hf_greedy(model, p, 12)
