"""Every command fails with ONE line on stderr naming the problem (exit 1; 2 for config errors), the traceback
only with RELAYRL_DEBUG=1; `relayrl --version`."""

from __future__ import annotations

import pytest

from relayrl import __version__
from relayrl.cli import main as cli_main


def _sft(model, data, out):
    return ["sft", "--model.name_or_path", str(model), "--data.datasets", str(data), "--train.device", "cpu",
            "--train.output_dir", str(out), "--logger.progress_bar", "false"]  # fmt: skip


def test_a_data_error_is_one_line_and_exit_1(tiny_model_path, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "1+1=", "output": "2"}\n{"broken\n')
    assert cli_main(_sft(tiny_model_path, bad, tmp_path / "run")) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[0].startswith(f"relayrl sft: error: {bad}, line 2: invalid JSON"), err
    assert "--data.skip_malformed true" in err[0]
    assert err[1] == "relayrl sft: (set RELAYRL_DEBUG=1 for the traceback)" and len(err) == 2


def test_debug_env_shows_the_traceback(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("RELAYRL_DEBUG", "1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n")
    with pytest.raises(ValueError, match="line 1: invalid JSON"):
        cli_main(_sft(tiny_model_path, bad, tmp_path / "run"))


def test_config_error_is_exit_2(capsys):
    assert cli_main(["sft", "--optim.lr", "-1"]) == 2
    assert "optim.lr" in capsys.readouterr().err


def test_version(capsys):
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"relayrl {__version__}"


@pytest.mark.parametrize("command", ["sft", "rl"])
def test_model_folder_without_tokenizer_files_says_so(tiny_model_path, tmp_path, capsys, command):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_path, bare)
    for f in bare.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            f.unlink()
    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1+1=", "output": "2", "label": "2"}\n')
    argv = [command, "--model.name_or_path", str(bare), "--data.datasets", str(data), "--train.output_dir",
            str(tmp_path / "run"), "--train.max_steps", "1"]  # fmt: skip
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert f"{bare} has no tokenizer files" in err and "--model.tokenizer_name_or_path" in err


def test_banner_and_no_per_file_progress_bars(tiny_model_path, tmp_path, capfd):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"input": "{a}+1=", "output": "{a + 1}"}}\n' for a in range(8)))
    argv = ["sft", "--model.name_or_path", str(tiny_model_path), "--data.datasets", str(data), "--train.device", "cpu",
            "--train.batch_size", "4", "--train.micro_batch_size", "4", "--train.max_steps", "1",
            "--ckpt.save_every", "1", "--train.output_dir", str(tmp_path / "run"), "--logger.progress_bar", "false"]  # fmt: skip
    assert cli_main(argv) == 0
    out, err = capfd.readouterr()
    assert (
        f"relayrl sft: response loss on {tiny_model_path} (" in out
        and "M params, fp32, padded attention), 1 rank(s), 1 steps of 4 samples; run folder" in out
    )
    assert "Loading weights" not in err and "Writing model shards" not in err  # transformers' per-file bars
