"""Forward passes the workers share: per-token log-probs / entropy of a causal LM and values of a critic,
computed on micro-batches of rows of a SequenceBatch and returned in its padded [B, T] layout.

    layout = choose_layout(model, device)                                 varlen (GPU) | padded (CPU)
    budgets = TokenBudgets(model=model, device=device, update=0, infer=0)  # 0: auto (models.budget)
    update_tokens, infer_tokens = budgets.get()                           resolved once, at the first pass
    for rows in plan_micro_batches(batch.lengths, budget, layout):        token-budget bins (data.packing)
        lp, ent = row_logprobs(model, batch, rows, layout, temperature=1.0, entropy=True)    # [R, T_rows]
        v = critic_values(critic, batch, rows, layout)                                      # [R, T_rows]

The forward itself is relayrl.models.forward: on a GPU the rows of a micro-batch are packed into one row and
attention runs per sequence with variable-length kernels; on a CPU they are length-bucketed padded rows with
plain causal attention. Neither builds a dense [N, N] mask. Results come back flat per token and are laid
out as [len(rows), longest row] (row = sequence, column = position, 0 past a row's end), which is what the
algorithm functions expect. Token alignment (relayrl/workers/base.py): column t is the quantity of token t
given its prefix; column 0 (no prefix) is 0.

Log-probs go through relayrl.models.logprobs (hidden states x lm_head in chunks): no [B, T, V] fp32 tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from relayrl.data.packing import plan_micro_batches
from relayrl.distributed.group import in_group, my_data_share, reports
from relayrl.models import forward
from relayrl.models.budget import pending_optimizer_bytes, token_budgets
from relayrl.models.moe import moe_pass
from relayrl.models.vlm import images_for
from relayrl.rollout.media import ImageInputs
from relayrl.training.collectives import comm_device
from relayrl.training.step import padded_passes
from relayrl.workers.base import Rows, SequenceBatch


def _rows(batch: SequenceBatch, rows: list[int]) -> tuple[list[Tensor], list[int], int]:
    lengths = batch.lengths
    seqs = [batch.input_ids[r, : lengths[r]] for r in rows]
    sub = [lengths[r] for r in rows]
    return seqs, sub, max(sub)


def _images(batch: SequenceBatch, rows: list[int]) -> list[ImageInputs | None] | None:
    """The images of `rows` (vision-language models; relayrl.models.vlm.images_for), None for text."""
    return None if batch.images is None else [batch.images[r] for r in rows]


def row_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    rows: list[int],
    layout: str,
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    aux_losses: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(log-probs, entropy or None), each [len(rows), T_rows] float32 on the model's device; column 0 is 0.
    Differentiable when grad is enabled. Entropy is that of the temperature-scaled next-token distribution
    at the position that produced the token. A mixture-of-experts model replays the batch's recorded routes
    (routing replay, relayrl/models/moe.py) and, with `aux_losses`, appends its router load-balancing loss."""
    seqs, lengths, width = _rows(batch, rows)
    with (
        images_for(_images(batch, rows)),
        moe_pass(lengths, routes=batch.flat_routes(rows), collect=aux_losses is not None) as moe,
    ):
        lp, ent = forward.token_logprobs(model, seqs, layout, temperature=temperature or 1.0, entropy=entropy)
    aux = moe.aux_loss()
    if aux_losses is not None and aux is not None:
        aux_losses.append(aux)
    lp = forward.to_padded(lp, lengths, width)
    return lp, (forward.to_padded(ent, lengths, width) if ent is not None else None)


def critic_values(critic: torch.nn.Module, batch: SequenceBatch, rows: list[int], layout: str) -> Tensor:
    """Values [len(rows), T_rows] float32: `values[:, t] = V(x_<t)` (the value head at position t-1)."""
    seqs, lengths, width = _rows(batch, rows)
    with images_for(_images(batch, rows)):  # [N]: the value of each token's state (its prefix included)
        v = forward.token_values(critic, seqs, layout)
    shifted = torch.zeros_like(v)
    starts = forward.to_device(torch.tensor([0, *lengths]).cumsum(0)[:-1], v.device)
    shifted[1:] = v[:-1]
    shifted[starts] = 0.0  # a sequence's first token has no prefix
    return forward.to_padded(shifted, lengths, width)


@torch.no_grad()
def masked_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    budget: int,
    temperature: float,
    layout: str,
    autocast: Callable[[], AbstractContextManager[Any]],
) -> Tensor:
    """Log-probs [B, T] (float32, CPU) of the whole batch, micro-batched by `budget`; 0 off the action mask.
    `autocast` is a context-manager factory (the role's compute precision). Under a process group every rank
    runs the same number of forwards (padding passes; their results are dropped). The micro-batches' results
    gather on the model's device and come back to the host once (`gather_rows`), so the host never waits for
    the device between passes."""
    out = RowGather(batch.input_ids.shape)
    for rows, weight in padded_passes(plan_micro_batches(batch.lengths, budget, layout), None):
        with autocast():
            lp, _ = row_logprobs(model, batch, rows, layout, temperature=temperature)
        if weight:
            out.put(rows, lp)
    return out.result() * batch.action_mask


class RowGather:
    """A [B, T] float32 result filled micro-batch by micro-batch on the device its pieces come from, read back
    to the host once (`result`): one device-to-host copy per pass over the batch, not one per micro-batch."""

    def __init__(self, shape: torch.Size | tuple[int, ...]) -> None:
        self.shape = tuple(shape)
        self.out: Tensor | None = None

    def put(self, rows: list[int], piece: Tensor) -> None:
        """Rows `rows` (columns [0, piece width)) := `piece` [len(rows), width]."""
        if self.out is None:
            self.out = torch.zeros(self.shape, dtype=torch.float32, device=piece.device)
        idx = forward.to_device(torch.as_tensor(rows, dtype=torch.long), piece.device)
        self.out[idx, : piece.shape[1]] = piece.float()

    def result(self) -> Tensor:
        """The filled [B, T] float32 CPU tensor (zeros where nothing was put)."""
        return torch.zeros(self.shape, dtype=torch.float32) if self.out is None else self.out.cpu()


def my_rows(batch: Rows[SequenceBatch]) -> list[int]:
    """This rank's rows of `batch`: a contiguous share balanced by token count (all rows on one rank; the
    ranks of a sequence-parallel group share theirs)."""
    return list(my_data_share(batch.lengths))


def on_my_rows(batch: Rows[SequenceBatch], fn: Callable[[SequenceBatch], Tensor]) -> Tensor:
    """`fn` on this rank's rows -> [rows, T] at the batch's full width T (so the ranks' pieces concatenate
    along dim 0 into [B, T]); only these rows are read from `batch`. A rank without rows (fewer rows than
    ranks) runs `fn` on row 0 to keep the ranks' collectives in step, and returns an empty [0, T]; so does a
    sequence-parallel group's rank after its first (the same rows)."""
    rows = my_rows(batch)
    piece = fn(batch.select(rows or [0]))
    rows = rows if reports() else []
    out = torch.zeros((len(rows), batch.width), dtype=piece.dtype)
    out[:, : piece.shape[1]] = piece[: len(rows)]
    return out


@dataclass(kw_only=True, slots=True)
class TokenBudgets:
    """A role's micro-batch token budgets (update, inference), each as configured (0: auto), resolved once at
    the first call of `get` (relayrl.models.budget.token_budgets): by then the engine's cache and the weights
    are on the device, so the free memory it reads is what the passes will find."""

    model: torch.nn.Module
    """The role's model (its shape sets the activation bytes per token)."""
    device: torch.device
    """Where it computes."""
    update: int
    """Configured training budget (algo.micro_batch_tokens; 0: auto)."""
    infer: int
    """Configured no-gradient budget (algo.infer_micro_batch_tokens; 0: auto)."""
    precision: str = "fp32"
    """The role's compute precision (TrainStep.precision): bf16 halves the activation bytes."""
    optimizer: torch.optim.Optimizer | None = None
    """A trained role's optimizer: states not allocated yet are kept out of the memory the budget uses."""
    resolved: tuple[int, int] | None = field(default=None, init=False)

    def get(self) -> tuple[int, int]:
        """(update tokens, inference tokens). Under a process group an automatic budget is the smallest over
        the ranks (one all-reduce, at the first call, which every rank of a role makes in the same method):
        the ranks of a sequence-parallel group must cut the same micro-batches."""
        if self.resolved is None:
            update, infer = token_budgets(
                self.model,
                self.device,
                update=self.update,
                infer=self.infer,
                pending_bytes=pending_optimizer_bytes(self.optimizer) if self.optimizer is not None else 0,
                compute_dtype=torch.bfloat16 if self.precision == "bf16" else torch.float32,
            )
            if in_group() and 0 in (self.update, self.infer):
                both = torch.tensor([update, infer], dtype=torch.int64, device=comm_device())
                torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MIN)
                update, infer = (int(x) for x in both.tolist())
            self.resolved = (update, infer)
        return self.resolved
