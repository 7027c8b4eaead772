"""`relayrl eval`: a model folder's pass@k and reward on a task's held-out prompts, without training."""

from __future__ import annotations

import json
from pathlib import Path

from relayrl.cli import main as cli_main

DATA = Path(__file__).parents[1] / "trainers" / "data"


def test_eval_a_model_on_a_task_without_training(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "ev"
    argv = ["eval", "--model.name_or_path", str(tiny_model_path), "--task.name", "add2", "--task.eval_rows", "8",
            "--train.device", "cpu", "--train.output_dir", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    said = capsys.readouterr().out
    metrics = json.loads((out / "eval.json").read_text())
    assert metrics["eval/prompts"] == 8 and 0.0 <= metrics["eval/pass@1"] <= 1.0
    assert f"eval/pass@1 {metrics['eval/pass@1']:.4f}" in said
    assert not (out / "checkpoints").exists() and not (out / "final").exists()  # nothing was trained
    # no eval prompts: said, exit 1
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"input": "1+1=", "label": "2"}\n')
    argv = ["eval", "--model.name_or_path", str(tiny_model_path), "--data.datasets", str(rows), "--reward.source",
            str(DATA / "digit_reward.py"), "--train.device", "cpu", "--train.output_dir", str(tmp_path / "e2")]  # fmt: skip
    assert cli_main(argv) == 1
    assert "nothing to evaluate" in capsys.readouterr().err


def test_eval_into_a_training_run_folder_is_refused(tiny_model_path, tmp_path, capsys):
    # it used to move the run aside (then fail: the model it was asked to score moved with it)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_2")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.yaml").write_text("kept: true\n")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    argv = ["eval", "--model.name_or_path", str(tiny_model_path), "--task.name", "add2",
            "--train.output_dir", str(run), "--ckpt.overwrite", "true"]  # fmt: skip
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert (
        f"--train.output_dir {run} holds a training run" in err
        and f"--train.output_dir {run / 'eval'}" in err
    )
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    assert (run / "config.yaml").read_text() == "kept: true\n"
