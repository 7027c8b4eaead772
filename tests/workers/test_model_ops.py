"""The workers' forward passes and the micro-batched policy objective.

- Log-probs of several sequences in one micro-batch (length-bucketed, causal, no mask) equal a plain padded
  forward's log_softmax(logits / T) of each token, in the [B, T] token-aligned layout (fp32, 1e-5).
- The policy-objective gradient of a mini-batch does not depend on how it is split into token-budget
  micro-batches (sum of loss_sum over the micro-batches / sum of count, the training core's contract), for
  each aggregation.
- RowGather: the pieces of a pass land in their rows on the device and come back to the host once.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from relayrl.algorithms.objective import PolicyTerms
from relayrl.config.presets import tiny_cpu_config
from relayrl.data.packing import plan_micro_batches
from relayrl.trainers.rl.validate import validate_rl
from relayrl.workers.base import SequenceBatch
from relayrl.workers.builders import build_policy_objective
from relayrl.workers.model_ops import RowGather, row_logprobs


def _batch(lengths: list[int], prompt: int = 3, seed: int = 0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    attn = torch.zeros_like(ids, dtype=torch.bool)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(4, 100, (n,), generator=g)
        attn[i, :n] = True
    act = attn.clone()
    act[:, :prompt] = False
    return SequenceBatch(
        input_ids=ids, attention_mask=attn, action_mask=act, rollout_logprobs=torch.zeros(ids.shape)
    )


def test_packed_logprobs_equal_padded_forward(tiny_model):
    batch = _batch([7, 12, 5, 9])
    lp, ent = row_logprobs(tiny_model, batch, [0, 1, 2, 3], "padded", temperature=0.7, entropy=True)
    with torch.no_grad():
        logits = tiny_model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()
        ).logits.float()
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    for i, n in enumerate(batch.lengths):
        want = logp[i, : n - 1].gather(1, batch.input_ids[i, 1:n, None]).squeeze(1)
        torch.testing.assert_close(lp[i, 1:n].detach(), want, rtol=1e-5, atol=1e-5)
        assert lp[i, 0] == 0
        want_ent = -(logp[i, : n - 1].exp() * logp[i, : n - 1]).sum(-1)
        torch.testing.assert_close(ent[i, 1:n].detach(), want_ent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_policy_gradient_is_invariant_to_micro_batching(tiny_model, tmp_path, aggregation):
    cfg = validate_rl(tiny_cpu_config("unused", str(tmp_path)))  # the objective takes the resolved algo
    batch = _batch([7, 12, 5, 9, 11], seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        old, _ = row_logprobs(tiny_model, batch, list(range(5)), "padded")
    noise = torch.randn(old.shape, generator=g) * 0.05
    old = (old + noise) * batch.action_mask  # ratios != 1 so clipping is exercised
    adv = torch.randn(old.shape, generator=g) * batch.action_mask
    objective = build_policy_objective(replace(cfg.algo, aggregation=aggregation), cfg.rollout.max_new_tokens)

    def grads(budget: int) -> tuple[list[torch.Tensor], int]:
        tiny_model.zero_grad(set_to_none=True)
        chunks = plan_micro_batches(batch.lengths, budget, "padded")
        total = 0.0
        for rows in chunks:
            lp, _ = row_logprobs(tiny_model, batch, rows, "padded")
            w = lp.shape[1]
            terms = PolicyTerms(
                logprobs=lp,
                old_logprobs=old[rows, :w],
                advantages=adv[rows, :w],
                action_mask=batch.action_mask[rows, :w],
                rollout_logprobs=torch.zeros(len(rows), w),
            )
            out = objective(terms)
            out.loss_sum.backward()
            total += float(out.count)
        return [p.grad.clone() / total for p in tiny_model.parameters() if p.grad is not None], len(chunks)

    whole, n1 = grads(10_000)
    split, n2 = grads(11)
    assert n1 == 1 and n2 == 5  # one micro-batch vs one per sequence
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_row_gather_puts_pieces_in_their_rows():
    g = RowGather((4, 6))
    a, b = torch.arange(6.0).reshape(2, 3), -torch.arange(8.0).reshape(2, 4)
    g.put([0, 2], a)
    g.put([3, 1], b)
    want = torch.zeros(4, 6)
    want[[0, 2], :3] = a
    want[[3, 1], :4] = b
    assert torch.equal(g.result(), want) and g.result().device.type == "cpu"
    assert torch.equal(RowGather((2, 3)).result(), torch.zeros(2, 3))
