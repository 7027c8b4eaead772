"""`relayrl sft` like `relayrl rl`: SIGTERM finishes the step, writes a checkpoint and exits 143; a finished run
writes final/ and says where; rerunning a finished run says it is already complete instead of training 0 steps."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from transformers import AutoModelForCausalLM

from relayrl.cli import main as cli_main
from relayrl.training.logging import read_jsonl


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(10, 30) for b in range(20, 30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _argv(model, data, out, *extra):
    return ["sft", "--model.name_or_path", str(model), "--data.datasets", str(data), "--train.device", "cpu",
            "--train.batch_size", "4", "--train.micro_batch_size", "4", "--train.output_dir", str(out),
            "--logger.progress_bar", "false", *extra]  # fmt: skip


@pytest.mark.slow  # a CLI subprocess signalled mid-run
@pytest.mark.timeout(120)
def test_sigterm_writes_a_checkpoint_and_exits_143(tiny_model_path, data, tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "relayrl.cli",
        *_argv(tiny_model_path, data, out, "--train.max_steps", "100000"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    step = int((out / "checkpoints/latest").read_text().strip().removeprefix("step_"))
    assert step >= 2 and step >= len(read_jsonl(metrics)) - 1
    assert f"stopped at step {step} by a signal" in err and "Traceback" not in err
    assert not (out / "final").exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_final_model_and_already_complete(tiny_model_path, data, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _argv(tiny_model_path, data, out, "--train.max_steps", "2")
    assert cli_main(argv) == 0
    said = capsys.readouterr().out
    assert f"relayrl sft: final model in {out / 'final'}" in said
    AutoModelForCausalLM.from_pretrained(out / "final")
    assert cli_main(argv) == 0
    said = capsys.readouterr().out
    assert "already complete at step 2" in said and "--train.max_steps" in said
    assert len(read_jsonl(out / "metrics.jsonl")) == 2  # nothing was trained or logged again
