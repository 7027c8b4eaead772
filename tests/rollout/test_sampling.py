"""The device sampler: counter-based uniforms, inverse-CDF sampling, truncation, log-prob semantics."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.rollout.sampling import hash32, mix_seed, sample_tokens, uniform


def _lowbias32(x: int) -> int:
    """Reference loop: C. Wellons' lowbias32 on Python ints."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash32_matches_reference_loop_including_int64_wraparound():
    xs = [
        0,
        1,
        2,
        12345,
        0x7FFFFFFF,
        0xFFFFFFFF,
        0xDEADBEEF,
    ]  # 0xDEADBEEF * 0x846CA68B > 2^63: wraps in int64
    assert hash32(torch.tensor(xs)).tolist() == [_lowbias32(x) for x in xs]
    assert _lowbias32(0) == 0 and _lowbias32(1) != 1


def test_uniform_is_deterministic_and_spread():
    seeds = torch.arange(20000) * 7919
    u = uniform(seeds, torch.full_like(seeds, 3))
    assert torch.equal(u, uniform(seeds, torch.full_like(seeds, 3)))
    assert u.min() >= 0 and u.max() < 1
    # mean of U(0,1) is 1/2 with std 1/sqrt(12 * 20000) = 0.002; 5 sigma
    assert abs(u.mean().item() - 0.5) < 0.01
    assert not torch.equal(u, uniform(seeds, torch.full_like(seeds, 4)))  # the counter matters


def test_mix_seed_distinct_per_sample_and_31_bit():
    vals = {mix_seed(s, j) for s in range(50) for j in range(8)}
    assert len(vals) == 400 and all(0 <= v < 2**31 for v in vals)


def _rows(logits, n, **settings):
    b = n
    return dict(
        logits=logits.expand(b, -1).clone(),
        temperature=torch.full((b,), settings.get("temperature", 1.0)),
        top_p=torch.full((b,), settings.get("top_p", 1.0)),
        top_k=torch.full((b,), settings.get("top_k", 0), dtype=torch.long),
        u=uniform(torch.arange(b, dtype=torch.long) * 2654435761 % (2**31), torch.full((b,), 5)),
    )


def test_sample_frequencies_follow_softmax():
    # probs [0.5, 0.3, 0.2]; 20000 draws: binomial std <= sqrt(0.25 / 20000) = 0.0035; 5 sigma = 0.018
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    tok, lp = sample_tokens(**_rows(logits, 20000), mode="sample")
    freq = torch.bincount(tok, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.018)
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.5, 0.3, 0.2]))[tok])


def test_temperature_sharpens_and_logprob_is_of_scaled_softmax():
    # T = 0.5 squares the odds: softmax([log .5, log .3, log .2] / .5) = [.25, .09, .04] / .38
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    tok, lp = sample_tokens(**_rows(logits, 20000, temperature=0.5), mode="sample")
    expected = torch.tensor([0.25, 0.09, 0.04]) / 0.38
    freq = torch.bincount(tok, minlength=3).float() / 20000
    assert torch.allclose(freq, expected, atol=0.018)
    torch.testing.assert_close(lp, torch.log(expected)[tok])


def test_top_p_top_k_truncate_but_logprob_does_not():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    # top_p = 0.7 keeps {0.5, 0.25} (0.5 < 0.7, 0.75 >= 0.7): renormalised 2/3, 1/3
    tok, lp = sample_tokens(**_rows(logits, 20000, top_p=0.7), mode="truncate")
    freq = torch.bincount(tok, minlength=4).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.0, 2 / 3, 0.0, 1 / 3]), atol=0.018)
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.1, 0.5, 0.15, 0.25]))[tok])
    # top_k = 3 keeps {0.5, 0.25, 0.15}: 0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9
    tok, _ = sample_tokens(**_rows(logits, 20000, top_k=3), mode="truncate")
    freq = torch.bincount(tok, minlength=4).float() / 20000
    assert freq[0] == 0 and torch.allclose(freq, torch.tensor([0, 5, 1.5, 2.5]) / 9, atol=0.018)


def test_truncate_mode_leaves_untruncated_rows_unchanged():
    """A row with top_p = 1 samples the same token whether or not its batch runs the truncate path."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    rows = _rows(logits, 64)
    plain, _ = sample_tokens(**rows, mode="sample")
    rows["top_p"][::2] = 0.5
    mixed, _ = sample_tokens(**rows, mode="truncate")
    assert torch.equal(plain[1::2], mixed[1::2])


def test_greedy_rows_take_argmax_with_untempered_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    rows = _rows(logits[:1], 2)
    rows["logits"] = logits
    rows["temperature"] = torch.tensor([0.0, 0.0])
    for mode in ("greedy", "sample", "truncate"):
        tok, lp = sample_tokens(**rows, mode=mode)
        assert tok.tolist() == [1, 0]
        # log softmax([0, 2, 1])[1] = 2 - log(1 + e^2 + e)
        assert math.isclose(lp[0].item(), 2 - math.log(1 + math.e**2 + math.e), rel_tol=1e-6)


def test_sampling_params_max_tokens_alias_for_openrlhf_agents():
    from relayrl.rollout.base import SamplingParams

    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
