"""Forward passes the workers share: per-token log-probs / entropy of a causal LM and values of a critic,
computed on *packed* micro-batches and returned in the padded [B, T] layout of relayrl/workers/base.py.

    for rows in micro_batches(batch, budget):                        # token-budget bins (first-fit-decreasing)
        lp, ent = token_logprobs(model, batch, rows, temperature=1.0, entropy=True)   # [len(rows), T_rows]
        v = critic_values(critic, batch, rows)                                        # [len(rows), T_rows]

Packing (relayrl.data.packing.pack): the rows are concatenated into one [1, N] row with position ids that
restart per sequence, so no compute is spent on padding and attention never crosses sequences. Because of the
token alignment (`x[:, t]` is the quantity of token t given its prefix) the shifted log-prob at a
sequence's first position would read the previous sequence's last hidden state — that position is always a
prompt token (action_mask False), so it is never used. Results are scattered back to the padded layout
(row = sequence, column = position id), which is what the algorithm functions expect.

Log-probs go through relayrl.models.logprobs (hidden states x lm_head in chunks): no [B, T, V] fp32 tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relayrl.data.packing import pack, plan_token_budget
from relayrl.workers.base import SequenceBatch


def micro_batches(batch: SequenceBatch, budget: int) -> list[list[int]]:
    """Row indices of each micro-batch: bins of at most `budget` real tokens (a longer row is alone)."""
    return plan_token_budget(batch.lengths, budget)


def _packed(batch: SequenceBatch, rows: list[int], device: torch.device):
    lengths = batch.lengths
    seqs = [batch.input_ids[r, : lengths[r]].tolist() for r in rows]
    pb = pack(seqs, pad_id=0)
    return pb, {k: v.to(device) for k, v in pb.model_inputs().items() if isinstance(v, Tensor)}


def _unpack(pb, values: Tensor, n_rows: int, width: int) -> Tensor:
    """[1, N] packed values -> [n_rows, width] padded (zeros on padding)."""
    out = torch.zeros((n_rows, width), dtype=values.dtype, device=values.device)
    sid = pb.seq_ids[0].to(values.device)
    pos = pb.position_ids[0].to(values.device)
    real = sid >= 0
    out[sid[real], pos[real]] = values[0, real]
    out[:, 0] = 0  # a sequence's first token has no prefix (in a pack it would read the previous sequence)
    return out


def token_logprobs(
    model: torch.nn.Module,
    batch: SequenceBatch,
    rows: list[int],
    *,
    temperature: float = 1.0,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(log-probs, entropy or None), each [len(rows), T_rows], of every token given its prefix; column 0 is 0.
    Differentiable when grad is enabled. Entropy is that of the temperature-scaled next-token distribution
    at the position that produced the token."""
    from relayrl.models.logprobs import token_logprobs as chunked_logprobs

    device = next(model.parameters()).device
    pb, inputs = _packed(batch, rows, device)
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model  # under a peft wrapper
    trunk = getattr(hf, hf.base_model_prefix)
    hidden = trunk(
        input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False
    ).last_hidden_state
    head = hf.get_output_embeddings()
    ids = inputs["input_ids"]
    lp, ent = chunked_logprobs(
        hidden[:, :-1],
        head.weight,
        ids[:, 1:],
        bias=head.bias,
        temperature=temperature or 1.0,
        with_entropy=entropy,
    )
    zero = torch.zeros_like(lp[:, :1])
    width = max(batch.lengths[r] for r in rows)
    lp = _unpack(pb, torch.cat([zero, lp], dim=1), len(rows), width)
    if ent is not None:
        ent = _unpack(pb, torch.cat([zero.to(ent.dtype), ent], dim=1), len(rows), width)
    return lp, ent


def critic_values(critic: torch.nn.Module, batch: SequenceBatch, rows: list[int]) -> Tensor:
    """Values [len(rows), T_rows]: `values[:, t] = V(x_<t)` (the critic's output at position t-1)."""
    from relayrl.models.value_head import token_values

    device = next(critic.parameters()).device
    pb, inputs = _packed(batch, rows, device)
    v = token_values(critic, inputs["input_ids"], None, inputs["position_ids"])
    v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)
    return _unpack(pb, v, len(rows), max(batch.lengths[r] for r in rows))


@torch.no_grad()
def masked_logprobs(model: torch.nn.Module, batch: SequenceBatch, budget: int, temperature: float) -> Tensor:
    """Log-probs [B, T] (float32, CPU) of the whole batch, micro-batched by `budget`; 0 off the action mask."""
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float32)
    for rows in micro_batches(batch, budget):
        lp, _ = token_logprobs(model, batch, rows, temperature=temperature)
        out[rows, : lp.shape[1]] = lp.float().cpu()
    return out * batch.action_mask
