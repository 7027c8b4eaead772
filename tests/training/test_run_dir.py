"""Run-folder safety: a fresh start never mixes with an old run in the same folder (refused, or the old run
moved aside with --ckpt.overwrite); an output folder that is a file is named; a torn JSONL row is dropped with a
warning on resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from relayrl.cli import main as cli_main
from relayrl.config.base import ConfigError, to_dict
from relayrl.config.components import CkptConfig, ModelConfig, TrainConfig
from relayrl.config.recipes import SFTConfig
from relayrl.training import run_lock
from relayrl.training.logging import keep_rows_up_to, read_jsonl
from relayrl.training.run_lock import RunFolderBusy, release_run_dir
from relayrl.training.setup import check_config_change, prepare_run_dir


def _sft(model, data, out, *extra):
    return ["sft", "--model.name_or_path", str(model), "--data.datasets", str(data), "--train.device", "cpu",
            "--train.batch_size", "4", "--train.micro_batch_size", "4", "--train.output_dir", str(out),
            "--train.max_steps", "2", "--logger.progress_bar", "false", *extra]  # fmt: skip


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"input": f"{a}+1=", "output": str(a + 1)}) + "\n" for a in range(40)))
    return path


def test_a_fresh_start_in_a_used_folder_is_refused_or_moves_the_old_run_aside(
    tiny_model_path, data, tmp_path, capsys
):
    out = tmp_path / "run"
    assert cli_main(_sft(tiny_model_path, data, out)) == 0
    before = read_jsonl(out / "metrics.jsonl")
    capsys.readouterr()
    assert cli_main(_sft(tiny_model_path, data, out, "--ckpt.resume", "none")) == 1
    err = capsys.readouterr().err
    assert (
        f"{out} already holds a run" in err and "--ckpt.resume auto" in err and "--ckpt.overwrite true" in err
    )
    assert read_jsonl(out / "metrics.jsonl") == before  # untouched
    assert (
        cli_main(_sft(tiny_model_path, data, out, "--ckpt.resume", "none", "--ckpt.overwrite", "true")) == 0
    )
    (aside,) = list(tmp_path.glob("run.old-*"))
    assert f"moved the previous run in {out} aside to {aside}" in capsys.readouterr().out
    assert read_jsonl(aside / "metrics.jsonl") == before
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]  # a new file, not appended


def test_output_dir_that_is_a_file(tiny_model_path, data, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert cli_main(_sft(tiny_model_path, data, f)) == 1
    assert f"train.output_dir {f} is a file, not a folder" in capsys.readouterr().err


def test_torn_row_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1}\n{"step": 2, "x": 2}\n{"step": 3, "x"')
    with pytest.warns(UserWarning, match=r"metrics.jsonl, line 3: not a complete JSON row"):
        keep_rows_up_to(path, 5)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]


def test_continuing_a_run_with_a_changed_config(tiny_model_path, data, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(_sft(tiny_model_path, data, out)) == 0  # 2 steps
    capsys.readouterr()
    # what the run computes changed: refused, naming the field and both values, nothing trained
    assert cli_main(_sft(tiny_model_path, data, out, "--optim.lr", "0.5")) == 2
    err = capsys.readouterr().err
    assert f"{out} holds a run started with another config (optim.lr 1e-05 -> 0.5)" in err
    assert "--train.output_dir" in err and len(read_jsonl(out / "metrics.jsonl")) == 2
    # only its length changed: allowed, said, and the schedule change explained
    argv = _sft(tiny_model_path, data, out)
    argv[argv.index("--train.max_steps") + 1] = "3"
    assert cli_main(argv) == 0
    said = capsys.readouterr().out
    assert (
        "changed settings: train.max_steps 2 -> 3" in said and "learning-rate schedule is recomputed" in said
    )
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_a_field_added_since_the_run_was_saved_reads_as_its_default(tmp_path):
    """A run folder written by an older relayrl (its config.yaml lacks a field added since) continues while
    that field keeps its default, and is refused as a changed config once the field is set."""
    cfg = SFTConfig(model=ModelConfig(name_or_path="m"), train=TrainConfig(output_dir=str(tmp_path)))
    saved = to_dict(cfg)
    del saved["optim"]["weight_decay"]  # as if optim.weight_decay did not exist when the run started
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_2")
    assert check_config_change(tmp_path, cfg, "relayrl sft") == []
    changed = replace(cfg, optim=replace(cfg.optim, weight_decay=cfg.optim.weight_decay + 0.5))
    with pytest.raises(ConfigError, match=r"another config \(optim\.weight_decay "):
        check_config_change(tmp_path, changed, "relayrl sft")


# ---------------------------------------------------------------------------------------------- the lock
HOLDER = """
import importlib.util, pathlib, sys, time
spec = importlib.util.spec_from_file_location("run_lock", {module!r})
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
m.lock_run_dir(pathlib.Path({folder!r}), "relayrl sft")
print("locked", flush=True)
sys.stdin.read()  # hold until the test closes stdin (or kills this process)
m.release_run_dir(pathlib.Path({folder!r}))  # a run that ends normally releases its folder
"""


def _start_holder(folder):
    """Another process holding `folder`'s lock (the lock module loaded on its own: no torch import)."""
    code = HOLDER.format(module=str(Path(run_lock.__file__)), folder=str(folder))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_folder_in_use_by_another_process_is_refused_then_taken_over_when_it_dies(tmp_path, capsys):
    # two runs into one folder at once used to both exit 0 claiming one final/; now the second is refused with
    # the first's pid, and once that process is gone (killed: its record is left behind) the folder is taken
    # over with a note naming it
    out = tmp_path / "run"
    out.mkdir()
    proc = _start_holder(out)
    try:
        with pytest.raises(
            RunFolderBusy, match=rf"{out} is in use by another run \(pid {proc.pid} on .*relayrl sft"
        ):
            prepare_run_dir(out, CkptConfig(), "relayrl sft")
        # --ckpt.overwrite never moves a folder another process is running in
        (out / "metrics.jsonl").write_text("")
        with pytest.raises(RunFolderBusy, match=rf"kill {proc.pid}"):
            prepare_run_dir(out, CkptConfig(resume="none", overwrite=True), "relayrl sft")
        assert out.is_dir() and not list(tmp_path.glob("run.old-*"))
    finally:
        proc.kill()
        proc.wait()
    capsys.readouterr()
    assert prepare_run_dir(out, CkptConfig(), "relayrl sft") == out
    err = capsys.readouterr().err
    assert (
        f"note: taking over the lock of {out} left by a run that ended without releasing it (pid {proc.pid}"
        in err
    )
    assert f"pid {proc.pid} is no longer running" in err
    assert (out / ".relayrl.lock").read_text().startswith(f"pid {os.getpid()} on ")
    # released at the end of the run: a run that ends normally leaves no record, so no note next time
    release_run_dir(out)
    assert (out / ".relayrl.lock").read_text() == ""
    proc = _start_holder(out)
    proc.communicate("")
    prepare_run_dir(out, CkptConfig(), "relayrl sft")
    release_run_dir(out)
    assert "note:" not in capsys.readouterr().err
