"""`relayrl iterative-dpo`: online preference learning in rounds (OpenRLHF's iterative DPO recipe; Xiong et al.
2024, arXiv 2312.11456):

    for round k = 1..rounds:
        generate  rollout.n_samples per prompt with the current model   relayrl.apps.generate (select pairs)
        score     with reward.source (task / reward_func / RM / remote RM)
        pair      each prompt's best against its worst sample (ties skipped)
        dpo       on those pairs, from the current model, reference = the current model   relayrl.trainers.dpo
    then one more generation pass scores the final model (eval.jsonl)

Run folder (train.output_dir, default runs/iterative-dpo):

    round_<k>/pairs.jsonl           the round's pairs (written atomically once generated; reused on rerun)
    round_<k>/dpo/                  the round's DPO run folder (checkpoints, metrics.jsonl, final/)
    rounds.jsonl                    one row per finished round: mean reward of its samples, pairs, DPO loss
    eval.jsonl, summary.json        the final model's samples and the per-round mean rewards

Resumable: a round whose DPO run has its final model is skipped; an interrupted round reuses its pairs and
its DPO run resumes from its newest checkpoint (exactly, as `relayrl dpo` does), so rerunning the command
continues where it stopped. The prompts of round k are sampled with seed + k.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from relayrl.apps.generate import run_generate, write_jsonl_atomic
from relayrl.config.base import save_yaml
from relayrl.config.command_line import run_command
from relayrl.config.components import (
    DataConfig,
)
from relayrl.config.generate import GenerateConfig, IterativeDPOConfig, SelectMode
from relayrl.config.recipes import DPOConfig
from relayrl.models.merge import merge_lora
from relayrl.trainers.dpo import run_dpo


def _generate(cfg: IterativeDPOConfig, model_path: str, out: Path, select: SelectMode, seed: int) -> Any:

    gen = GenerateConfig(
        model=replace(cfg.model, name_or_path=model_path),
        data=cfg.data,
        task=cfg.task,
        rollout=cfg.rollout,
        reward=cfg.reward,
        output=str(out),
        select=select,
        seed=seed,
        device=cfg.train.device if cfg.train.device in ("cpu", "cuda") else "auto",
    )
    result = run_generate(gen)
    print(result.summary(select), flush=True)
    return result


def _dpo(cfg: IterativeDPOConfig, model_path: str, pairs: Path, folder: Path) -> Any:

    dpo_cfg = DPOConfig(
        model=replace(cfg.model, name_or_path=model_path),
        data=DataConfig(datasets=[str(pairs)], max_len=cfg.data.max_len, seed=cfg.data.seed),
        optim=cfg.optim,
        train=replace(cfg.train, output_dir=str(folder)),
        ckpt=cfg.ckpt,
        logger=cfg.logger,
        dist=cfg.dist,
        dpo=cfg.dpo,
    )
    return run_dpo(dpo_cfg)


def _mean_reward(rows: list[dict[str, Any]]) -> float:
    values = [r["reward"] for r in rows if r.get("reward") is not None]
    return sum(values) / len(values) if values else float("nan")


def run_iterative_dpo(cfg: IterativeDPOConfig) -> dict[str, Any]:
    """Run (or continue) every round; returns the summary (per-round mean rewards, final model)."""
    out = Path(cfg.train.output_dir or "runs/iterative-dpo")
    out.mkdir(parents=True, exist_ok=True)
    save_yaml(cfg, out / "config.yaml")
    current = cfg.model.name_or_path
    history: list[dict[str, Any]] = []
    for k in range(1, cfg.rounds + 1):
        folder = out / f"round_{k}"
        final = folder / "dpo" / "final"
        if (final / "config.json").is_file() or (final / "adapter_config.json").is_file():
            print(f"relayrl iterative-dpo: round {k} already done ({final})")
            current = _merged(final, folder, cfg)
            continue
        pairs = folder / "pairs.jsonl"
        if pairs.is_file():
            print(f"relayrl iterative-dpo: round {k}: reusing {pairs}")
        else:
            folder.mkdir(parents=True, exist_ok=True)
            gen = _generate(cfg, current, folder / "samples.jsonl", "all", cfg.seed + k)
            _write_pairs(gen.rows, pairs)
        rows = [
            json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines() if line.strip()
        ]
        n_pairs = sum(1 for line in pairs.read_text().splitlines() if line.strip())
        if n_pairs == 0:
            raise ValueError(
                f"round {k}: no pair (every prompt's samples scored the same); raise rollout.n_samples or "
                "rollout.temperature, or use a finer reward"
            )
        result = _dpo(cfg, current, pairs, folder / "dpo")
        if result.exit_code:
            raise SystemExit(result.exit_code)
        row = {"round": k, "mean_reward": _mean_reward(rows), "pairs": n_pairs, **_last(result.metrics)}
        history.append(row)
        with (out / "rounds.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"relayrl iterative-dpo: round {k}: samples' mean reward {row['mean_reward']:.4f}, {n_pairs} pairs"
        )
        current = _merged(result.final_model, folder, cfg)
    final_rows = _generate(cfg, current, out / "eval.jsonl", "all", cfg.seed).rows
    summary = {
        "rounds": _read_rounds(out),
        "final_mean_reward": _mean_reward(final_rows),
        "final_model": str(current),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _write_pairs(rows: list[dict[str, Any]], path: Path) -> None:
    """Best vs worst scored sample per prompt (ties skipped), from generate's `all` rows."""

    by_prompt: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("reward") is not None and r.get("output", "").strip():
            by_prompt.setdefault(r["input"], []).append(r)
    pairs = []
    for prompt, group in by_prompt.items():
        best = max(group, key=lambda r: r["reward"])
        worst = min(group, key=lambda r: r["reward"])
        if best["reward"] > worst["reward"] and best["output"] != worst["output"]:
            pairs.append({"input": prompt, "chosen": best["output"], "rejected": worst["output"]})
    write_jsonl_atomic(path, pairs)


def _merged(final: Path, folder: Path, cfg: IterativeDPOConfig) -> str:
    """The round's model as a full folder: LoRA adapters are merged (the next round starts from it)."""
    if not (Path(final) / "adapter_config.json").is_file():
        return str(final)

    merged = folder / "merged"
    if not (merged / "config.json").is_file():
        merge_lora(final, merged)
    return str(merged)


def _last(metrics: dict[str, Any]) -> dict[str, Any]:
    keep = ("train/loss", "train/margin", "train/acc")
    return {k: metrics[k] for k in keep if k in metrics}


def _read_rounds(out: Path) -> list[dict[str, Any]]:
    path = out / "rounds.jsonl"
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    latest = {r["round"]: r for r in rows}  # a rerun of a round after a crash appends it again
    return [latest[k] for k in sorted(latest)]


def main(argv: list[str] | None = None) -> int:
    """`relayrl iterative-dpo --model.name_or_path PATH (--task.name T | --data.datasets F --reward.source R)`."""

    def go(cfg: IterativeDPOConfig) -> int:
        summary = run_iterative_dpo(cfg)
        line = ", ".join(f"round {r['round']} {r['mean_reward']:.4f}" for r in summary["rounds"])
        print(
            f"relayrl iterative-dpo: samples' mean reward by round: {line}; final model {summary['final_mean_reward']:.4f}"
        )
        print(f"relayrl iterative-dpo: final model in {summary['final_model']}")
        return 0

    return run_command(
        IterativeDPOConfig, argv, "relayrl iterative-dpo", go, description=(__doc__ or "").split("\n\n")[0]
    )
