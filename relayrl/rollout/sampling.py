"""Token sampling on the device, with counter-based randomness (no generator state, no host sync).

    u = uniform(seed[B], counter[B])      # or precomputed: the native engine fills a table at admission
    tok, logprob = sample_tokens(logits[B, V], temperature[B], top_p[B], top_k[B], u, mode)

Randomness: each row draws ONE uniform u = hash(seed, counter) (a 32-bit integer hash evaluated with
int64 tensor ops, 24-bit resolution) and picks the token by inverse CDF: the first token whose cumulative
probability exceeds u * total. `seed` is per sample (derived from the request's seed and the sample
index), `counter` is the position of the token being sampled, so a sample depends only on (seed,
prompt, params) and its own logits, never on which other rows share the batch or on a generator's
consumption order. Being pure tensor code it runs inside a CUDA graph unchanged.

Modes (chosen on the host from the live rows' settings, so graphs are captured per mode):
    "greedy"    every row has temperature 0: argmax
    "sample"    no row truncates: inverse CDF over softmax(logits / T) in vocabulary order
    "truncate"  some row has top_p < 1 or top_k > 0: those rows sample from the sorted, truncated,
                renormalised distribution; the others still use the vocabulary-order path above, so a
                row's sample does not depend on whether a neighbour truncates.
Rows with temperature 0 take the argmax in every mode.

Log-prob (the protocol's semantics): log_softmax(logits / T)[token] before truncation; T = 1 when greedy.

Two implementations of that rule. `sample_tokens_ref`: the torch ops (a [B, V] fp32 log_softmax, its exp and
a full-width cumsum); `sample_tokens` runs it on a CPU and where `fast=False`. On CUDA `sample_tokens` (by
default) runs the untruncated rows through sampling_kernels.py's Triton kernel: one read of the logits, the
sums grouped per block of 4096 entries instead of one running sum (the torch ops took ~0.8 ms of a 7B decode
step at B 256, V 151,936; bench/sampler.py times both). Same u, same rule: a token differs from the reference
only where u * total lands within fp32 rounding of a CDF boundary (tests/rollout/test_sampling_fast.py and
its GPU twin test_sampling_gpu.py, which checks both samplers against the fp64 inverse CDF: on an H200 0.8% of
draws at [256, 151936] differed between the two, each with u within 9e-7 of the fp64 boundary; the bounds are
2e-6 and "the kernel misses fp64 no more often than the reference, + 0.1%"), and log-probs of equal tokens
agree to 1e-5. In "truncate" mode the rows that truncate take the reference's sorted path and the
others the kernel, so a row's token does not depend on the mode. Exact mode (exact.py) keeps the reference:
its log-probs must equal the trainer's log_softmax bit for bit.
"""

from __future__ import annotations

import torch

from relayrl.rollout import sampling_kernels
from relayrl.rollout.kernels import usable

MODES = ("greedy", "sample", "truncate")
_M32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash (C. Wellons) of int64 values in [0, 2^32), computed in int64.

    Products may exceed 2^63 and wrap; masking keeps the low 32 bits, which wrapping leaves exact.
    """
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[B] float32 in [0, 1): a hash of (seed, counter) with 24 random bits."""
    h = hash32(seed ^ hash32(counter * 0x9E3779B9 + 0x632BE5AB))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def mix_seed(seed: int, index: int) -> int:
    """A 31-bit per-sample seed from a request seed and the sample index (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first entry whose running sum exceeds u * total, per row ([B, V] -> [B])."""
    cdf = probs.cumsum(-1)
    target = u[:, None] * cdf[:, -1:]
    return (cdf <= target).sum(-1).clamp_(max=probs.shape[-1] - 1)


def sample_tokens_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    u: torch.Tensor,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with its uniform u [B] (`uniform(seed, counter)`); returns (token [B] int64,
    logprob [B] float32) by the torch ops. See module doc."""
    logits = logits.float()
    argmax = logits.argmax(-1)
    if mode == "greedy":
        logp = torch.log_softmax(logits, -1)
        return argmax, logp.gather(-1, argmax[:, None]).squeeze(-1)
    greedy = temperature <= 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], -1)
    probs = logp.exp()
    tok = _inverse_cdf(probs, u)
    if mode == "truncate":
        sorted_p, order = probs.sort(-1, descending=True)
        ranks = torch.arange(probs.shape[-1], device=probs.device)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]  # the top token is always kept
        keep &= (top_k[:, None] <= 0) | (ranks[None, :] < top_k[:, None])
        trunc_tok = order.gather(-1, _inverse_cdf(sorted_p * keep, u)[:, None]).squeeze(-1)
        truncates = (top_p < 1) | (top_k > 0)
        tok = torch.where(truncates, trunc_tok, tok)
    elif mode != "sample":
        raise ValueError(f"sampling mode must be one of {MODES}, got {mode!r}")
    tok = torch.where(greedy, argmax, tok)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


FAST = True
"""sample_tokens' default on CUDA: the Triton kernel, and vocab_parallel.sample_split's (False: the torch ops
everywhere; the benchmarks' "old" sampler, set before an engine is built, since its CUDA graphs capture the
choice)."""


def fast_default(logits: torch.Tensor) -> bool:
    """sample_tokens' default: the kernel on a CUDA device when triton imports (and FAST), else the torch ops."""
    return FAST and logits.is_cuda and usable(logits.device)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    u: torch.Tensor,
    mode: str,
    *,
    fast: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with its uniform u [B] (`uniform(seed, counter)`); returns (token [B] int64,
    logprob [B] float32). See module doc. `fast`: the Triton kernel for the untruncated rows (None:
    `fast_default`; True on a CPU needs TRITON_INTERPRET=1), False: `sample_tokens_ref`."""
    if mode not in MODES:
        raise ValueError(f"sampling mode must be one of {MODES}, got {mode!r}")
    if not (fast_default(logits) if fast is None else fast):
        return sample_tokens_ref(logits, temperature, top_p, top_k, u, mode)
    tok, lp = sampling_kernels.sample_rows(logits, temperature, u, mode == "greedy")
    if mode != "truncate":
        return tok, lp
    truncates = ((top_p < 1) | (top_k > 0)) & (temperature > 0)
    t_tok, t_lp = sample_tokens_ref(logits, temperature, top_p, top_k, u, mode)
    return torch.where(truncates, t_tok, tok), torch.where(truncates, t_lp, lp)
