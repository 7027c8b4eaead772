"""Evaluation metrics of `relayrl rl`: mean reward, pass@1 and pass@k, overall and per data source.

    metrics = eval_metrics(trajs, n_samples=k, threshold=0.5)
      eval/reward, eval/pass@1, eval/pass@k, eval/failed        over every eval prompt
      eval/<datasource>/reward, .../pass@1, .../pass@k          per data source

A sample is correct when its score (default: its reward) is > `threshold`; a FAILED sample counts as
incorrect and is counted in eval/failed. pass@k uses the unbiased estimator of Chen et al. 2021 (Codex,
arXiv 2107.03374): with n samples of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over
prompts. With n = 1 (greedy), pass@1 is the exact-match accuracy.
"""

from __future__ import annotations

from collections import defaultdict
from math import comb
from typing import Any

from relayrl.agents.base import Trajectory, TrajectoryStatus


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with n samples, c correct (k <= n)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _correct(t: Trajectory, threshold: float) -> bool:
    if t.status != TrajectoryStatus.OK:
        return False
    score = t.score if t.score is not None else t.reward
    return score is not None and score > threshold


def eval_metrics(trajs: list[Trajectory], *, n_samples: int, threshold: float) -> dict[str, float]:
    """eval/* metrics (see module doc). Trajectories of one prompt share `sample.index`."""
    by_prompt: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_prompt[t.sample.index].append(t)
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for group in by_prompt.values():
        source = group[0].sample.datasource
        n, c = len(group), sum(_correct(t, threshold) for t in group)
        rewards = [float(t.reward) for t in group if t.status == TrajectoryStatus.OK and t.reward is not None]
        row = {
            "reward": sum(rewards) / n if rewards else 0.0,
            "pass@1": pass_at_k(n, c, 1),
            f"pass@{n_samples}": pass_at_k(n, c, min(n_samples, n)),
        }
        for key in (source, None):
            for name, value in row.items():
                per_source[key][name].append(value)
    out: dict[str, float] = {"eval/failed": float(sum(t.status != TrajectoryStatus.OK for t in trajs))}
    for source, rows in per_source.items():
        prefix = "eval" if source is None else f"eval/{source}"
        out.update({f"{prefix}/{name}": sum(v) / len(v) for name, v in rows.items()})
    out["eval/prompts"] = float(len(by_prompt))
    return out


def run_eval(cfg: Any) -> dict[str, float]:
    """`relayrl eval`: the RL eval (`eval.*`: pass@1, pass@k, reward, per data source) of a model folder on a
    task's held-out prompts or on `data.eval_dataset`, without training. Writes <run>/eval.json."""
    import json
    from dataclasses import replace
    from pathlib import Path

    from relayrl.trainers.rl import RLTrainer

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
    from relayrl.config.base import run_command
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
