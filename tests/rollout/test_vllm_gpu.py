"""GPU checks of the vllm adapter (skipped without CUDA or without the vllm package).

One random-weight tiny Qwen2 (hidden 256, 4 heads of 64, 2 layers, vocab 101, N(0, 0.1^2) matrices so greedy
outputs vary) is saved to a folder and served by vLLM in two configurations, one after the other: fp32
eager, and bf16 with vLLM's defaults (torch.compile + CUDA graphs) plus sleep mode (vLLM allows one sleep-mode
engine per process). References: the native engine on the same weights in the same dtype, and a
teacher-forced fp32 `transformers` forward. Run on an H200 with vLLM 0.26.0: 10 passed in 50 s.

Tolerances. fp32: 0.02 on log-probs and top-2 logit margins (vLLM's attention kernels may use TF32). bf16:
measured per test, 2 x the largest |bf16 - fp32| difference of the same teacher-forced forward in
`transformers` + 0.01, i.e. "vLLM is as close to exact as a bf16 forward is".
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util

import pytest
import torch

from relayrl.models.tiny import TinyModelSpec, build_tiny_model
from relayrl.rollout import FinishReason, GenerationRequest, SamplingParams, build_engine, generate_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm package"),
]

SPEC = TinyModelSpec(hidden=256, layers=2, heads=4, kv_heads=2, max_positions=512)
MAX_SEQ = 128


def _lively(tokenizer, seed: int) -> torch.nn.Module:
    model = build_tiny_model(tokenizer, SPEC)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def setup(request, tiny_tokenizer, tmp_path_factory):
    """(engine, dtype, fp32 reference model on cuda, same-dtype model on cuda)."""
    dtype = request.param
    model = _lively(tiny_tokenizer, seed=0)
    folder = tmp_path_factory.mktemp(f"vllm-{dtype}")
    model.save_pretrained(folder)
    opts = dict(dtype=dtype, gpu_memory_utilization=0.2, seed=0)
    if dtype == "float32":
        opts["enforce_eager"] = True
    else:  # vLLM allows one sleep-mode (CuMem allocator) engine per process
        opts["enable_sleep_mode"] = True
    engine = build_engine("vllm", str(folder), tiny_tokenizer, max_seq_len=MAX_SEQ, **opts)
    print(f"vllm {dtype} start-up {engine.startup_s:.1f} s")
    ref = model.cuda()
    same = copy.deepcopy(ref).to(getattr(torch, dtype))
    yield engine, dtype, ref, same
    engine.close()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _teacher(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """[G, V] fp32 logits that predicted each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen], device="cuda")).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(gen)]


def _tol(dtype, ref, same, seqs) -> float:
    """fp32: 0.02. bf16: 2 x max |logit_bf16 - logit_fp32| (and log-prob) over `seqs` + 0.01."""
    if dtype == "float32":
        return 0.02
    err = 0.0
    for prompt, gen in seqs:
        a, b = _teacher(ref, prompt, gen), _teacher(same, prompt, gen)
        err = max(err, (a - b).abs().max().item())
        err = max(err, (torch.log_softmax(a, -1) - torch.log_softmax(b, -1)).abs().max().item())
    return 2 * err + 0.01


def _greedy(engine, prompts, max_new=24, **kw):
    reqs = [
        GenerationRequest(prompt_ids=p, params=SamplingParams(temperature=0, max_new_tokens=max_new, **kw))
        for p in prompts
    ]
    return [r.completions[0] for r in generate_all(engine, reqs)]


def _check_greedy(engine, model_ref, model_same, dtype, prompts, tokenizer):
    """vLLM greedy = argmax (within tol) at every step, equal to the native engine wherever the fp32
    top-2 margin along the native sequence exceeds tol, and its log-probs = log_softmax(logits)."""
    got = _greedy(engine, prompts)
    native = build_engine("native", model_same, tokenizer, max_slots=8, max_seq_len=MAX_SEQ)
    want = _greedy(native, prompts)
    native.close()
    tol = _tol(dtype, model_ref, model_same, [(p, c.token_ids) for p, c in zip(prompts, got, strict=True)])
    agreed = 0
    for p, g, w in zip(prompts, got, want, strict=True):
        assert len(g.token_ids) == len(g.logprobs) > 0
        assert g.finish_reason == (FinishReason.STOP if g.token_ids[-1] == 1 else FinishReason.LENGTH)
        logits = _teacher(model_ref, p, g.token_ids)
        chosen = logits.gather(-1, torch.tensor(g.token_ids, device="cuda")[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max().item() <= tol
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids, device="cuda")[:, None])[:, 0]
        assert (lp.cpu() - torch.tensor(g.logprobs)).abs().max().item() <= tol
        top2 = _teacher(model_ref, p, w.token_ids).topk(2, -1).values
        clear = [*((top2[:, 0] - top2[:, 1]) > tol).tolist(), False]
        k = clear.index(False)  # first ambiguous step along the native sequence
        assert g.token_ids[:k] == w.token_ids[:k], (k, g.token_ids, w.token_ids)
        same = next(
            (i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=False)) if a != b),
            len(g.token_ids),
        )
        print(f"{dtype}: vllm = native for {same} leading tokens (clear margins: {k}; tol {tol:.3f})")
        agreed += k
    # not vacuous: in fp32 every prompt has clear steps; in bf16 (tol = 2 x the bf16 logit error) few may
    assert agreed >= (len(prompts) if dtype == "float32" else 1)
    return got


def test_greedy_matches_native_and_logits(setup, prompts, tiny_tokenizer):
    engine, dtype, ref, same = setup
    assert engine.startup_s > 0 and engine.eos_ids == [1]
    _check_greedy(engine, ref, same, dtype, prompts, tiny_tokenizer)


def test_sampled_logprobs_are_temperature_scaled_and_seeded(setup, prompts):
    engine, dtype, ref, same = setup
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=16, seed=3)
    reqs = [GenerationRequest(prompt_ids=p, params=params) for p in prompts[:3]]
    first = generate_all(engine, reqs)
    again = generate_all(engine, reqs)
    other = generate_all(
        engine,
        [
            GenerationRequest(
                prompt_ids=p, params=SamplingParams(n=4, temperature=0.7, max_new_tokens=16, seed=4)
            )
            for p in prompts[:3]
        ],
    )
    toks = lambda rs: [[c.token_ids for c in r.completions] for r in rs]  # noqa: E731
    assert toks(first) == toks(again) and toks(first) != toks(other)
    assert all(len({tuple(t) for t in r}) > 1 for r in toks(first))  # the 4 samples differ
    seqs = [(r.prompt_ids, c.token_ids) for r in first for c in r.completions]
    tol = _tol(dtype, ref, same, seqs)
    err_t, err_1 = [], []
    for r in first:
        for c in r.completions:
            logits = _teacher(ref, r.prompt_ids, c.token_ids)
            idx = torch.tensor(c.token_ids, device="cuda")[:, None]
            lp_t = torch.log_softmax(logits / 0.7, -1).gather(-1, idx)[:, 0].cpu()
            lp_1 = torch.log_softmax(logits, -1).gather(-1, idx)[:, 0].cpu()
            got = torch.tensor(c.logprobs)
            err_t.append((got - lp_t).abs())
            err_1.append((got - lp_1).abs())
    err_t, err_1 = torch.cat(err_t), torch.cat(err_1)
    print(f"{dtype}: |lp - log_softmax(z/T)| max {err_t.max():.4f} mean {err_t.mean():.4f}; tol {tol:.3f}")
    assert err_t.max().item() <= tol
    assert err_1.mean().item() > 3 * err_t.mean().item()  # T-scaled, not vLLM's raw (T = 1) log-probs


def test_stop_ids_lengths_and_bad_input(setup, prompts):
    engine = setup[0]
    base = _greedy(engine, [prompts[1]], max_new=16)[0].token_ids
    j = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    stopped = _greedy(engine, [prompts[1]], max_new=16, stop_token_ids=(base[j],))[0]
    assert stopped.token_ids == base[: j + 1] and stopped.finish_reason == FinishReason.STOP
    assert len(stopped.logprobs) == j + 1
    short = _greedy(engine, [prompts[1]], max_new=3)[0]
    assert short.token_ids == base[:3] and short.finish_reason == FinishReason.LENGTH
    # the length limit counts the prompt: 120 + 16 > MAX_SEQ=128 -> 8 tokens
    capped = _greedy(engine, [[5] * 120], max_new=16)[0]
    assert len(capped.token_ids) == 8 or capped.finish_reason == FinishReason.STOP
    full = _greedy(engine, [[5] * MAX_SEQ])[0]
    assert full.token_ids == [] and full.finish_reason == FinishReason.LENGTH
    with pytest.raises(ValueError, match="outside the vocabulary"):
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=[3, 500])))


def test_load_weights_in_place_then_back(setup, prompts, tiny_tokenizer):
    engine, dtype, ref, _ = setup
    before = [c.token_ids for c in _greedy(engine, prompts)]
    new_ref = _lively(tiny_tokenizer, seed=1).cuda()
    new_same = copy.deepcopy(new_ref).to(getattr(torch, dtype))
    engine.load_weights(new_ref.named_parameters())
    after = _check_greedy(engine, new_ref, new_same, dtype, prompts, tiny_tokenizer)
    assert [c.token_ids for c in after] != before
    engine.load_weights(ref.named_parameters())
    assert [c.token_ids for c in _greedy(engine, prompts)] == before
    with pytest.raises(ValueError, match="own copy"):
        engine.load_weights(None)


def test_sleep_frees_memory_and_wake_up_restores(setup, prompts):
    engine = setup[0]
    before = [c.token_ids for c in _greedy(engine, prompts)]
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free1 = torch.cuda.mem_get_info()[0]
    print(f"sleep (sleep mode {engine.sleep_mode}) freed {(free1 - free0) / 2**30:.2f} GiB")
    if engine.sleep_mode:  # weights and KV cache (gpu_memory_utilization=0.2 of the card) released
        assert free1 - free0 > 2**30
    else:  # without sleep mode, sleep() only aborts in-flight requests
        assert abs(free1 - free0) < 2**28
    engine.wake_up()
    assert [c.token_ids for c in _greedy(engine, prompts)] == before
