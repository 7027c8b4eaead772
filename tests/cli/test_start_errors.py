"""What a command answers before it starts: --help and a config typo come from the config layer alone (no
torch import, well under 3 s); `relayrl sft` without a model names --model.name_or_path and leaves no run
folder; a Hub id while the Hub is unreachable fails at once, a missing local folder names its field; a
checkpoint of another model shape is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relayrl.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys, time
t = time.perf_counter()
from relayrl.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "seconds": time.perf_counter() - t,
                  "heavy": sorted(m for m in ("torch", "transformers", "aiohttp") if m in sys.modules)}))
"""


@pytest.mark.parametrize(
    "argv,rc,says",
    [
        (["sft", "--help"], 0, "--model.name_or_path STR"),
        (["sft", "--optim.lrr", "1e-5"], 2, "unknown option --optim.lrr"),
        (["rl", "--train.max_steps", "ten"], 2, "train.max_steps"),
        (["serve", "--help"], 0, "--max_request_mb FLOAT"),
    ],
)
def test_help_and_config_errors_answer_before_torch_is_imported(argv, rc, says):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=60, cwd=ROOT
    )
    wall = time.perf_counter() - start
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rc"] == rc and says in proc.stdout + proc.stderr, proc.stderr
    assert result["heavy"] == [], f"imported before parsing: {result['heavy']}"
    assert wall < 3.0, f"`relayrl {' '.join(argv)}` took {wall:.1f}s of wall time"


def test_sft_without_a_model_names_the_flag_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["sft"]) == 2
    err = capsys.readouterr().err
    assert "relayrl sft: error: model.name_or_path is required" in err and "--model.name_or_path PATH" in err
    assert not (tmp_path / "runs").exists()
    # a model folder that does not exist: named as model.name_or_path (the tokenizer comes from it), and a run
    # that failed before starting leaves no run folder behind either
    assert cli_main(["sft", "--model.name_or_path", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert f"model.name_or_path='{tmp_path / 'nope'}': no such folder" in err
    assert not (tmp_path / "runs").exists()


def test_sft_whose_data_fails_leaves_no_run_folder(tmp_path, monkeypatch, capsys, tiny_model_path):
    monkeypatch.chdir(tmp_path)
    argv = [
        "sft",
        "--model.name_or_path",
        str(tiny_model_path),
        "--data.datasets",
        str(tmp_path / "none.jsonl"),
    ]
    assert cli_main(argv) == 1
    assert "none.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_hub_id_fails_fast_when_the_hub_is_unreachable(monkeypatch, tmp_path):
    """HF_ENDPOINT at a closed local port: the error comes after one refused probe, not after a minute of
    download retries (52 s before this check)."""
    from relayrl.models.loading import load_tokenizer

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    start = time.perf_counter()
    with pytest.raises(OSError) as err:
        load_tokenizer("no-such-org/no-such-model", what="model.name_or_path")
    assert time.perf_counter() - start < 5.0
    text = str(err.value)
    assert text.startswith(
        "model.name_or_path='no-such-org/no-such-model' is not a local folder and the Hugging"
    )
    assert "127.0.0.1" in text and "is unreachable" in text
    with pytest.raises(FileNotFoundError, match=r"model.name_or_path='\./no/such/folder': no such folder"):
        load_tokenizer("./no/such/folder", what="model.name_or_path")


def test_resuming_from_a_checkpoint_of_another_model_is_one_line(tiny_model_path, tmp_path, capsys):
    """`--ckpt.resume` of a run of another model shape: one line naming both shapes and architectures (torch
    printed 28 lines of size mismatches), exit 1."""
    from relayrl.models.tiny import TinyModelSpec, save_tiny

    narrow = save_tiny(tmp_path / "narrow", TinyModelSpec(hidden=32, layers=2))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"input": "{a}+1=", "output": "{a + 1}"}}\n' for a in range(4)))

    def sft(model, out, *extra):
        return ["sft", "--model.name_or_path", str(model), "--data.datasets", str(data), "--train.device", "cpu",
                "--train.batch_size", "4", "--train.micro_batch_size", "4", "--train.output_dir", str(out),
                "--logger.progress_bar", "false", *extra]  # fmt: skip

    assert (
        cli_main(sft(tiny_model_path, tmp_path / "a", "--train.max_steps", "1", "--ckpt.save_every", "1"))
        == 0
    )
    capsys.readouterr()
    step = tmp_path / "a" / "checkpoints" / "step_1"
    assert cli_main(sft(narrow, tmp_path / "b", "--train.max_steps", "2", "--ckpt.resume", str(step))) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[1] == "relayrl sft: (set RELAYRL_DEBUG=1 for the traceback)", err
    assert err[0].startswith(f"relayrl sft: error: checkpoint {step / 'model'} belongs to another model "
                             "(checkpoint: hidden 64, layers 2, vocab ")  # fmt: skip
    assert "this model: hidden 32, layers 2" in err[0] and "[101, 64] there and [101, 32] here" in err[0]
