"""Driver-to-rank transfer on Ray (relayrl.distributed.launch.rows): a record stored row by row gives back
exactly what its own `select` gives (bitwise), only the rows asked for are fetched, the batch is reused inside
the experience; and one RL step on Ray (2 policy ranks, reference, critic) makes the driver serialise about
one experience's worth of bytes for the log-prob / value passes and the updates together.

Before the row store, `RayRole.submit` put each call's whole argument: the batch for each of the three passes
and the experience for each of the two updates (~3.4x the experience's bytes here; every rank then read all
of it). The bound below (1.3x: the rows' raw bytes plus Ray's per-object overhead, ~15% at these tiny rows of
~80 tokens) fails on that code.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from relayrl.distributed.launch.rows import FETCH, RowStore
from relayrl.workers.base import Experience, SequenceBatch, my_update_parts

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from transfer import build_cfg, measure

pytestmark = pytest.mark.slow  # a Ray cluster


def _experience(rows: int = 7, width: int = 12) -> Experience:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    attn = torch.arange(width)[None, :] < lengths[:, None]
    batch = SequenceBatch(
        input_ids=torch.randint(0, 50, (rows, width), generator=g) * attn,
        attention_mask=attn,
        action_mask=attn & (torch.rand(rows, width, generator=g) > 0.3),
        rollout_logprobs=-torch.rand(rows, width, generator=g) * attn,
    )
    return Experience(
        tokens=batch,
        advantages=torch.randn(rows, width, generator=g),
        rewards=torch.randn(rows, generator=g),
        ref_logprobs=-torch.rand(rows, width, generator=g),
    )


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif x is None:
            assert y is None, f.name
        else:
            _assert_same(x, y)


def test_stored_rows_select_exactly_the_record_s_rows(ray_cluster):
    exp = _experience()
    store = RowStore()
    batch_rows = store.put(exp.tokens)
    rows = store.put(exp)
    assert rows.nested["tokens"] is batch_rows and store.put(exp) is rows  # each record is put once
    assert rows.lengths == exp.lengths and rows.width == exp.width
    for pick in ([0], [2, 3, 4], [6, 1], list(range(7))):
        _assert_same(rows.select(pick), exp.select(pick))
        _assert_same(batch_rows.select(pick), exp.tokens.select(pick))
    before = FETCH["rows"]
    parts = my_update_parts(rows, 2)  # one rank: every row, fetched once for both mini-batches
    assert FETCH["rows"] - before == 7
    _assert_same(parts[0][0], exp.select([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="no rows"):
        rows.select([])


def test_rows_are_put_in_a_few_blocks_and_a_share_fetches_at_most_two_more(ray_cluster, monkeypatch):
    import ray

    from relayrl.distributed.launch import rows as row_store

    monkeypatch.setattr(row_store, "MIN_BLOCK_BYTES", 0)  # these 30 KB would be one block
    exp = _experience(rows=150, width=9)  # 150 rows: 50 blocks of 3 (block_rows: at most 64 objects)
    rows = RowStore().put(exp)
    assert rows.block == 3 and len(ray.get(rows.index)) == 50
    for pick in ([149], [148, 0, 77], list(range(40, 101)), list(range(150))[::-1]):
        _assert_same(rows.select(pick), exp.select(pick))
    before = FETCH["bytes"]
    rows.select(list(range(40, 101)))  # a contiguous share of 61 rows: blocks 13..33, 63 rows
    t = exp.tokens
    stored = (exp.advantages, exp.rewards, exp.ref_logprobs, t.input_ids, t.attention_mask, t.action_mask)
    per_row = sum(x[0].numpy().nbytes for x in (*stored, t.rollout_logprobs) if x is not None)  # 202 bytes
    assert FETCH["bytes"] - before == 63 * per_row


@pytest.mark.timeout(400)
def test_one_rl_step_serialises_the_experience_about_once(ray_cluster, tiny_model_path, tmp_path):
    cfg = build_cfg(tiny_model_path, tmp_path / "run", ranks=2, new_tokens=64)
    got = measure(cfg)
    assert got["driver_bytes_per_experience_byte"] < 1.3, got


def test_pack_gives_back_the_record_bit_for_bit():
    """launch.rows.pack / unpack: every tensor dtype (bf16 included), views and empty tensors, non-tensor
    fields; each tensor comes back with its own storage (a later pickle does not carry a whole buffer)."""
    from relayrl.data.batches import SFTBatch
    from relayrl.distributed.launch.rows import pack, unpack

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    record = {
        "views": [base[:, 1:].to(dt) for dt in (torch.bfloat16, torch.float16, torch.float64, torch.int16)],
        "empty": torch.empty(0, 3, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "batch": SFTBatch(
            input_ids=[torch.arange(5)], targets=[torch.rand(5, generator=g) > 0.5], num_tokens=5
        ),
        "other": (3, "padded", None),
    }
    got = unpack(pack(record))
    for a, b in zip(record["views"], got["views"], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b) and b.untyped_storage().nbytes() == b.nbytes
    assert got["empty"].shape == (0, 3) and got["empty"].dtype == torch.int64
    assert torch.equal(got["scalar"], record["scalar"]) and got["other"] == record["other"]
    a, b = record["batch"], got["batch"]
    assert type(b) is type(a) and (b.layout, b.num_tokens, b.images) == (a.layout, a.num_tokens, a.images)
    assert torch.equal(b.input_ids[0], a.input_ids[0]) and torch.equal(b.targets[0], a.targets[0])
    assert b.targets[0].dtype == torch.bool
    assert len(pack(record["batch"])) < 300  # 13 tensor bytes: the header stays small (pickle: ~1.4 KB)


@pytest.mark.timeout(400)
def test_sft_step_micro_batches_cross_once_and_each_rank_reads_its_share(
    ray_cluster, tiny_model_path, tmp_path
):
    """Ray SFT on 2 gloo ranks (16 samples a step in 8 micro-batches, eval every 2 steps), the micro-batches
    in the object store one per object (launch.rows.StoredItems) vs the list passed whole (the code
    before): the per-step train and eval losses are bit-identical; the driver serialises 1.24x the
    micro-batches' tensor bytes (was 1.64x: torch's pickle header on every small tensor) and each rank
    reads 0.63x of them (its 5 or 3 micro-batches; was the whole 1.64x). Bounds: driver < 1.35x (Ray's ~240
    bytes per object at these ~1.9 KB micro-batches), rank < 0.75x; the old path fails both."""
    from transfer import build_sft_cfg, measure_sft, sft_data

    data = sft_data(tmp_path / "sft.jsonl", 64)
    stored = measure_sft(build_sft_cfg(tiny_model_path, data, tmp_path / "stored", 2), stored=True)
    whole = measure_sft(build_sft_cfg(tiny_model_path, data, tmp_path / "list", 2), stored=False)
    assert stored["train_losses"] == whole["train_losses"] and len(stored["train_losses"]) == 3
    assert stored["eval_losses"] == whole["eval_losses"] and len(stored["eval_losses"]) == 2
    assert stored["driver_bytes_per_tensor_byte"] < 1.35 < whole["driver_bytes_per_tensor_byte"], (
        stored,
        whole,
    )
    assert stored["max_rank_read_bytes_per_tensor_byte"] < 0.75, stored
    assert stored["max_rank_micro_batches"] < stored["micro_batches"] == whole["max_rank_micro_batches"]
