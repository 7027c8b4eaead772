"""`relayrl demo` (what `make demo` runs): SFT then RL on a built-in task, on CPU, no downloads, < 10 minutes.

    1. build a tiny Qwen2 + char tokenizer (relayrl/models/tiny.py; hidden 64, 2 layers, ~0.13M parameters)
    2. SFT it on a few hundred rows of the task (`relayrl sft`'s code path: run_sft)
    3. RL with the task's verifiable reward (`relayrl rl`'s code path: RLTrainer, GRPO = group_norm
       advantages + PPO clip, DAPO dynamic sampling so every trained group carries signal; the KL to the SFT
       model is measured and plotted only with --rl_kl_monitor true, never in the loss), evaluating held-out
       greedy exact-match accuracy before the first update (= the SFT model's accuracy) and every rl_steps / 8
       steps
    4. optional control (`--control true`): the same SFT continued for as long as RL took, evaluated the same
       way, to show the gain comes from the reward and not from more training time
    5. write runs/demo/summary.json (accuracies, steps, wall and CPU seconds per phase), curves.png (reward, KL
       when monitored, length, eval accuracy) and final/ (HF model)

Sizing follows ../shared/notes/demo-task-measurements.md. With 500 SFT rows one seed in three memorised the
rows without generalising (dev accuracy 0.05-0.13 after 800 steps; RL then has almost no correct samples);
with 1000 rows every seed tried reaches the 0.4 gate within 550-800 steps and RL adds 25-51 points
(docs/rl.md lists the seeds).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from relayrl.agents.executors import decode_response
from relayrl.config.apps import DemoConfig
from relayrl.config.command_line import run_command
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from relayrl.config.recipes import SFTConfig
from relayrl.config.rl import (
    AlgoConfig,
    EvalConfig,
    FilterConfig,
    RewardConfig,
    RLConfig,
    RLTrainConfig,
    RolloutConfig,
)
from relayrl.data.build import build_prompt_data
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.rollout.base import EngineSettings, GenerationRequest, SamplingParams, generate_all
from relayrl.rollout.build import build_engine
from relayrl.tasks import get_task
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.trainers.sft import run_sft


def build_base_model(cfg: DemoConfig, folder: Path) -> Path:
    """Tiny model + tokenizer saved as an HF folder."""

    tok = build_tiny_tokenizer()
    spec = TinyModelSpec(hidden=cfg.hidden, layers=cfg.layers, heads=4, kv_heads=2, seed=cfg.seed)
    model = build_tiny_model(tok, spec)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def make_demo_data(cfg: DemoConfig, folder: Path) -> dict[str, Path]:
    """Disjoint SFT / RL-prompt / eval row files, all drawn from the task's *train* split.

    Why not the task's "test" split: add2's hash split puts exactly the pairs whose sum ends in 0 or 9 into
    "test" ((7919a + 104729b) mod 10 < 2  <=>  9(a + b) mod 10 < 2), so a model trained on "train" has
    never produced such a sum and scores ~0 on "test" whatever it learned. Splitting one pool of distinct
    (a, b) pairs keeps the evaluation held out (no eval pair is seen in SFT or RL) and representative."""

    sizes = {"eval": cfg.eval_rows, "sft": cfg.sft_rows, "rl": cfg.rl_rows, "dev": cfg.dev_rows}
    rows = get_task(cfg.task).make_rows("train", sum(sizes.values()), cfg.seed)
    parts, start = {}, 0
    for name, size in sizes.items():
        parts[name], start = rows[start : start + size], start + size
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, part in parts.items():
        paths[name] = folder / f"{cfg.task}_{name}.jsonl"
        paths[name].write_text("".join(json.dumps({**r, "datasource": cfg.task}) + "\n" for r in part))
    return paths


class DemoStopped(Exception):
    """A phase of the demo stopped early (a signal, or an error the phase reported): the demo stops with its
    exit code instead of going on to the next phase."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _check_phase(result: Any, phase: str, run_dir: Path) -> None:
    """Raise DemoStopped when an SFT / RL phase returned a non-zero exit code (e.g. 143 after SIGTERM)."""
    code = int(getattr(result, "exit_code", 0) or 0)
    if code != 0:
        raise DemoStopped(
            code,
            f"demo: the {phase} phase stopped (exit code {code}) with its checkpoint in {run_dir}; "
            "run the same command again to continue",
        )


def run_sft_phase(cfg: DemoConfig, base: Path, data_file: Path, run_dir: Path, steps: int) -> Any:
    """SFT through relayrl.trainers.sft.run_sft up to `steps` (resuming the run folder's checkpoint, so it
    can be called again with more steps); returns the SFTResult."""

    sft = SFTConfig(
        model=ModelConfig(name_or_path=str(base)),
        data=DataConfig(datasets=[str(data_file)], seed=cfg.seed),
        optim=OptimConfig(lr=cfg.sft_lr, warmup_steps=30, scheduler="constant", weight_decay=0.0),
        train=TrainConfig(
            seed=cfg.seed,
            batch_size=64,
            micro_batch_size=64,
            max_steps=steps,
            log_every=50,
            device=cfg.device,
            output_dir=str(run_dir),
        ),
        ckpt=CkptConfig(save_every=0, keep_last=1, resume="auto"),
        logger=LoggerConfig(progress_bar=False),
    )
    return run_sft(sft)


def greedy_answers(model: Any, tokenizer: Any, rows_file: Path) -> tuple[list[Any], list[str]]:
    """(prompts, greedy responses) for the file's rows, templated as in training (the native engine, up to
    6 new tokens: the arithmetic tasks' answers)."""

    prompts, _, _ = build_prompt_data(DataConfig(datasets=[str(rows_file)]), tokenizer, log=lambda _: None)
    engine = build_engine("native", model, tokenizer, EngineSettings(max_seq_len=64))
    try:
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
        results = generate_all(
            engine, [GenerationRequest(prompt_ids=p.prompt_ids, params=params) for p in prompts]
        )
    finally:
        engine.close()
    stops = {tokenizer.eos_token_id}
    return prompts, [decode_response(tokenizer, r.completions[0].token_ids, stops) for r in results]


def dev_accuracy(model: Any, tokenizer: Any, dev_file: Path, task_name: str) -> float:
    """Greedy exact-match accuracy on the dev rows (same prompt templating as training, task's verifier)."""

    prompts, answers = greedy_answers(model, tokenizer, dev_file)
    task = get_task(task_name)
    hits = [task.reward(a, p.label) for p, a in zip(prompts, answers, strict=True)]
    return sum(hits) / max(1, len(hits))


def sft_until_target(
    cfg: DemoConfig, base: Path, data: dict[str, Path], run_dir: Path
) -> tuple[Path, int, float]:
    """SFT in chunks until dev accuracy >= sft_target (or sft_steps); returns (model folder, steps, dev acc)."""
    steps = min(cfg.sft_steps, cfg.sft_chunk)
    while True:
        result = run_sft_phase(cfg, base, data["sft"], run_dir, steps)
        _check_phase(result, "SFT", run_dir)
        acc = dev_accuracy(result.model, result.tokenizer, data["dev"], cfg.task)
        loss = result.metrics.get("train/loss", float("nan"))
        print(f"demo: SFT step {steps}: train loss {loss:.3f}, dev accuracy {acc:.3f}", flush=True)
        if acc >= cfg.sft_target or steps >= cfg.sft_steps:
            break
        steps = min(cfg.sft_steps, steps + cfg.sft_chunk)
    folder = run_dir / "model"
    result.model.save_pretrained(folder)
    result.tokenizer.save_pretrained(folder)
    return folder, steps, acc


def rl_config(cfg: DemoConfig, model: Path, data: dict[str, Path], out: Path, steps: int) -> RLConfig:
    """GRPO on the task: group_norm advantages, PPO clip 0.2, token-mean; with rl_kl_monitor the KL to the SFT
    model is logged (not in the loss), else there is no reference model."""
    return RLConfig(
        model=ModelConfig(name_or_path=str(model)),
        data=DataConfig(
            datasets=[str(data["rl"])],
            eval_dataset=str(data["eval"]),
            datasource_key="datasource",
            seed=cfg.seed,
        ),
        optim=OptimConfig(lr=cfg.rl_lr, warmup_steps=0, scheduler="constant", weight_decay=0.0),
        train=RLTrainConfig(
            seed=cfg.seed, max_steps=steps, log_every=50, device=cfg.device, output_dir=str(out)
        ),
        ckpt=CkptConfig(
            save_every=0,
            keep_last=1,
            resume="none",
            overwrite=True,
            best_metric="eval/pass@1",
            best_mode="max",
        ),
        logger=LoggerConfig(progress_bar=True),
        reward=RewardConfig(source=f"task:{cfg.task}"),
        rollout=RolloutConfig(
            prompts_per_step=cfg.rl_prompts, n_samples=8, temperature=1.0, max_new_tokens=6, max_len=64
        ),
        algo=AlgoConfig(
            advantage="group_norm", policy_loss="ppo", kl_mode="monitor" if cfg.rl_kl_monitor else "none"
        ),
        filter=FilterConfig(enabled=cfg.rl_filter, max_refills=2),
        eval=EvalConfig(every=max(1, steps // 8)),
    )


def evaluate_only(cfg: DemoConfig, model: Path, data: dict[str, Path], out: Path) -> float:
    """Held-out greedy exact-match accuracy of `model` (the RL trainer's eval path, no training step)."""

    rl = rl_config(cfg, model, data, out, steps=1)
    trainer = RLTrainer(rl)
    try:
        acc = trainer.evaluate().get("eval/pass@1", 0.0)
    finally:
        trainer.roles.close()
    return acc


def run_demo(cfg: DemoConfig) -> dict:
    """The whole demo; returns the summary (also written to <output_dir>/summary.json)."""

    t0, cpu0 = time.perf_counter(), time.process_time()
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("base", "data", "sft", "rl", "final", "control_sft", "control_eval"):  # a re-run starts fresh
        shutil.rmtree(out / sub, ignore_errors=True)
    base = build_base_model(cfg, out / "base")
    print(f"demo: tiny model ({cfg.hidden} hidden, {cfg.layers} layers) in {base}", flush=True)
    t_sft, cpu_sft = time.perf_counter(), time.process_time()
    data = make_demo_data(cfg, out / "data")
    sft_model, sft_steps, dev_acc = sft_until_target(cfg, base, data, out / "sft")
    sft_seconds, sft_cpu = time.perf_counter() - t_sft, time.process_time() - cpu_sft
    print(f"demo: SFT done in {sft_seconds:.0f}s; RL on {cfg.task} ({cfg.rl_steps} steps)", flush=True)
    t_rl, cpu_rl = time.perf_counter(), time.process_time()
    result = RLTrainer(rl_config(cfg, sft_model, data, out / "rl", cfg.rl_steps)).fit()
    rl_seconds, rl_cpu = time.perf_counter() - t_rl, time.process_time() - cpu_rl
    if result.exit_code != 0:
        raise DemoStopped(result.exit_code, f"demo: the RL phase stopped: {result.message}")
    summary = {
        "task": cfg.task,
        "seed": cfg.seed,
        "model": {"hidden": cfg.hidden, "layers": cfg.layers},
        "accuracy_sft": result.first_eval.get("eval/pass@1"),
        "accuracy_rl": result.eval.get("eval/pass@1"),
        "rl_steps": result.steps,
        "sft_steps": sft_steps,
        "dev_accuracy_sft": dev_acc,
        "eval_prompts": int(result.eval.get("eval/prompts", 0)),
        "seconds_sft": round(sft_seconds, 1),
        "seconds_rl": round(rl_seconds, 1),
        "cpu_seconds_sft": round(sft_cpu, 1),
        "cpu_seconds_rl": round(rl_cpu, 1),
        "threads": cfg.threads,
    }
    _copy_outputs(out, result.run_dir, result.final_model)
    if cfg.control:
        summary.update(run_control(cfg, base, data, out, rl_seconds, sft_seconds, sft_steps))
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["cpu_seconds"] = round(time.process_time() - cpu0, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def run_control(
    cfg: DemoConfig,
    base: Path,
    data: dict[str, Path],
    out: Path,
    rl_seconds: float,
    sft_seconds: float,
    sft_steps: int,
) -> dict:
    """The SFT run continued (from its checkpoint, same rows) for about the RL time, evaluated the same way."""
    extra = max(cfg.sft_chunk, int(sft_steps * rl_seconds / max(1e-9, sft_seconds)))
    print(f"demo: control: {extra} more SFT steps instead of RL", flush=True)
    run_dir = out / "control_sft"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(out / "sft", run_dir)
    result = run_sft_phase(cfg, base, data["sft"], run_dir, sft_steps + extra)
    _check_phase(result, "control SFT", run_dir)
    result.model.save_pretrained(run_dir / "model")
    result.tokenizer.save_pretrained(run_dir / "model")
    acc = evaluate_only(cfg, run_dir / "model", data, out / "control_eval")
    return {"accuracy_control_more_sft": acc, "control_sft_steps": sft_steps + extra}


def _copy_outputs(out: Path, rl_dir: Path, final: Path | None) -> None:
    if (rl_dir / "curves.png").is_file():
        shutil.copy(rl_dir / "curves.png", out / "curves.png")
    if final is not None:
        shutil.rmtree(out / "final", ignore_errors=True)
        shutil.copytree(final, out / "final")


def main(argv: list[str] | None = None) -> int:
    """`relayrl demo [--seed N] [--control true] ...`."""

    def go(cfg: DemoConfig) -> int:
        try:
            s = run_demo(cfg)
        except DemoStopped as stop:
            print(str(stop), file=sys.stderr, flush=True)
            return stop.exit_code
        print(
            f"\ndemo: held-out exact match on {s['task']} ({s['eval_prompts']} prompts, greedy): "
            f"after SFT {s['accuracy_sft']:.3f} -> after RL {s['accuracy_rl']:.3f} "
            f"({s['rl_steps']} RL steps); total {s['seconds']:.0f}s ({s['cpu_seconds']:.0f}s of CPU time "
            f"after start-up, {s['threads']} thread(s))"
        )
        if "accuracy_control_more_sft" in s:
            print(
                f"demo: control (same time on more SFT instead of RL): {s['accuracy_control_more_sft']:.3f}"
            )
        print(
            f"demo: summary in {Path(cfg.output_dir) / 'summary.json'}, plot in {Path(cfg.output_dir) / 'curves.png'}"
        )
        return 0

    return run_command(DemoConfig, argv, "relayrl demo", go, description=(__doc__ or "").splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
