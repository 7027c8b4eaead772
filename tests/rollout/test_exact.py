"""Exact on-policy mode (relayrl/rollout/exact.py): the native engine's sampled-token log-probs equal the
trainer's recomputation (models.forward.token_logprobs, layout "exact") bit for bit (torch.equal, no
tolerance), for prompts of different lengths, n samples, fp32 and bf16, whatever the batch the engine ran
them in; with the mode off they differ (so these tests can fail)."""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.models import forward
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, exact, generate_all
from relayrl.rollout.exact import ExactRunner, attention, linear
from relayrl.rollout.kernels import usable


def _generate(model, tok, prompts, order, *, exact, slots, temperature=1.0, n=3, new_tokens=14):
    engine = build_engine(
        "native", model, tok, max_slots=slots, max_seq_len=96, eos_token_id=[], driver="loop", exact=exact
    )
    reqs = [
        GenerationRequest(
            prompt_ids=prompts[i],
            params=SamplingParams(n=n, temperature=temperature, max_new_tokens=new_tokens, seed=i),
        )
        for i in order
    ]
    try:
        return dict(zip(order, generate_all(engine, reqs), strict=True))
    finally:
        engine.close()


def _trainer_logprobs(model, prompts, results, layout, temperature=1.0):
    """(engine, trainer) log-prob tensors of every completion, in one trainer call over all sequences."""
    seqs, spans, engine_lps = [], [], []
    for i, res in results.items():
        for c in res.completions:
            seqs.append(torch.tensor(prompts[i] + c.token_ids))
            spans.append((len(prompts[i]), len(prompts[i]) + len(c.token_ids)))
            engine_lps.append(torch.tensor(c.logprobs))
    with torch.no_grad():
        lp, _ = forward.token_logprobs(model, seqs, layout, temperature=temperature)
    flat = forward.split_flat(lp, [len(s) for s in seqs])
    return engine_lps, [row[a:b] for row, (a, b) in zip(flat, spans, strict=True)]


@pytest.mark.parametrize(
    ("dtype", "temperature"), [(torch.float32, 1.0), (torch.bfloat16, 0.7)], ids=["fp32-T1", "bf16-T0.7"]
)
def test_engine_logprobs_equal_the_trainers_bit_for_bit(
    lively_model, tiny_tokenizer, prompts, dtype, temperature
):
    model = lively_model.to(dtype)
    everything = _generate(
        model, tiny_tokenizer, prompts, [0, 1, 2, 3, 4], exact=True, slots=16, temperature=temperature
    )
    engine_lps, trainer_lps = _trainer_logprobs(model, prompts, everything, "exact", temperature)
    for e, t in zip(engine_lps, trainer_lps, strict=True):
        assert torch.equal(e, t)
    # another batch composition (two prompts, fewer slots: other decode batch sizes and prefill widths)
    few = _generate(model, tiny_tokenizer, prompts, [3, 1], exact=True, slots=4, temperature=temperature)
    for i, res in few.items():
        for a, b in zip(everything[i].completions, res.completions, strict=True):
            assert a.token_ids == b.token_ids and torch.equal(
                torch.tensor(a.logprobs), torch.tensor(b.logprobs)
            )
    # the trainer's micro-batching does not matter either: one sequence alone gives the same values
    _, alone = _trainer_logprobs(model, prompts, {3: few[3]}, "exact", temperature)
    assert torch.equal(alone[0], trainer_lps[3 * 3])


@pytest.mark.skipif(not usable(torch.device("cpu")), reason="triton not installed or TRITON_INTERPRET unset")
def test_triton_kernels_path_is_bit_equal_too(lively_model, tiny_tokenizer, prompts, monkeypatch):
    """The GPU path (exact_kernels.py: fixed-tile matmul, position-anchored attention, per-row norms) run by
    Triton's interpreter on the CPU in fp32: engine == trainer bit for bit, across batch compositions."""
    monkeypatch.setattr(exact, "use_kernels", lambda device: True)
    assert ExactRunner(lively_model, 32).triton
    run = dict(exact=True, n=2, new_tokens=5)  # (small: the interpreter runs each launch in numpy)
    everything = _generate(lively_model, tiny_tokenizer, prompts, [1, 3], slots=4, **run)
    engine_lps, trainer_lps = _trainer_logprobs(lively_model, prompts, everything, "exact")
    for e, t in zip(engine_lps, trainer_lps, strict=True):
        assert torch.equal(e, t)
    few = _generate(lively_model, tiny_tokenizer, prompts, [3], slots=2, **run)
    for i, res in few.items():
        for a, b in zip(everything[i].completions, res.completions, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_with_the_mode_off_engine_and_trainer_differ(lively_model, tiny_tokenizer, prompts):
    results = _generate(lively_model, tiny_tokenizer, prompts, [0, 1, 2, 3, 4], exact=False, slots=16)
    engine_lps, trainer_lps = _trainer_logprobs(lively_model, prompts, results, "padded")
    diffs = [float((e - t).abs().max()) for e, t in zip(engine_lps, trainer_lps, strict=True)]
    assert max(diffs) > 0.0  # close (fp32 rounding, < 1e-3) but not equal
    assert max(diffs) < 1e-3


def test_linear_rows_do_not_depend_on_the_other_rows():
    """The fixed-row GEMM: a row's product is the same alone, in a small batch or in a large one (plain
    matmul is not: MKL rounds small-M products differently on this CPU)."""
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 80, generator=gen), torch.randn(40, 80, generator=gen)
    full = linear(x, w)
    for rows in (slice(0, 1), slice(5, 8), slice(3, 40)):
        assert torch.equal(linear(x[rows], w), full[rows])


def test_attention_ignores_keys_past_the_query_and_the_cache_length():
    """A query's output is the same over its own keys, a longer padded cache, or garbage after its position."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 1, 4, 8, generator=gen)
    k, v = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8, generator=gen)
    pos = torch.tensor([[20]])
    ref = attention(q, k[:, :, :21], v[:, :, :21], pos, 0.3)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 21:], v2[:, :, 21:] = 1e3, -7.0
    assert torch.equal(attention(q, k2, v2, pos, 0.3), ref)
    dense = torch.softmax((q[0, 0].view(2, 2, 8) @ k[0, :, :21].transpose(1, 2)) * 0.3, -1) @ v[0, :, :21]
    torch.testing.assert_close(ref[0, 0], dense.reshape(4, 8), rtol=1e-5, atol=1e-6)  # it is attention


def test_exact_training_forward_has_the_true_gradient(lively_model):
    """The exact layout is the same function as the default one up to rounding, and autograd through it
    (attention and head recomputed in backward) gives the same gradient (rtol 1e-4 of the largest entry)."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 90, (n,), generator=gen) for n in (7, 30, 19)]
    grads = {}
    for layout in ("padded", "exact"):
        lively_model.zero_grad()
        lp, ent = forward.token_logprobs(lively_model, seqs, layout, entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads[layout] = (lp.detach(), [p.grad.clone() for p in lively_model.parameters()])
    torch.testing.assert_close(grads["exact"][0], grads["padded"][0], rtol=0, atol=1e-4)
    for a, b in zip(grads["exact"][1], grads["padded"][1], strict=True):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()


def test_bf16_engine_copy_equals_fp32_master_under_autocast(lively_model, tiny_tokenizer, prompts):
    """The RL trainer's GPU setup, on the CPU: the engine samples from a bf16 copy of the weights, the trainer
    recomputes with the fp32 master weights under bf16 autocast. Bit-equal all the same."""
    engine_model = copy.deepcopy(lively_model).to(torch.bfloat16)
    results = _generate(engine_model, tiny_tokenizer, prompts, [0, 1, 2, 3, 4], exact=True, slots=16)
    with torch.autocast("cpu", torch.bfloat16):
        engine_lps, trainer_lps = _trainer_logprobs(lively_model, prompts, results, "exact")
    for e, t in zip(engine_lps, trainer_lps, strict=True):
        assert torch.equal(e, t)


def test_prefix_cache_turn_equals_the_trainer(lively_model, tiny_tokenizer, prompts):
    """A second turn prefilled after the cached prefix (DecoderRunner.extend's exact variant) scores like the
    trainer's forward over the whole conversation."""
    engine = build_engine(
        "native",
        lively_model,
        tiny_tokenizer,
        max_slots=4,
        max_seq_len=96,
        eos_token_id=[],
        driver="loop",
        exact=True,
        prefix_cache=True,
    )
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=10, seed=3)
    try:
        first = generate_all(engine, [GenerationRequest(prompt_ids=prompts[3], params=params)])[0]
        turn2 = prompts[3] + first.completions[0].token_ids + prompts[4]
        second = generate_all(engine, [GenerationRequest(prompt_ids=turn2, params=params)])[0]
        assert engine.cached_tokens > 0  # the second turn went through extend
    finally:
        engine.close()
    engine_lps, trainer_lps = _trainer_logprobs(lively_model, {0: turn2}, {0: second}, "exact")
    assert torch.equal(engine_lps[0], trainer_lps[0])
