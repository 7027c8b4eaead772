"""Token-level micro-batch records built from tokenized samples, shared by the recipes that train on
next-token targets (sft, kd):

    batch = sft_batch(samples, layout)       samples with input_ids / loss_mask -> SFTBatch (one tensor each)

The planner that decides which samples share a micro-batch is packing.py; the forward that runs one is
relayrl.models.forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from relayrl.rollout.media import ImageInputs


@dataclass(kw_only=True, slots=True)
class SFTBatch:
    """One micro-batch: the samples of one forward pass."""

    input_ids: list[torch.Tensor]
    """Per sample, [L_i] int64 token ids."""
    targets: list[torch.Tensor]
    """Per sample, [L_i] bool: token t carries loss (it is predicted from tokens < t; position 0 never)."""
    layout: str = "padded"
    """Attention layout of the forward (relayrl.data.packing.LAYOUTS)."""
    num_tokens: int = 0
    """Real tokens in the micro-batch."""
    images: list[ImageInputs | None] | None = None
    """Per sample, its images (vision-language models), None when no sample has any."""


def sft_batch(samples: Sequence[Any], layout: str) -> SFTBatch:
    """One micro-batch of samples (objects with input_ids, loss_mask) -> SFTBatch."""
    return SFTBatch(
        input_ids=[torch.as_tensor(list(s.input_ids), dtype=torch.long) for s in samples],
        targets=[torch.as_tensor(list(s.loss_mask), dtype=torch.bool) for s in samples],
        layout=layout,
        num_tokens=sum(len(s.input_ids) for s in samples),
        images=[getattr(s, "images", None) for s in samples]
        if any(getattr(s, "images", None) is not None for s in samples)
        else None,
    )
