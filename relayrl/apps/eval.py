"""`relayrl eval`: score a model folder on a task's held-out prompts or an eval set, without training.

    run_eval(cfg) -> {"eval/pass@1": ..., ...}      also written to <run>/eval.json

What it builds, in this process: the run folder and prompt sets (relayrl.trainers.rl.setup.prepare_run, as
`relayrl rl` does), ONE rollout engine over the model's frozen weights with its agent executor
(relayrl.workers.builders.build_generation: the same engine and executor an RL run generates with), and the
reward source (relayrl.workers.reward.RewardWorker). No trainer, optimizer or launcher. The metrics are the
RL loop's eval pass (relayrl.trainers.rl.eval.evaluate): the same prompts, sampling settings and seeds.

The run folder (train.output_dir, default runs/eval) must not hold a training run: eval refuses it (it would
write its config.yaml over the run's, and a run is never moved aside to make room) and names another folder.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from relayrl.agents.base import Trajectory
from relayrl.config.command_line import run_command
from relayrl.config.rl import RLConfig
from relayrl.data.records import PromptSample
from relayrl.models.loading import resolve_device
from relayrl.rollout.build import engine_capabilities
from relayrl.trainers.rl.eval import evaluate
from relayrl.trainers.rl.setup import RunSetup, prepare_run
from relayrl.training.setup import holds_run, release_run_dir
from relayrl.workers.builders import build_frozen, build_generation
from relayrl.workers.engine import generate_share, sampling_params
from relayrl.workers.reward import RewardWorker, reward_spec

NOTHING_TO_EVALUATE = (
    "nothing to evaluate: set --task.name with --task.eval_rows > 0, or --data.eval_dataset FILE "
    "(or --data.eval_split_ratio) with a reward (--reward.source)"
)


def run_eval(cfg: RLConfig) -> dict[str, float]:
    """`relayrl eval`: the RL eval (`eval.*`: pass@1, pass@k, reward, per data source) of a model folder on a
    task's held-out prompts or on `data.eval_dataset`, without training. Writes <run>/eval.json."""
    out = Path(cfg.train.output_dir or "runs/eval")
    if holds_run(out):
        raise ValueError(
            f"--train.output_dir {out} holds a training run (checkpoints / metrics.jsonl); eval "
            "writes its own config.yaml, data/ and eval.json and never moves or replaces a run: choose another "
            f"folder (e.g. --train.output_dir {out / 'eval'})"
        )
    cfg = replace(
        cfg,
        train=replace(cfg.train, output_dir=str(out), max_steps=max(1, cfg.train.max_steps)),
        ckpt=replace(cfg.ckpt, resume="none", overwrite=False),
    )
    run = prepare_run(cfg, default_dir=str(out))
    try:
        return _evaluate(run, out)
    finally:
        release_run_dir(run.run_dir)


def _evaluate(run: RunSetup, out: Path) -> dict[str, float]:
    """The eval pass of a prepared run; writes <out>/eval.json."""
    cfg = run.cfg
    if not run.prompts.eval:
        raise ValueError(NOTHING_TO_EVALUATE)
    r, m = cfg.rollout, cfg.model
    # an engine that loads its own copy (vllm) is built from the folder: no module to load here
    own = engine_capabilities(r.engine).own_weights
    model = None if own else build_frozen(m, resolve_device(cfg.train.device))
    engine, executor = build_generation(
        r,
        cfg.eval,
        model,
        run.tokenizer,
        source=m,
        task_name=cfg.task.name,
        step_timeout=cfg.reward.timeout_s,
    )
    try:
        reward = RewardWorker(reward_spec(cfg))

        def generate(prompts: list[PromptSample], seed: int, ev: bool) -> list[Trajectory]:
            base = sampling_params(r, cfg.eval, eval=ev)
            return generate_share(executor, base, prompts, seed, r.max_new_tokens)

        metrics = evaluate(generate, reward.score, run.prompts.eval, seed=cfg.train.seed, eval=cfg.eval)
    finally:
        engine.close()
    (out / "eval.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    """`relayrl eval --model.name_or_path PATH (--task.name T | --data.eval_dataset F --reward.source R)`."""

    def go(cfg: RLConfig) -> int:
        metrics = run_eval(cfg)
        shown = {k: v for k, v in sorted(metrics.items()) if k.startswith("eval/")}
        print("relayrl eval: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))
        print(f"relayrl eval: written to {(cfg.train.output_dir or 'runs/eval')}/eval.json")
        return 0

    return run_command(
        RLConfig, argv, "relayrl eval", go, description="Evaluate a model on a task or eval set."
    )
