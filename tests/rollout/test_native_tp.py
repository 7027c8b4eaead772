"""The tensor-parallel native engine (relayrl/rollout/native_tp.py) over real gloo groups of 2 and 4 processes,
fp32: the same sampled tokens as TP = 1 and log-probs within 1e-5 (the only differences: all-reduce sums the
partial products of o_proj / down_proj in another order than one GEMM, and the vocab-parallel head's sampler
combines per-rank softmax sums, so fp32 rounding differs in the last bits; tokens, greedy, seeded and top-p /
top-k, are identical), the ranks in lock step; and the sharding rule itself. The lm_head is vocab-parallel
(tied: the tiny model, 101 rows cut unevenly; untied: `untied_model`)."""

from __future__ import annotations

import copy

import pytest
import torch
import tp_workers
from rank_spawn import spawn_ranks

from relayrl.rollout.base import generate_all
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.native_tp import check_shardable, split_dim, tp_slice

ATOL = 1e-5


def reference(model: torch.nn.Module | None = None) -> list:
    engine = NativeEngine(model or tp_workers.tiny_model(), **tp_workers.ENGINE)
    try:
        return tp_workers.outputs(generate_all(engine, tp_workers.requests()))
    finally:
        engine.close()


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g_req, w_req in zip(got, want, strict=True):
        for (g_tok, g_lp), (w_tok, w_lp) in zip(g_req, w_req, strict=True):
            assert g_tok == w_tok
            torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=ATOL, rtol=0)


def run(fn, world: int, tmp_path, *extra) -> list[dict]:
    out = str(tmp_path / "out")
    spawn_ranks(fn, (world, str(tmp_path / "store"), out, *extra), nprocs=world)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


def test_split_rule_names_column_and_row_parallel_weights():
    assert split_dim("model.layers.0.self_attn.q_proj.weight") == 0
    assert split_dim("model.layers.0.self_attn.k_proj.bias") == 0
    assert split_dim("model.layers.3.mlp.up_proj.weight") == 0
    assert split_dim("model.layers.0.self_attn.o_proj.weight") == 1
    assert split_dim("model.layers.0.mlp.down_proj.weight") == 1
    assert split_dim("model.layers.0.self_attn.o_proj.bias") is None  # added once, after the all-reduce
    assert split_dim("model.embed_tokens.weight") is None
    assert split_dim("lm_head.weight") == 0  # vocab-parallel (test_native_tp_vocab.py)
    full = torch.arange(24.0).view(4, 6)
    assert torch.equal(tp_slice("a.mlp.down_proj.weight", full, 1, 2), full[:, 3:])
    assert torch.equal(tp_slice("a.mlp.gate_proj.weight", full, 1, 2), full[2:])
    cfg = tp_workers.tiny_model().config
    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by the TP size 8"):
        check_shardable(cfg, 8)


@pytest.mark.slow
def test_tp4_samples_what_tp1_samples(tmp_path):
    want = reference()
    ranks = run(tp_workers.engine_worker, 4, tmp_path)
    assert_same(ranks[0]["outputs"], want)
    assert len({r["steps"] for r in ranks}) == 1 and all(r["kv"] == 1 for r in ranks)
    assert [r["head_rows"] for r in ranks] == [26, 25, 25, 25]  # the tied head split (101 rows)


@pytest.mark.slow
def test_tp2_with_an_untied_vocab_parallel_head_samples_what_tp1_samples(tmp_path):
    want = reference(tp_workers.untied_model())
    ranks = run(tp_workers.engine_worker, 2, tmp_path, True)
    assert_same(ranks[0]["outputs"], want)
    assert [r["head_rows"] for r in ranks] == [51, 50]


@pytest.mark.slow
def test_tp2_summing_through_a_buffer_samples_what_tp1_samples(tmp_path):
    """The row-parallel layers' buffered path (rollout/tp_allreduce.py: the GEMM written into a buffer, summed
    there; a gloo stand-in for the GPU kernel) in the engine's prefill and decode: the same tokens as TP = 1,
    log-probs within ATOL (fp32)."""
    want = reference()
    ranks = run(tp_workers.engine_worker, 2, tmp_path, False, True)
    assert_same(ranks[0]["outputs"], want)
    assert ranks[0]["buffered"] == ranks[1]["buffered"] > 0  # both ranks, the same calls


@pytest.mark.slow
def test_tp2_shards_refreshed_from_fsdp_hold_the_trained_weights_and_sample_what_tp1_does(tmp_path):
    """TP = 2 engine shards of an FSDP2 policy over the same 2 ranks, refreshed after an optimizer step."""
    ranks = run(tp_workers.refresh_worker, 2, tmp_path)
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0  # the follower ran the leader's rounds
    assert ranks[0]["kv"] == ranks[1]["kv"] == 2  # 4 KV heads, 2 per rank
    assert all(r["stale"] > 0 for r in ranks)  # the step changed the weights under the engine
    assert all(r["canary"] == 0.0 for r in ranks)  # after the refresh every slice is the trained one
    trained = tp_workers.tiny_model()
    trained.load_state_dict(ranks[0]["full"], strict=False)
    assert_same(ranks[0]["outputs"], reference(copy.deepcopy(trained)))


def test_a_meta_model_shards_into_zero_slices_with_real_rotary_tables():
    """A policy on the meta device (initialised after FSDP2 shards it, bench/tp_grpo.py): its TP shard is
    zeros of the slice shapes (never uninitialised memory an engine could capture NaN from) with real rotary
    tables equal to a real model's; the first refresh fills it."""
    from relayrl.rollout.native_tp import shard_model

    real = tp_workers.tiny_model()
    with torch.device("meta"):
        meta = type(real)(real.config)
    shard = shard_model(meta, rank=1, size=2, group=None, dtype=torch.float32, device="cpu")
    want = dict(shard_model(real, rank=1, size=2, group=None).named_parameters())
    for name, p in shard.named_parameters():
        assert p.device.type == "cpu" and p.shape == want[name].shape and not p.any(), name
    assert shard.model.layers[0].self_attn.q_proj.weight.shape[0] == 64 // 2  # 4 of the 8 query heads
    torch.testing.assert_close(
        shard.model.rotary_emb.inv_freq, real.model.rotary_emb.inv_freq, atol=0, rtol=0
    )
