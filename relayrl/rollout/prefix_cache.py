"""The native engine's prefix cache, device side: one batched prefill for every request admitted in a step.

The host side (which slot holds which tokens, matching a prompt to a parked slot) is slots.py's SlotPool. When
a step admits requests and at least one continues a cached sequence (the next turn of a multi-turn episode),
ALL of that step's requests go through ONE `suffix_prefill` call: request b contributes its uncached tokens
prompt[start_b:] (a fresh prompt: start 0, the whole prompt), right-padded to a common width, and reads its
cached prefix K/V [0, start_b) from its slot (DecoderRunner.extend). So a burst of next turns costs one
forward, like a burst of fresh prompts, instead of one forward per request or one for cached and one for fresh.
Shapes are rounded (width to SUFFIX_WIDTH_STEP tokens, attended length to KV_STEP in the runner) so a
multi-turn run reuses a few kernel configurations instead of one per (batch, width, length).

`PREFIX_CACHE_ON_CUDA` is the switch for engines built with `prefix_cache=None` (agents' engines) on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relayrl.rollout.native_model import DecoderRunner

PREFIX_CACHE_ON_CUDA = False
"""Whether `prefix_cache=None` turns the cache on for a model on CUDA (on a CPU it is always on). Off: on an
H100 (2026-11-26) the earlier implementation ran bench/multiturn.py at 0.49x of no cache. Flip to True only once
`python bench/multiturn.py --device cuda --shape qwen0.5b --rounds 3` shows a median speed-up >= 1.3x."""

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
