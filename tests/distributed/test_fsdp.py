"""FSDP2 sharding (relayrl.distributed.fsdp) on a one-rank gloo group: which modules become units, that the
sharded model computes what the plain one does, and that the gathered tensors are the weights, bitwise."""

from __future__ import annotations

import pytest
import torch

from relayrl.distributed.fsdp import (
    ShardSpec,
    compute_device,
    full_tensors,
    is_sharded,
    layer_classes,
    shard_model,
    unit_tensors,
)
from relayrl.models.tiny import TinyModelSpec, build_tiny_model


@pytest.fixture()
def model(tiny_tokenizer):
    return build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=32, layers=2, seed=0))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_layer_classes_come_from_the_model_declaration(model):
    assert layer_classes(model) == {"Qwen2DecoderLayer"}
    with pytest.raises(ValueError, match="Linear does not declare its decoder layer classes"):
        layer_classes(torch.nn.Linear(2, 2))


def test_a_sharded_model_computes_and_gathers_what_the_plain_one_holds(model, one_rank_group):
    ids = torch.randint(4, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    ref = _weights(model)
    assert not is_sharded(model) and compute_device(model) is None
    shard_model(model, ShardSpec(device=torch.device("cpu")))
    assert is_sharded(model) and compute_device(model) == torch.device("cpu")
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    gathered = dict(full_tensors(model))
    assert list(gathered) == list(ref)
    for name, t in gathered.items():
        assert torch.equal(t, ref[name]), name


def test_full_tensors_cast_before_the_gather_and_filter_by_name(model, one_rank_group):
    ref = _weights(model)
    shard_model(model, ShardSpec(device=torch.device("cpu")))
    names = {"model.norm.weight", "model.layers.1.mlp.up_proj.weight"}
    got = dict(full_tensors(model, torch.bfloat16, names))
    assert set(got) == names
    for name, t in got.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[name].to(torch.bfloat16)), name


def test_unit_tensors_gather_each_unit_once(model, one_rank_group):
    ref = _weights(model)
    shard_model(model, ShardSpec(device=torch.device("cpu")))
    order = []
    for name, t in unit_tensors(model):
        assert torch.equal(t, ref[name]), name  # valid while its unit is gathered
        order.append(name)
    assert sorted(order) == sorted(ref)
    # a parameter belongs to its deepest unit (a decoder layer, else the root); each unit's tensors come in
    # one run (one unshard each), units in the order their first parameter appears
    units = [n.split(".")[2] if n.startswith("model.layers.") else "root" for n in order]
    runs = [u for i, u in enumerate(units) if i == 0 or units[i - 1] != u]
    assert runs == ["root", "0", "1"]
    assert list(dict(unit_tensors(model, {"model.embed_tokens.weight"}))) == ["model.embed_tokens.weight"]
