"""Batch records and per-sequence reductions shared by the pair recipes (rm, dpo) and kto.

batch = pair_batch(pairs, layout)          PairBatch: 2P sequences, the P chosen first, then the P rejected
sums, counts = response_sums(values, batch.input_ids, batch.targets)    per-sequence sums over responses
last = last_token(values, batch.input_ids)                              per-sequence value at its last token
sums, counts = side_logps(model, batch)    log-probs summed over each sequence's response (dpo, kto)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from relayrl.data.preference import PairSample
from relayrl.models.forward import token_logprobs


@dataclass(kw_only=True, slots=True)
class PairBatch:
    """One micro-batch of P pairs."""

    input_ids: list[Tensor]
    """2P sequences [L_i] int64: the P chosen sides first, then the P rejected sides in the same order."""
    targets: list[Tensor]
    """2P [L_i] bool: the response tokens (loss_mask) of each side."""
    margins: Tensor
    """[P] float32: required reward margins (RM), 0 when none."""
    ref_logps: Tensor | None = None
    """[2P] float32: reference log-probs summed over each side's response (DPO; filled by prepare or precomputed)."""
    ids: list[int] | None = None
    """[P] positions of the pairs in the training / eval list (to store precomputed values)."""
    layout: str = "padded"
    """Attention layout of the forward."""
    num_tokens: int = 0
    """Real tokens in the micro-batch."""

    @property
    def num_pairs(self) -> int:
        return len(self.input_ids) // 2


def pair_batch(pairs: Sequence[PairSample], layout: str) -> PairBatch:
    """Pairs -> PairBatch (reference log-probs carried over when the pairs have them precomputed)."""
    sides = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    refs = [r for p in pairs if (r := getattr(p, "ref_logps", None)) is not None]
    ref = None
    if pairs and len(refs) == len(pairs):
        ref = torch.tensor([r[0] for r in refs] + [r[1] for r in refs], dtype=torch.float32)
    return PairBatch(
        input_ids=[torch.as_tensor(s.input_ids, dtype=torch.long) for s in sides],
        targets=[torch.as_tensor(s.loss_mask, dtype=torch.bool) for s in sides],
        margins=torch.tensor([p.margin for p in pairs], dtype=torch.float32),
        ref_logps=ref,
        layout=layout,
        num_tokens=sum(p.num_tokens for p in pairs),
    )


def _segments(seqs: Sequence[Tensor], device: torch.device) -> Tensor:
    lengths = torch.tensor([len(s) for s in seqs], device=device)
    return torch.repeat_interleave(torch.arange(len(seqs), device=device), lengths)


def response_sums(values: Tensor, seqs: Sequence[Tensor], targets: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """(per-sequence sums of `values` over target tokens [S], target-token counts [S]) from flat [N] values."""
    mask = torch.cat(list(targets)).to(values.device)
    seg = _segments(seqs, values.device)
    sums = values.new_zeros(len(seqs)).index_add(0, seg, torch.where(mask, values, 0.0))
    counts = values.new_zeros(len(seqs)).index_add(0, seg, mask.to(values.dtype))
    return sums, counts


def last_token(values: Tensor, seqs: Sequence[Tensor]) -> Tensor:
    """Each sequence's value at its last token: [S] from flat [N] values."""
    ends = torch.tensor([len(s) for s in seqs], device=values.device).cumsum(0) - 1
    return values[ends]


def side_logps(model: Any, batch: Any) -> tuple[Tensor, Tensor]:
    """(log-probs summed over each sequence's response [S], response token counts [S]) of a batch with
    `input_ids`, `targets` and `layout` (a PairBatch, a KTOBatch's halves)."""
    logp, _ = token_logprobs(model, batch.input_ids, batch.layout)
    return response_sums(logp, batch.input_ids, batch.targets)
