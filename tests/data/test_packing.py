"""Packing: packed == unpacked (loss and gradients), layouts, token-budget planning."""

from __future__ import annotations

import pytest
import torch

from relayrl.data.packing import (
    IGNORE_INDEX,
    chunk_by_count,
    pack,
    pad,
    plan_token_budget,
    shift_for_next_token,
    unbatch,
)
from relayrl.trainers.sft import next_token_loss, sft_micro_batches


class Sample:
    def __init__(self, ids, mask):
        self.input_ids, self.loss_mask = ids, mask


SAMPLES = [
    Sample([5, 6, 7, 8, 9, 10], [0, 0, 1, 1, 1, 1]),
    Sample([11, 12, 13], [0, 1, 1]),
    Sample([14, 15, 16, 17, 18], [1, 1, 1, 1, 1]),
    Sample([19, 20, 21, 22], [0, 0, 0, 1]),
]


def test_pack_layout():
    b = pack([[5, 6, 7], [8, 9]], {"w": [[0.5, 1.0, 1.5], [2.0, 2.5]]}, pad_id=0, pad_to_multiple_of=8)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    # positions restart per sample; the padding tail is its own run 0..2
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert b.seq_ids.tolist() == [[0, 0, 0, 1, 1, -1, -1, -1]]
    assert b.fields["w"].tolist() == [[0.5, 1.0, 1.5, 2.0, 2.5, 0.0, 0.0, 0.0]]
    assert b.attention_mask is None and b.packed and b.num_tokens == 5 and b.num_sequences == 2
    parts = unbatch(b, b.fields["w"])
    assert [p.tolist() for p in parts] == [[0.5, 1.0, 1.5], [2.0, 2.5]]


def test_pad_layout():
    b = pad(
        [[5, 6, 7], [8]], {"labels": [[6, 7, -100], [-100]]}, pad_id=0, pad_values={"labels": IGNORE_INDEX}
    )
    assert b.input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.fields["labels"].tolist() == [[6, 7, -100], [-100, -100, -100]]
    assert b.num_tokens == 4 and not b.packed
    assert [p.tolist() for p in unbatch(b, b.input_ids)] == [[5, 6, 7], [8]]


def test_shift_for_next_token():
    # ids [5, 6, 7], mask [0, 1, 1]: position 0 predicts 6 (a target), position 1 predicts 7, last has none
    assert shift_for_next_token([5, 6, 7], [0, 1, 1]) == [6, 7, IGNORE_INDEX]
    assert shift_for_next_token([5, 6, 7], [1, 0, 1]) == [IGNORE_INDEX, 7, IGNORE_INDEX]
    with pytest.raises(ValueError, match="loss_mask has length 2"):
        shift_for_next_token([5, 6, 7], [1, 1])


def test_plan_token_budget_first_fit_decreasing():
    # lengths 5,4,3,3,2,1 budget 7, longest first: 5 -> A; 4 -> B; 3 -> B (full); 3 -> C; 2 -> A; 1 -> C
    bins = plan_token_budget([5, 4, 3, 3, 2, 1], 7)
    assert bins == [[0, 4], [1, 2], [3, 5]]
    assert all(sum([5, 4, 3, 3, 2, 1][i] for i in b) <= 7 for b in bins)
    # an over-long sequence gets its own bin
    assert plan_token_budget([10, 2, 2], 4) == [[0], [1, 2]]
    assert chunk_by_count(5, 2) == [[0, 1], [2, 3], [4]]


def _loss_and_grads(model, batches):
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for b in batches:
        out = next_token_loss(model, b)
        out.loss_sum.backward()
        total += float(out.loss_sum.detach())
        count += out.count
    grads = {n: p.grad.clone() / count for n, p in model.named_parameters()}
    return total / count, count, grads


def _sft_pack(samples, **kw):
    seqs = [s.input_ids for s in samples]
    labels = [shift_for_next_token(s.input_ids, s.loss_mask) for s in samples]
    return pack(seqs, {"labels": labels}, pad_values={"labels": IGNORE_INDEX}, **kw)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_unpacked_loss_and_grads(tiny_model, attn):
    tiny_model.set_attn_implementation(attn)
    one_row = _sft_pack(SAMPLES, pad_to_multiple_of=8)
    assert one_row.input_ids.shape == (1, 24)  # 18 tokens + a padding tail of 6
    # rows of <= 8 tokens, first-fit-decreasing over lengths 6, 3, 5, 4: [6], [3, 5], [4] -> [3, 8]
    rows = _sft_pack(SAMPLES, row_len=8)
    assert rows.input_ids.shape == (3, 8)
    assert rows.seq_ids.tolist()[1] == [1, 1, 1, 2, 2, 2, 2, 2]
    via_sft = sft_micro_batches(SAMPLES, packing=True, pad_id=0, micro_batch_size=4)
    assert len(via_sft) == 1 and via_sft[0].packed
    single = [sft_micro_batches([s], packing=False, pad_id=0)[0] for s in SAMPLES]
    padded = sft_micro_batches(SAMPLES, packing=False, pad_id=0, micro_batch_size=4)
    ref_loss, ref_count, ref_grads = _loss_and_grads(tiny_model, single)
    # targets: 4 + 2 + 4 + 1 = 11 (the first token of a sample is never a target)
    assert ref_count == 11
    for batches in ([one_row], [rows], via_sft, padded):
        loss, count, grads = _loss_and_grads(tiny_model, batches)
        assert count == ref_count
        assert abs(loss - ref_loss) < 1e-5
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-5, msg=name)


def test_packed_without_boundaries_would_differ(tiny_model):
    """Guard: the equality above is not vacuous; positions 0..T-1 across samples change the loss."""
    b = _sft_pack(SAMPLES[:2])
    cross = torch.arange(b.input_ids.shape[1])[None]
    out_ok = next_token_loss(tiny_model, b)
    b.position_ids = cross
    out_cross = next_token_loss(tiny_model, b)
    assert abs(float(out_ok.loss_sum.detach()) - float(out_cross.loss_sum.detach())) > 1e-4
