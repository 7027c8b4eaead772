"""Checkpoints across rank counts (relayrl.distributed.checkpoint): the optimizer state re-keyed between
torch's parameter indices and DCP's parameter names, and a sharded (DCP) checkpoint written on a one-rank
FSDP2 group loaded into a plain model, into a sharded one, and a full one spread onto the shards."""

from __future__ import annotations

import pytest
import torch

from relayrl.distributed.checkpoint import (
    _by_index,
    _by_name,
    export_full,
    is_sharded_checkpoint,
    load_model_and_optim,
    load_rng,
    save_sharded,
)
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.models.tiny import TinyModelSpec, build_tiny_model


def _trained_plain():
    """A two-Linear model, an AdamW with two groups (out of module order) and one step taken."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    w0, b0, w1, b1 = model.parameters()
    opt = torch.optim.AdamW(
        [{"params": [w0, w1], "weight_decay": 0.1}, {"params": [b0, b1], "lr": 0.5}], lr=0.1
    )
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
    return model, opt, ["0.weight", "1.weight", "0.bias", "1.bias"]


def test_optimizer_state_by_name_and_back_by_index():
    _, opt, names = _trained_plain()
    osd = opt.state_dict()
    named = _by_name(osd, names)
    assert [g["params"] for g in named["param_groups"]] == [["0.weight", "1.weight"], ["0.bias", "1.bias"]]
    assert named["param_groups"][1]["lr"] == 0.5 and named["param_groups"][0]["weight_decay"] == 0.1
    assert set(named["state"]) == set(names)
    assert named["state"]["1.weight"] is osd["state"][1]  # index 1 of the optimizer is the second Linear
    back = _by_index(named, names, opt)
    assert [g["params"] for g in back["param_groups"]] == [[0, 1], [2, 3]]
    assert back["param_groups"] == osd["param_groups"]
    assert back["state"] == {i: osd["state"][i] for i in range(4)}


def test_a_state_missing_some_trained_parameters_is_refused_and_an_empty_one_is_not():
    _, opt, names = _trained_plain()
    named = _by_name(opt.state_dict(), names)
    del named["state"]["0.bias"]
    with pytest.raises(ValueError, match=r"lacks 1 trained parameters, e\.g\. \['0\.bias'\]"):
        _by_index(named, names, opt)
    fresh = _by_index({"state": {}, "param_groups": []}, names, opt)  # a run saved before its first step
    assert fresh["state"] == {} and [g["params"] for g in fresh["param_groups"]] == [[0, 1], [2, 3]]


def _tiny(tokenizer, seed, *, sharded=False):
    """A tiny model (sharded on the current group when asked) and its AdamW, built after the sharding as the
    workers do (FSDP2 replaces the parameters)."""
    model = build_tiny_model(tokenizer, TinyModelSpec(hidden=32, layers=2, seed=seed))
    if sharded:
        shard_model(model, ShardSpec(device=torch.device("cpu")))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_one_step(model, opt):
    ids = torch.randint(4, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _state_by_name(model, opt):
    names = [n for n, _ in model.named_parameters()]
    return {names[i]: s for i, s in opt.state_dict()["state"].items()}


def _unexpected(_):
    raise AssertionError("a sharded checkpoint must not be read as a full one")


@pytest.fixture()
def saved(tiny_tokenizer, one_rank_group, tmp_path):
    """A sharded checkpoint of a trained FSDP2 model: (folder, full weights, optimizer state by name)."""
    model, opt = _tiny(tiny_tokenizer, seed=0, sharded=True)
    _train_one_step(model, opt)
    folder = tmp_path / "step_1" / "policy"
    save_sharded(folder, model, opt, {"seed": torch.tensor(7)})
    weights = dict(full_tensors(model))
    return folder, weights, model


def test_a_sharded_checkpoint_has_its_marker_and_this_rank_s_rng(saved, tmp_path):
    folder, _, _ = saved
    assert is_sharded_checkpoint(folder) and not is_sharded_checkpoint(tmp_path)
    assert load_rng(folder) == {"seed": torch.tensor(7)}
    (folder / "rng" / "rank_0.pt").unlink()  # a rank the saving run did not have
    assert load_rng(folder) is None


def test_a_sharded_checkpoint_loads_into_a_plain_model(saved, tiny_tokenizer):
    folder, weights, _ = saved
    model, opt = _tiny(tiny_tokenizer, seed=1)
    names = [n for n, _ in model.named_parameters()]
    load_model_and_optim(folder, model, opt, names, full_weights=_unexpected, full_optim_state=_unexpected)
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    state = _state_by_name(model, opt)
    assert set(state) == set(names) and all(int(s["step"]) == 1 for s in state.values())
    # the plain model continues exactly like a plain model trained the same way from the same weights
    twin, twin_opt = _tiny(tiny_tokenizer, seed=0)
    _train_one_step(twin, twin_opt)
    for name, s in _state_by_name(twin, twin_opt).items():
        torch.testing.assert_close(state[name]["exp_avg"], s["exp_avg"], rtol=1e-5, atol=1e-8)


def test_a_sharded_checkpoint_loads_into_a_sharded_model(saved, tiny_tokenizer):
    folder, weights, _ = saved
    model, opt = _tiny(tiny_tokenizer, seed=1, sharded=True)
    _train_one_step(model, opt)  # its own state, to be replaced
    names = [n for n, _ in model.named_parameters()]
    load_model_and_optim(folder, model, opt, names, full_weights=_unexpected, full_optim_state=_unexpected)
    for name, t in full_tensors(model):
        assert torch.equal(t, weights[name]), name


def test_a_full_checkpoint_is_spread_onto_the_shards(tiny_tokenizer, one_rank_group, tmp_path):
    source, source_opt = _tiny(tiny_tokenizer, seed=0)
    _train_one_step(source, source_opt)
    names = [n for n, _ in source.named_parameters()]
    full = {n: p.detach().clone() for n, p in source.named_parameters()}
    model, opt = _tiny(tiny_tokenizer, seed=1, sharded=True)
    seen = []

    def weights(folder):
        seen.append(folder)
        return {n: t.clone() for n, t in full.items()}  # set_state_dict turns the values into DTensors

    load_model_and_optim(
        tmp_path, model, opt, names, full_weights=weights, full_optim_state=lambda _: source_opt.state_dict()
    )
    assert seen == [tmp_path]
    for name, t in full_tensors(model):
        assert torch.equal(t, full[name]), name
    source_state = dict(zip(names, source_opt.state_dict()["state"].values(), strict=True))
    for name, p in model.named_parameters():
        s = opt.state[p]
        assert int(s["step"]) == 1, name
        assert torch.equal(s["exp_avg"].full_tensor(), source_state[name]["exp_avg"]), name
        assert torch.equal(s["exp_avg_sq"].full_tensor(), source_state[name]["exp_avg_sq"]), name


def test_export_full_saves_the_gathered_weights_once(saved):
    _, weights, model = saved
    got: list[dict[str, torch.Tensor]] = []
    export_full(model, got.append)
    (state,) = got
    for name, t in weights.items():
        assert t.device.type == "cpu" and torch.equal(state[name], t), name


def test_a_checkpoint_of_another_model_shape_is_one_clear_error(saved, tiny_tokenizer, one_rank_group):
    """A sharded checkpoint (hidden 32) into a plain or a sharded model of hidden 48, and a full one into a
    sharded model: one line naming both shapes, before anything is loaded."""
    folder, weights, _ = saved

    def wider(sharded):
        model = build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=48, layers=2, seed=1))
        if sharded:
            shard_model(model, ShardSpec(device=torch.device("cpu")))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    for sharded, source, full in [(False, folder, _unexpected), (True, folder, _unexpected),
                                  (True, folder.parent, lambda _: dict(weights))]:  # fmt: skip
        model, opt = wider(sharded)
        names = [n for n, _ in model.named_parameters()]
        with pytest.raises(ValueError) as err:
            load_model_and_optim(source, model, opt, names, full_weights=full, full_optim_state=_unexpected)
        text = str(err.value)
        assert "\n" not in text and f"checkpoint {source} belongs to another model" in text, text
        assert ", 32] there and [" in text and ", 48] here" in text, text


def test_dcp_is_written_without_torch_save_s_record_crc_and_the_setting_is_restored(
    tiny_tokenizer, one_rank_group, tmp_path, monkeypatch
):
    """DCP's torch.save records skip their zip CRC (the manifest checksums the files; loads are unaffected:
    the tests above) and torch.save's global option is back on afterwards."""
    import torch.distributed.checkpoint.state_dict_saver as saver

    real, seen = saver.save, []

    def save(*args, **kwargs):
        seen.append(torch.serialization.get_crc32_options())
        return real(*args, **kwargs)

    monkeypatch.setattr(saver, "save", save)
    model, opt = _tiny(tiny_tokenizer, seed=0, sharded=True)
    save_sharded(tmp_path / "c", model, opt, {})
    assert seen == [False] and torch.serialization.get_crc32_options()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def test_every_rank_writes_several_files_and_a_checkpoint_of_torch_s_own_writer_still_loads(
    tiny_tokenizer, one_rank_group, tmp_path, monkeypatch
):
    """save_sharded writes dcp_writer.default_threads() files per rank (relayrl.distributed.dcp_writer); a checkpoint
    written before it, by torch's FileSystemWriter (one file per rank), loads as before. Both give back the
    weights and the AdamW state bit for bit."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    import relayrl.distributed.checkpoint as checkpoint
    from relayrl.distributed.dcp_writer import default_threads

    model, opt = _tiny(tiny_tokenizer, seed=0, sharded=True)
    _train_one_step(model, opt)
    save_sharded(tmp_path / "new", model, opt, {})
    monkeypatch.setattr(checkpoint, "storage_writer", lambda folder: FileSystemWriter(str(folder)))
    save_sharded(tmp_path / "old", model, opt, {})
    monkeypatch.undo()
    files = {v: sorted(p.name for p in (tmp_path / v / "dcp").glob("*.distcp")) for v in ("new", "old")}
    assert default_threads() > 1  # CI has 2 cores
    assert files == {"new": [f"__0_{i}.distcp" for i in range(default_threads())], "old": ["__0_0.distcp"]}
    weights, state = dict(full_tensors(model)), _state_by_name(model, opt)
    for v in ("new", "old"):
        back, back_opt = _tiny(tiny_tokenizer, seed=1, sharded=True)
        _train_one_step(back, back_opt)  # its own state, to be replaced
        names = [n for n, _ in back.named_parameters()]
        load_model_and_optim(
            tmp_path / v, back, back_opt, names, full_weights=_unexpected, full_optim_state=_unexpected
        )
        for name, t in full_tensors(back):
            assert torch.equal(t, weights[name]), (v, name)
        for name, s in _state_by_name(back, back_opt).items():
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(_local(s[k]), _local(state[name][k])), (v, name, k)
