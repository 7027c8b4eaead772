"""The native engine's prefix cache, device side: one batched prefill for every request admitted in a step.

The host side (which slot holds which tokens, matching a prompt to a parked slot) is slots.py's SlotPool. When
a step admits requests and at least one continues a cached sequence (the next turn of a multi-turn episode),
ALL of that step's requests go through ONE `suffix_prefill` call: request b contributes its uncached tokens
prompt[start_b:] (a fresh prompt: start 0, the whole prompt), right-padded to a common width, and reads its
cached prefix K/V [0, start_b) from its slot (DecoderRunner.extend). So a burst of next turns costs one
forward, like a burst of fresh prompts, instead of one forward per request or one for cached and one for fresh.
Shapes are rounded (width to SUFFIX_WIDTH_STEP tokens, attended length to KV_STEP in the runner) so a
multi-turn run reuses a few kernel configurations instead of one per (batch, width, length).

Exactness: does a cached turn give what a full re-prefill would?
- Exact mode (`NativeEngine(exact=True)`, rollout/exact.py): yes, bit for bit, in every dtype and on every
  device -- the same trajectories (token ids and log-probs) with the cache on and off. Each token's values are
  ONE computation fixed by its token, its position and the K/V of the positions before it: every matmul row
  meets the same kernel whatever the row count (GPU: exact_kernels.matmul, tiles fixed by the weight's shape,
  no split-K; CPU: GEMMs of exactly row_block rows), attention runs per query over key blocks anchored at
  position 0 in a fixed order (keys past the query are exact no-ops, so padding, the length bucket and the
  batch do not matter), norms are per row, rotary per token from an fp32 table, and the sampler works per
  row (log_softmax, cumulative sum over the vocabulary, a uniform drawn from (seed, position)). By induction
  over positions, the K/V at position j are the same bits whether a decode step of turn k, this module's
  suffix prefill of turn k + 1 or an uncached prefill of the whole conversation wrote them, so every later
  logit, token and log-prob is too. The CPU test (tests/rollout/test_prefix_cache_exact.py) runs this through
  the engine on multi-turn episodes (fp32 and bf16, ==, no tolerance) on the torch ops; on a GPU the Triton
  kernels have the same invariances (tests/rollout/test_exact_kernels.py checks them under Triton's
  interpreter; bench/exact_mode.py measured engine == trainer bit for bit on an H200, the same property
  between a prefill + decode and one full-sequence forward), and bench/multiturn.py's `*/exact` configs
  count identical trajectories on the GPU itself.
- Default mode: the same model and sampling, not the same bits. On a GPU a token's K/V written by a decode
  step (a GEMM of M = batch rows) and by a prefill (M = padded prompt tokens) come from kernels that round
  differently (cuBLAS picks tiles and split-K by shape), and masked attention over the cache reduces in
  another order than a causal prefill; each is ~1 ulp, but one flipped sampled token changes the rest of an
  episode (H200, 2026-11-27: 92/128 identical in fp32, 0/384 in bf16). That is the same kind of difference
  as running a prompt in another batch, which the default engine does not promise to be bitwise stable
  either (native.py, Guarantees). On a CPU (MKL) fp32 token ids happen to agree on the guess task, log-probs
  within 1e-5 (tests/rollout/test_prefix_cache.py), not bit for bit; bf16 drifts.

`PREFIX_CACHE_ON_CUDA` is the switch for engines built with `prefix_cache=None` (agents' engines) on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relayrl.rollout.native_model import DecoderRunner

PREFIX_CACHE_ON_CUDA = True
"""Whether `prefix_cache=None` turns the cache on for a model on CUDA (on a CPU it is always on). On since the
H200 run of 2026-11-27 13:00 UTC (docs/benchmarks.md) met the condition below: guess/fp32/exact 1.40x with
384/384 trajectories identical (ids and log-probs), long/fp32/exact 64/64 identical (1.54x, one round),
guess/bf16/default 1.06x, long/bf16/default 1.56x. Before: an H100 (2026-11-26) ran bench/multiturn.py at 0.49x
of no cache with the earlier per-request suffix prefill; an H200 (2026-11-27 morning) at 1.13x (bf16) with the
batched one. The condition (turn it off again if a GPU run of
`python bench/multiturn.py --device cuda --shape qwen0.5b --configs all` (3 timed rounds, medians) shows all
of: guess/fp32/exact >= 1.3x with every trajectory identical (the target); every */exact config identical
(ids and log-probs); guess/bf16/default >= 1.0x (never slower on the cache's worst case: short turns) and
long/bf16/default >= 1.3x (an agent's shape; bf16 default mode is what agents' engines run): the bench prints
and stores this verdict (`flip_verdict`)."""

SUFFIX_WIDTH_STEP = 16
"""Suffix batches are right-padded to a multiple of this many tokens."""


def default_prefix_cache(device: torch.device) -> bool:
    """The prefix cache of an engine built with `prefix_cache=None` on `device` (see PREFIX_CACHE_ON_CUDA)."""
    return device.type != "cuda" or PREFIX_CACHE_ON_CUDA


@dataclass(frozen=True, slots=True)
class Suffix:
    """One admitted request's part of a suffix prefill."""

    tokens: list[int]
    """The prompt tokens whose K/V are not cached yet: prompt[start:]."""
    start: int
    """Tokens of the prompt whose K/V the first slot already holds (0: a fresh prompt)."""
    slots: list[int]
    """Slots that take this request's K/V (its n samples); the first is the one read (and, with start > 0, the
    one that holds the prefix)."""


def suffix_prefill(
    runner: DecoderRunner, k_cache: torch.Tensor, v_cache: torch.Tensor, suffixes: list[Suffix]
) -> torch.Tensor:
    """Prefill every suffix in one forward; returns logits [len(suffixes), V] at each one's last token."""
    longest = max(len(s.tokens) for s in suffixes)
    width = -(-longest // SUFFIX_WIDTH_STEP) * SUFFIX_WIDTH_STEP
    ids = torch.zeros((len(suffixes), width), dtype=torch.long)
    for b, s in enumerate(suffixes):
        ids[b, : len(s.tokens)] = torch.tensor(s.tokens)
    return runner.extend(
        ids.to(runner.device),
        [s.start for s in suffixes],
        [len(s.tokens) for s in suffixes],
        k_cache,
        v_cache,
        [s.slots for s in suffixes],
    )
