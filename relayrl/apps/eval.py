"""`relayrl eval`: score a model folder on a task's held-out prompts or an eval set, without training."""

from __future__ import annotations

from typing import Any


def run_eval(cfg: Any) -> dict[str, float]:
    """`relayrl eval`: the RL eval (`eval.*`: pass@1, pass@k, reward, per data source) of a model folder on a
    task's held-out prompts or on `data.eval_dataset`, without training. Writes <run>/eval.json."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from relayrl.trainers.rl.loop import RLTrainer

    out = Path(cfg.train.output_dir or "runs/eval")
    cfg = replace(
        cfg,
        train=replace(cfg.train, output_dir=str(out), max_steps=max(1, cfg.train.max_steps)),
        ckpt=replace(cfg.ckpt, resume="none", overwrite=True),
    )
    trainer = RLTrainer(cfg, banner=False)
    try:
        if not trainer.prompts.eval:
            raise ValueError(
                "nothing to evaluate: set --task.name with --task.eval_rows > 0, or --data.eval_dataset FILE "
                "(or --data.eval_split_ratio) with a reward (--reward.source)"
            )
        metrics = trainer.evaluate()
    finally:
        trainer.roles.close()
    (out / "eval.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    """`relayrl eval --model.name_or_path PATH (--task.name T | --data.eval_dataset F --reward.source R)`."""
    from relayrl.config.command_line import run_command
    from relayrl.config.rl import RLConfig

    def go(cfg: RLConfig) -> int:
        metrics = run_eval(cfg)
        shown = {k: v for k, v in sorted(metrics.items()) if k.startswith("eval/")}
        print("relayrl eval: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
        print(f"relayrl eval: written to {(cfg.train.output_dir or 'runs/eval')}/eval.json")
        return 0

    return run_command(
        RLConfig, argv, "relayrl eval", go, description="Evaluate a model on a task or eval set."
    )
