"""Fault injection: `kill -9` a run (no chance to checkpoint or clean up) at several moments, including while a
checkpoint is being written, rerun the same command until it finishes, and compare with an uninterrupted run:
per-step metrics and final weights are bit-identical on CPU (RL and SFT)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relayrl.training.logging import read_jsonl

pytestmark = pytest.mark.slow  # kill -9 of RL and SFT subprocesses, several resumes (minutes)

DATA = Path(__file__).parent / "data"
VOLATILE = ("timing/", "perf/")


def _rl(model: Path, out: Path) -> list[str]:
    return ["rl", "--model.name_or_path", str(model), "--task.name", "add2", "--task.train_rows", "64",
            "--task.eval_rows", "0", "--train.max_steps", "6", "--rollout.prompts_per_step", "4",
            "--rollout.n_samples", "2", "--rollout.max_new_tokens", "6", "--reward.source",
            str(DATA / "digit_reward.py"), "--ckpt.save_every", "1", "--logger.progress_bar", "false",
            "--train.device", "cpu", "--train.output_dir", str(out)]  # fmt: skip


def _sft(model: Path, out: Path, data: Path) -> list[str]:
    return ["sft", "--model.name_or_path", str(model), "--data.datasets", str(data), "--train.batch_size", "4",
            "--train.micro_batch_size", "2", "--train.max_steps", "6", "--ckpt.save_every", "1",
            "--logger.progress_bar", "false", "--train.device", "cpu", "--train.output_dir", str(out)]  # fmt: skip


def _run(argv: list[str], kill_after_rows: int | None, delay: float = 0.0) -> int:
    """Run the command in a subprocess; with kill_after_rows, SIGKILL it once metrics.jsonl has that many rows
    (plus `delay` seconds, to land inside the next step or checkpoint write). Returns the exit code."""
    out = Path(argv[argv.index("--train.output_dir") + 1])
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    if kill_after_rows is not None:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if metrics.is_file() and metrics.read_text().count("\n") >= kill_after_rows:
                time.sleep(delay)
                os.kill(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.02)
    _, err = proc.communicate(timeout=180)
    if kill_after_rows is None:
        assert proc.returncode == 0, err[-3000:]
    return proc.returncode


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "time"} for r in rows]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "final" / "model.safetensors")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("command", ["rl", "sft"])
def test_kill_9_at_random_moments_then_resume_is_bit_identical(tiny_model_path, tmp_path, command):
    data = tmp_path / "sft.jsonl"
    data.write_text(
        "".join(json.dumps({"input": f"{a}+{a}=", "output": str(2 * a)}) + "\n" for a in range(40))
    )

    def argv(out: Path) -> list[str]:
        return _rl(tiny_model_path, out) if command == "rl" else _sft(tiny_model_path, out, data)

    ref = tmp_path / "ref"
    _run(argv(ref), None)
    run = tmp_path / "killed"
    killed = 0
    for rows, delay in ((1, 0.0), (3, 0.05), (4, 0.3)):  # right after a row, and a little into the next step
        if _run(argv(run), rows, delay) == -signal.SIGKILL:
            killed += 1
    assert killed >= 2  # (a kill can land after the run already finished on a fast machine)
    _run(argv(run), None)  # resume to the end
    assert _stable(read_jsonl(run / "metrics.jsonl")) == _stable(read_jsonl(ref / "metrics.jsonl"))
    a, b = _weights(ref), _weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
