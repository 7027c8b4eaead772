"""The HF export of a sharded model written in place by every rank (relayrl.distributed.hf_export): the files
are byte for byte what save_pretrained writes for the same weights (one file, and split into several with
their index), an untied LM head is kept, from_pretrained loads the trained weights exactly, and on 2 ranks
no weight is gathered: each rank writes its own rows, half the bytes each. Exact comparisons throughout
(torch.equal, file bytes): the export copies bits, it computes nothing."""

from __future__ import annotations

import json

import export_ranks
import pytest
import torch
from rank_spawn import spawn_ranks
from transformers import AutoModelForCausalLM

from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.distributed.hf_export import INDEX, WEIGHTS, export_hf, streamable, untied
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_moe_model


def _sharded_trained(model):
    shard_model(model, ShardSpec(device=torch.device("cpu")))
    export_ranks.train_one_step(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return model, {n: t.clone() for n, t in full_tensors(model)}


def _plain_with(model, weights):
    """The same architecture unsharded, holding `weights` (what a one-rank run would save)."""
    model.load_state_dict(weights, strict=False)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_the_export_is_the_file_save_pretrained_writes(tied, tiny_tokenizer, one_rank_group, tmp_path):
    build = (lambda: build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=32, layers=2))) if tied else (
        export_ranks.untied_model
    )  # fmt: skip
    model, weights = _sharded_trained(build())
    assert streamable(model, model.state_dict()) is None
    stats = export_hf(model, tmp_path / "new")
    plain = _plain_with(build(), weights)
    plain.save_pretrained(tmp_path / "hf")
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    assert (
        stats.files == 1
        and stats.total_bytes == stats.bytes_written == (tmp_path / "new" / WEIGHTS).stat().st_size
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "new")
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, weights[name if name in weights else "model.embed_tokens.weight"]), name
    # an untied head is its own tensor in the file and after loading (the old save_hf dropped it)
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert ("lm_head.weight" in untied(model, model.state_dict())) != tied


def test_a_model_over_the_shard_size_is_split_as_save_pretrained_splits_it(
    tiny_tokenizer, one_rank_group, tmp_path
):
    model, weights = _sharded_trained(export_ranks.untied_model())
    stats = export_hf(model, tmp_path / "new", max_shard_bytes=20_000)
    _plain_with(export_ranks.untied_model(), weights).save_pretrained(tmp_path / "hf", max_shard_size=20_000)
    hf_files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == hf_files and INDEX in hf_files
    for name in hf_files:
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    weight_map = json.loads((tmp_path / "hf" / INDEX).read_text())["weight_map"]
    assert stats.files == len(set(weight_map.values())) > 1
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "new")
    assert all(torch.equal(t, weights[n]) for n, t in loaded.state_dict().items())
    export_hf(model, tmp_path / "new")  # one file now: the split's files and index must not linger
    assert sorted(p.name for p in (tmp_path / "new").glob("model*")) == [WEIGHTS]


def test_what_cannot_be_written_in_place_says_why(tiny_tokenizer):
    moe = build_tiny_moe_model(tiny_tokenizer, TinyModelSpec(hidden=32, layers=1, moe="qwen3", experts=4))
    assert "weight conversions" in (streamable(moe, moe.state_dict()) or "")
    plain = build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=32, layers=1))
    odd = {**plain.state_dict(), "x": torch.zeros(2, dtype=torch.complex64)}
    assert "x has dtype torch.complex64" in (streamable(plain, odd) or "")


@pytest.mark.slow  # two spawned ranks
@pytest.mark.timeout(120)
def test_two_ranks_each_write_their_own_rows_and_gather_nothing(tmp_path):
    spawn_ranks(export_ranks.rank_main, (2, str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank_{r}.pt", weights_only=True) for r in (0, 1))
    header = r0["total"] - r0["local"] - r1["local"]  # no buffers in the state dict: rows + rank 0's header
    assert 0 < header < 4096 and r0["written"] == r0["local"] + header and r1["written"] == r1["local"]
    assert abs(r0["local"] - r1["local"]) < 0.1 * r0["local"]  # each rank wrote about half
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    state = loaded.state_dict()
    assert set(state) == set(r0["full"])
    for name, t in r0["full"].items():
        assert torch.equal(state[name], t), name


def test_a_model_loaded_with_from_pretrained_is_written_in_place(tiny_model_path):
    """from_pretrained attaches transformers' (empty, for Qwen2) conversion list; reverting it reorders the
    names but renames none, so the model is still written in place."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert streamable(model, model.state_dict()) is None
