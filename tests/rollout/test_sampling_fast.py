"""The Triton sampler (sampling_kernels.py, sampling.sample_tokens' CUDA default) against the torch reference
(sampling.sample_tokens_ref), on a CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1
without a GPU; skipped without triton). tests/rollout/test_sampling_gpu.py repeats the comparison on the card.

Bounds (sampling.py's module doc): tokens equal except where u lies within 1e-5 of a CDF boundary between the
two tokens (every such row is checked against the fp64 CDF; the kernel regroups the fp32 sums per block of
4096 entries, the reference runs one cumsum); at most 1 such row in the 512 draws here; log-probs of equal
tokens within 1e-5 absolute. The vocabulary (10,000) spans three blocks with a short tail, so the cross-block
search and the masked tail run."""

from __future__ import annotations

import pytest
import torch

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all, sampling
from relayrl.rollout.kernels import usable
from relayrl.rollout.sampling import sample_tokens, sample_tokens_ref, uniform

pytestmark = pytest.mark.skipif(
    not usable(torch.device("cpu")), reason="triton not installed (or no GPU and TRITON_INTERPRET unset)"
)

BOUNDARY = 1e-5
"""A differing token must have a fp64 CDF boundary within this of u (in units of the total mass)."""


def _case(b: int, v: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(b, 1, generator=gen) * 6 + 0.5  # flat to peaked rows
    logits = (torch.randn(b, v, generator=gen) * scale).to(dtype)
    temp = torch.rand(b, generator=gen) * 1.4 + 0.2
    temp[::7] = 0.0  # greedy rows inside a sampling batch
    u = uniform(torch.arange(b, dtype=torch.long) * 7919 + seed, torch.full((b,), 11))
    return logits, temp, torch.ones(b), torch.zeros(b, dtype=torch.long), u


def boundary_rows(logits, temp, u, tok, ref_tok) -> tuple[int, list[float]]:
    """(rows whose tokens differ, the largest |fp64 CDF - u| over the boundaries between each pair)."""
    diff = (tok != ref_tok).nonzero().flatten().tolist()
    gaps = []
    for r in diff:
        t = float(temp[r]) if temp[r] > 0 else 1.0
        p = torch.softmax(logits[r].double() / t, -1)
        cdf = p.cumsum(-1)
        lo, hi = sorted((int(tok[r]), int(ref_tok[r])))
        gaps.append(float((cdf[lo:hi] - float(u[r])).abs().max()))
    return len(diff), gaps


def assert_agrees(logits, temp, top_p, top_k, u, mode, max_differ: int) -> None:
    tok, lp = sample_tokens(logits, temp, top_p, top_k, u, mode, fast=True)
    ref_tok, ref_lp = sample_tokens_ref(logits, temp, top_p, top_k, u, mode)
    n, gaps = boundary_rows(logits, temp, u, tok, ref_tok)
    same = tok == ref_tok
    err = float((lp - ref_lp)[same].abs().max())
    print(f"{mode}: {n} of {len(tok)} tokens differ (boundary gaps {gaps}); max |logprob diff| {err:.2e}")
    assert n <= max_differ and all(g <= BOUNDARY for g in gaps)
    assert err <= 1e-5
    greedy = temp <= 0
    assert torch.equal(tok[greedy], logits[greedy].float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fast_sampler_equals_the_reference(dtype):
    for seed in (0, 1):
        logits, temp, top_p, top_k, u = _case(128, 10_000, seed, dtype)
        assert_agrees(logits, temp, top_p, top_k, u, "sample", max_differ=1)
    assert_agrees(logits, temp, top_p, top_k, u, "greedy", max_differ=0)


def test_masked_vocabulary_and_a_block_of_minus_inf():
    logits, temp, top_p, top_k, u = _case(48, 10_000, 3)
    logits[:, 4096:8192] = float("-inf")  # the whole second block
    logits[:, 9000:] = float("-inf")  # and the tail past the last real token
    for mode in ("sample", "greedy"):
        tok, _ = sample_tokens(logits, temp, top_p, top_k, u, mode, fast=True)
        assert bool(((tok < 4096) | ((tok >= 8192) & (tok < 9000))).all())
        assert_agrees(logits, temp, top_p, top_k, u, mode, max_differ=0)


def test_truncate_mode_takes_the_kernel_for_rows_that_do_not_truncate():
    logits, temp, top_p, top_k, u = _case(48, 10_000, 4)
    top_p[1::3], top_k[2::3] = 0.8, 20  # rows 0, 3, ... do not truncate
    tok, lp = sample_tokens(logits, temp, top_p, top_k, u, "truncate", fast=True)
    plain, plain_lp = sample_tokens(logits, temp, top_p, top_k, u, "sample", fast=True)
    ref, ref_lp = sample_tokens_ref(logits, temp, top_p, top_k, u, "truncate")
    truncates = ((top_p < 1) | (top_k > 0)) & (temp > 0)
    assert torch.equal(tok[~truncates], plain[~truncates]) and torch.equal(
        lp[~truncates], plain_lp[~truncates]
    )
    assert torch.equal(tok[truncates], ref[truncates]) and torch.equal(lp[truncates], ref_lp[truncates])


def test_the_engine_takes_the_kernel_where_it_is_the_default_and_exact_mode_does_not(
    tiny_model, tiny_tokenizer, monkeypatch
):
    """fast_default is True on CUDA; forced here, the engine's sampler calls the kernel, exact mode never."""
    calls = []
    real = sampling.sampling_kernels.sample_rows

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling.sampling_kernels, "sample_rows", spy)
    req = [GenerationRequest(prompt_ids=[5, 6, 7], params=SamplingParams(n=2, max_new_tokens=4, seed=1))]

    def run(exact: bool) -> list:
        calls.clear()
        engine = build_engine("native", tiny_model, tiny_tokenizer, max_slots=4, max_seq_len=32,
                              eos_token_id=[], driver="loop", exact=exact)  # fmt: skip
        try:
            return generate_all(engine, req)[0].completions
        finally:
            engine.close()

    ref = run(False)  # the CPU default: the torch ops
    assert not calls
    monkeypatch.setattr(sampling, "fast_default", lambda logits: True)
    fast = run(False)
    assert calls  # the kernel sampled every step
    for a, b in zip(fast, ref, strict=True):  # the same samples (fp32 logits, u far from CDF boundaries here)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-5
    run(True)
    assert not calls  # exact mode keeps the torch sampler
