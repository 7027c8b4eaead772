"""Checkpoints: HF folder loads, atomic save (a crash leaves nothing half-written), latest, rotation, RNG."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relayrl.training.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    load_weights_into,
    restore_rng_state,
)


class Explodes:
    """Pickling this raises: a crash in the middle of writing a checkpoint (after the model is written)."""

    def __reduce__(self):
        raise RuntimeError("disk full")


def _save(mgr, step, model, tok=None, metric=None, extra=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return mgr.save(
        step,
        models={"model": model},
        tokenizer=tok,
        optimizers={"model": opt},
        trainer_state={"note": step},
        extra=extra or {"data": {"epoch": 0, "position": step}},
        metric=metric,
    )


def test_hf_folder_loads_with_from_pretrained(tmp_path, tiny_model, tiny_tokenizer):
    mgr = CheckpointManager(tmp_path)
    path = _save(mgr, 5, tiny_model, tiny_tokenizer)
    assert path == tmp_path / "step_5" and mgr.latest() == path
    assert (tmp_path / "latest").read_text().strip() == "step_5"
    for name in ("optim.pt", "rng.pt", "extra.pt", "trainer_state.json"):
        assert (path / name).is_file(), name
    assert json.loads((path / "trainer_state.json").read_text())["step"] == 5
    loaded = AutoModelForCausalLM.from_pretrained(path / "model")
    tok = AutoTokenizer.from_pretrained(path / "model")
    assert tok("12+34=")["input_ids"] == tiny_tokenizer("12+34=")["input_ids"]
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(loaded(ids).logits, tiny_model(ids).logits, atol=0, rtol=0)


def test_crash_mid_save_leaves_previous_latest(tmp_path, tiny_model):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1, tiny_model)
    with pytest.raises(RuntimeError, match="disk full"):
        _save(mgr, 2, tiny_model, extra={"data": Explodes()})
    assert not (tmp_path / "step_2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []
    assert mgr.latest() == tmp_path / "step_1"
    assert (tmp_path / "latest").read_text().strip() == "step_1"


def test_killed_process_tmp_folder_is_ignored_and_cleaned(tmp_path, tiny_model):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 1, tiny_model)
    stale = tmp_path / ".tmp-step_2-99999"  # what a SIGKILLed save leaves behind
    (stale / "model").mkdir(parents=True)
    (stale / "trainer_state.json").write_text("{}")
    assert mgr.latest() == tmp_path / "step_1" and [p.name for p in mgr.checkpoints()] == ["step_1"]
    _save(mgr, 3, tiny_model)
    assert not stale.exists() and mgr.latest() == tmp_path / "step_3"


def test_rotation_keeps_last_and_best(tmp_path, tiny_model):
    mgr = CheckpointManager(tmp_path, keep_last=2, keep_best=1, best_mode="min")
    for step, metric in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, 4.0)]:
        _save(mgr, step, tiny_model, metric=metric)
    # last two (4, 5) plus the best eval metric (step 2: 1.0)
    assert [p.name for p in mgr.checkpoints()] == ["step_2", "step_4", "step_5"]
    assert mgr.best() == tmp_path / "step_2" and mgr.latest() == tmp_path / "step_5"
    plain = CheckpointManager(tmp_path / "plain", keep_last=1)
    for step in (1, 2, 3):
        _save(plain, step, tiny_model)
    assert [p.name for p in plain.checkpoints()] == ["step_3"]


def test_resave_same_step_replaces(tmp_path, tiny_model):
    mgr = CheckpointManager(tmp_path)
    _save(mgr, 2, tiny_model)
    _save(mgr, 2, tiny_model, metric=0.5)
    assert json.loads((tmp_path / "step_2" / "trainer_state.json").read_text())["metric"] == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_2"]


def test_load_restores_weights_optimizer_rng(tmp_path, tiny_model, tiny_tokenizer):
    from relayrl.models.tiny import TinyModelSpec, build_tiny_model

    opt = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    tiny_model(torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    opt.step()
    mgr = CheckpointManager(tmp_path)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    mgr.save(
        1,
        models={"model": tiny_model},
        optimizers={"model": opt},
        trainer_state={"tokens_seen": 9},
        extra={"data": {"epoch": 2, "position": 4}},
    )
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    other = build_tiny_model(tiny_tokenizer, TinyModelSpec(seed=1))
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    loaded = mgr.load(models={"model": other}, optimizers={"model": opt2})
    assert loaded.step == 1 and loaded.trainer_state["tokens_seen"] == 9
    assert loaded.extra == {"data": {"epoch": 2, "position": 4}}
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    for p, q in zip(tiny_model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)
    # tied lm_head follows the embedding it is tied to
    assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"]) for k in s1)


def test_load_errors(tmp_path, tiny_model, tiny_tokenizer):
    from relayrl.models.tiny import TinyModelSpec, build_tiny_model

    mgr = CheckpointManager(tmp_path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        mgr.load()
    _save(mgr, 1, tiny_model)
    bigger = build_tiny_model(tiny_tokenizer, TinyModelSpec(layers=3))
    with pytest.raises(ValueError, match="does not match the model"):
        load_weights_into(bigger, tmp_path / "step_1" / "model")
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, keep_last=0)


def test_rng_roundtrip():
    state = capture_rng_state()
    a = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng_state(state)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == a


def test_state_dict_format_resumes_exactly(tmp_path, tiny_model, tiny_tokenizer):
    from relayrl.models.tiny import TinyModelSpec, build_tiny_model

    mgr = CheckpointManager(tmp_path, hf_format=False)
    _save(mgr, 1, tiny_model)
    assert (tmp_path / "step_1" / "model" / "weights.pt").is_file()
    assert not (tmp_path / "step_1" / "model" / "config.json").exists()
    other = build_tiny_model(tiny_tokenizer, TinyModelSpec(seed=3))
    mgr.load(models={"model": other}, restore_rng=False)
    for p, q in zip(tiny_model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p, q)


class _Payload:
    """A pickled object (what an untrusted checkpoint could carry)."""


def test_checkpoint_with_a_pickled_object_is_refused(tmp_path):
    """State files load with weights_only=True; one carrying a pickled object fails with a message naming the
    file and why, instead of running its code."""
    import pytest

    from relayrl.training.checkpoint import CheckpointManager, load_state, write_manifest

    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=2)
    path = mgr.save(1, models={}, trainer_state={"x": 1}, extra={"data": {"epoch": 0, "position": 4}})
    assert load_state(path / "extra.pt") == {"data": {"epoch": 0, "position": 4}}
    assert mgr.load(path).extra["data"]["position"] == 4
    torch.save({"data": _Payload()}, path / "extra.pt")
    with pytest.raises(ValueError, match=r"extra\.pt: \d+ bytes, \d+ when written"):
        mgr.load(path)  # the manifest notices the changed file first
    write_manifest(path)  # a crafted checkpoint with a consistent manifest: the loader still refuses
    with pytest.raises(ValueError, match=r"extra\.pt holds pickled Python objects.*refusing to load it"):
        mgr.load(path)


def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    """A truncated file, a missing file or an empty trainer_state.json in the newest checkpoint: named, and
    resume falls back to the previous complete checkpoint; loading that checkpoint explicitly is an error."""
    import pytest

    from relayrl.training.checkpoint import CheckpointManager

    mgr = CheckpointManager(tmp_path / "ckpt", keep_last=3)
    for step in (1, 2, 3):
        mgr.save(step, models={}, trainer_state={"x": step}, extra={"data": {"position": step}})
    step3, step2 = tmp_path / "ckpt/step_3", tmp_path / "ckpt/step_2"
    (step3 / "rng.pt").write_bytes((step3 / "rng.pt").read_bytes()[:10])  # truncated
    (step2 / "trainer_state.json").write_text("")  # empty
    with pytest.warns(UserWarning) as caught:
        assert mgr.resumable() == tmp_path / "ckpt/step_1"
    said = [str(w.message) for w in caught]
    assert any(f"{step3 / 'rng.pt'}: 10 bytes" in m and "falling back" in m for m in said), said
    assert any(f"{step2 / 'trainer_state.json'}: unreadable" in m for m in said), said
    with pytest.warns(UserWarning):
        assert mgr.load().step == 1
    with pytest.raises(ValueError, match=r"step_3 is damaged .*rng\.pt: 10 bytes"):
        mgr.load(step3)
    (step3 / "extra.pt").unlink()
    with pytest.raises(ValueError, match=r"extra\.pt: missing"):
        mgr.load(step3)


@pytest.mark.parametrize("hf_format", [True, False])
def test_a_checkpoint_of_another_model_shape_is_one_clear_error(
    tmp_path, tiny_model, tiny_tokenizer, hf_format
):
    """Resuming from a checkpoint of another shape names both shapes (and architectures) and what to do, in
    one line, instead of torch's list of size mismatches."""
    from relayrl.models.tiny import TinyModelSpec, build_tiny_model

    mgr = CheckpointManager(tmp_path, hf_format=hf_format)
    _save(mgr, 1, tiny_model)  # hidden 64
    wider = build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=32, layers=2))
    with pytest.raises(ValueError) as err:
        mgr.load(models={"model": wider}, restore_rng=False)
    text = str(err.value)
    assert "\n" not in text and f"checkpoint {tmp_path / 'step_1' / 'model'} belongs to another model" in text
    assert "model.embed_tokens.weight is [" in text and ", 64] there and [" in text and ", 32] here" in text
    assert "--train.output_dir" in text and "--ckpt.resume none --ckpt.overwrite true" in text
    if hf_format:  # config.json travels with an HF folder: both architectures are named
        assert (
            "(checkpoint: hidden 64, layers 2, vocab " in text and "this model: hidden 32, layers 2" in text
        )
