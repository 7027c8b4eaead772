"""Exact resume: a run interrupted by SIGINT (which writes a checkpoint) and resumed ends with the same
per-step metrics and the same final weights as an uninterrupted run (CPU, fp32).

The configuration touches every piece of resumable state: policy + critic weights, both AdamW states and
cosine-with-warmup schedulers (gae), the prompt sampler position, an adaptive KL controller with KL in the
reward (reference model), running reward normalisation, EMA of the policy, and the step counter.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.training.checkpoint import write_manifest
from relayrl.training.logging import read_jsonl
from relayrl.training.run_lock import LOCK_FILE

DATA = Path(__file__).parents[1] / "data"
STEPS = 4
VOLATILE = ("time", "timing/", "perf/")


def _cfg(model: Path, out: Path):
    cfg = tiny_cpu_config(str(model), str(out), steps=STEPS, reward=str(DATA / "digit_reward.py"))
    return replace(
        cfg,
        optim=replace(cfg.optim, scheduler="cosine", warmup_steps=1),
        algo=replace(
            cfg.algo,
            advantage="gae",
            kl_mode="reward",
            kl_coef=0.05,
            kl_controller="adaptive",
            kl_target=0.01,
        ),
        reward=replace(cfg.reward, normalize=True),
        ckpt=replace(cfg.ckpt, resume="auto"),
        ema=0.9,
    )


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


@pytest.mark.timeout(180)
def test_interrupted_and_resumed_run_matches_uninterrupted(tiny_model_path, tmp_path):
    full = RLTrainer(_cfg(tiny_model_path, tmp_path / "full")).fit()
    assert full.exit_code == 0

    def interrupt(step: int, metrics: dict) -> None:
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: the loop checkpoints, then stops

    first = RLTrainer(_cfg(tiny_model_path, tmp_path / "split")).fit(on_step=interrupt)
    assert first.exit_code == 128 + signal.SIGINT
    assert first.steps == 2 and first.final_model is None
    assert (tmp_path / "split/checkpoints/latest").read_text().strip() == "step_2"
    # as if the interrupted run had logged step 3 before dying without a checkpoint (and torn a line)
    with (tmp_path / "split/samples.jsonl").open("a") as f:
        f.write('{"step": 3, "prompt": "stale", "response": "", "reward": 0}\n{"step": 3, "pro')
    _a_tampered_position_is_refused(
        tiny_model_path, tmp_path / "split", tmp_path / "split/checkpoints/step_2"
    )
    second = RLTrainer(_cfg(tiny_model_path, tmp_path / "split")).fit()
    assert second.exit_code == 0 and second.steps == STEPS

    a = _stable(read_jsonl(tmp_path / "full/metrics.jsonl"))
    b = _stable(read_jsonl(tmp_path / "split/metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b  # bit-exact: same samples, same losses, same KL coefficient, same lr
    sa, sb = read_jsonl(tmp_path / "full/samples.jsonl"), read_jsonl(tmp_path / "split/samples.jsonl")
    assert sa == sb  # the replayed step's samples appear once, the stale and torn rows are gone
    for name in ("final/model.safetensors", "checkpoints/step_4/critic/model.safetensors"):
        wa, wb = load_file(tmp_path / "full" / name), load_file(tmp_path / "split" / name)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{name}:{k} differs after resume"


def _a_tampered_position_is_refused(model: Path, run: Path, ckpt: Path) -> None:
    """A checkpoint whose recorded data position (trainer_state.json) disagrees with its sampler state is
    refused on resume, naming both, instead of silently skipping prompts; restored afterwards."""
    state_file = ckpt / "trainer_state.json"
    original = state_file.read_text()
    state = json.loads(original)
    assert state["prompts_drawn"] == 2 * 8  # 2 steps x prompts_per_step 8 of tiny_cpu_config
    state_file.write_text(json.dumps({**state, "prompts_drawn": 15}))
    write_manifest(ckpt)  # consistent checksums: only the position check can catch it
    trainer = RLTrainer(_cfg(model, run))
    closed: list[bool] = []
    close_roles = trainer.roles.close
    trainer.roles.close = lambda: (closed.append(True), close_roles())[1]  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(
        ValueError,
        match=r"recorded 15 batch\(es\) drawn but its data position .* is 16 batches in: resuming would skip 1",
    ):
        trainer.fit()
    # the refused run released its roles and its run folder (before, both stayed held until the process ended)
    assert closed == [True]
    assert not (run / LOCK_FILE).read_text().strip()
    state_file.write_text(original)
    write_manifest(ckpt)


@pytest.mark.slow  # a CLI subprocess signalled mid-run
@pytest.mark.timeout(120)
def test_sigterm_writes_a_checkpoint_and_exits_143(tiny_model_path, tmp_path):
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "relayrl.cli", "rl", "--model.name_or_path", str(tiny_model_path)]
    cmd += [
        "--task.name",
        "add2",
        "--task.eval_rows",
        "0",
        "--train.max_steps",
        "10000",
        "--train.output_dir",
        str(out),
    ]
    cmd += ["--reward.source", str(DATA / "digit_reward.py"), "--logger.progress_bar", "false"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 90
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    step = len(read_jsonl(metrics))
    assert step >= 2 and "checkpoint written" in err
    assert (out / "checkpoints/latest").read_text().strip() == f"step_{step}"
    assert (out / f"checkpoints/step_{step}/policy/model.safetensors").is_file()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]
