"""ckpt.save_final false: an RL or SFT run ends right after its last step, writing neither the last checkpoint
nor the final/ HF export (what bench/scale.py's runs use, so a benchmark never waits for a save); checkpoints
every ckpt.save_every steps are still written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from relayrl.cli import main as cli_main
from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import run_rl
from relayrl.training.logging import read_jsonl

DIGITS = str(Path(__file__).parent / "data" / "digit_reward.py")


def _saved(run: Path) -> list[str]:
    ckpts = (
        sorted(p.name for p in (run / "checkpoints").glob("step_*")) if (run / "checkpoints").is_dir() else []
    )
    return ckpts + (["final"] if (run / "final").exists() else [])


def test_rl_run_without_the_final_save(tiny_model_path, tmp_path):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=3, reward=DIGITS)
    cfg = replace(cfg, ckpt=replace(cfg.ckpt, save_every=2, save_final=False))
    result = run_rl(cfg)
    assert result.exit_code == 0, result.message
    assert [h["train/step"] for h in result.history] == [1, 2, 3]
    assert result.final_model is None
    assert _saved(tmp_path / "run") == ["step_2"]  # save_every kept; no step_3, no final/


def test_sft_run_without_the_final_save(tiny_model_path, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"input": "{a}+1=", "output": "{a + 1}"}}\n' for a in range(10, 26)))
    out = tmp_path / "run"
    argv = [
        "sft",
        *("--model.name_or_path", str(tiny_model_path), "--data.datasets", str(data)),
        *(
            "--data.eval_split_ratio",
            "0",
            "--train.batch_size",
            "4",
            "--train.micro_batch_size",
            "2",
            "--train.output_dir",
            str(out),
        ),
        *("--train.device", "cpu", "--train.max_steps", "2", "--logger.progress_bar", "false"),
        *("--ckpt.save_every", "0", "--ckpt.save_final", "false"),
    ]
    assert cli_main(argv) == 0
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert _saved(out) == []
