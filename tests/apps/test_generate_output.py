"""`relayrl generate --output` that cannot be written fails before anything is generated."""

from __future__ import annotations

import os

import pytest

from relayrl.apps import generate
from relayrl.apps.generate import main


@pytest.fixture()
def no_generation(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("generation started")

    monkeypatch.setattr(generate, "sample_groups", fail)
    monkeypatch.setattr(generate, "build_prompts", fail)


def _argv(model, out):
    return ["--model.name_or_path", str(model), "--task.name", "add2", "--output", str(out)]


def test_an_output_under_a_file_fails_before_generating(tiny_model_path, tmp_path, capsys, no_generation):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    assert main(_argv(tiny_model_path, blocker / "sub" / "out.jsonl")) == 1
    err = capsys.readouterr().err
    assert (
        f"relayrl generate: error: --output {blocker / 'sub' / 'out.jsonl'} cannot be written: {blocker} is a file"
        in err
    )
    assert main(_argv(tiny_model_path, tmp_path)) == 1
    assert f"--output {tmp_path} is a folder" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_output_in_a_read_only_folder_fails_before_generating(
    tiny_model_path, tmp_path, capsys, no_generation
):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert main(_argv(tiny_model_path, locked / "out.jsonl")) == 1
    finally:
        locked.chmod(0o700)
    assert f"no write permission in {locked}" in capsys.readouterr().err
