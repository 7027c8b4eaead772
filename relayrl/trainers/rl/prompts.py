"""The prompts of `relayrl rl`: a built-in task's rows or the user's data files, and the label check."""

from __future__ import annotations

import inspect
import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.agents.rewards.func import load_reward_func
from relayrl.config.base import ConfigError
from relayrl.config.rl import RLConfig
from relayrl.data.build import build_prompt_data
from relayrl.data.records import PromptSample
from relayrl.tasks import get_task


# ------------------------------------------------------------------------------------------------ prompts
@dataclass(kw_only=True, slots=True)
class Prompts:
    """The prompt sets of a run."""

    train: list[PromptSample]
    """Training prompts (index = position in this list)."""
    eval: list[PromptSample]
    """Held-out eval prompts (may be empty)."""
    stats: list[Any]
    """Per-source load statistics (printed)."""


def write_task_rows(cfg: RLConfig, run_dir: Path) -> tuple[str, str]:
    """Write the task's train / eval rows as JSONL under <run>/data/; returns the two paths."""

    task = get_task(cfg.task.name)
    folder = run_dir / "data"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", cfg.task.train_rows), ("test", cfg.task.eval_rows)):
        rows = task.make_rows(split, n, cfg.data.seed) if n > 0 else []
        path = folder / f"{cfg.task.name}_{split}.jsonl"
        path.write_text("".join(json.dumps({**row, "datasource": cfg.task.name}) + "\n" for row in rows))
        paths.append(str(path))
    return paths[0], paths[1]


def build_prompts(cfg: RLConfig, run_dir: Path, tokenizer: Any) -> Prompts:
    """Prompts from the task (written to JSONL) or from `data`; an empty training set is a clear error."""

    data = cfg.data
    if cfg.task.name:
        train_path, eval_path = write_task_rows(cfg, run_dir)
        data = replace(
            data,
            datasets=[train_path],
            dataset_probs=[],
            eval_dataset=eval_path if cfg.task.eval_rows > 0 else None,
            datasource_key="datasource",
        )
    if not data.datasets:
        raise ConfigError(
            "no prompts: set --data.datasets FILE... or --task.name (e.g. add2)", field="data.datasets"
        )
    train, evals, stats = build_prompt_data(data, tokenizer)
    if not train:
        raise ValueError(
            f"the training prompt set is empty after loading {data.datasets} (see the data summary above: rows "
            "dropped as too long or malformed are counted there); add data or raise data.max_len"
        )
    if cfg.eval.max_prompts:
        evals = evals[: cfg.eval.max_prompts]
    return Prompts(train=list(train), eval=list(evals), stats=list(stats))


def reads_labels(func: Any) -> bool:
    """True when a Python reward function reads its `labels` argument (a load of that name in its code)."""
    import dis

    code = getattr(inspect.unwrap(func), "__code__", None)  # the user's function, not its sys.exit guard
    if code is None:
        return False
    return any(i.opname.startswith("LOAD") and i.argval == "labels" for i in dis.get_instructions(code))


def check_labels(cfg: RLConfig, prompts: Prompts) -> None:
    """Every training prompt lacks a label: an error when the reward function reads labels (it would score
    every sample against None and train on a constant), a loud warning when relayrl cannot tell (a remote or
    model reward). Some prompts without a label are counted in the data summary (no_label)."""
    missing = sum(p.label is None for p in prompts.train)
    if not prompts.train or missing < len(prompts.train) or cfg.task.name:
        return
    src = cfg.reward.source
    where = f"data.label_key={cfg.data.label_key!r}"
    if src.endswith(".py"):
        if reads_labels(load_reward_func(src)):
            raise ValueError(
                f"none of the {missing} training prompts has a label ({where} is missing or null in every row) but "
                f"the reward function in {src} reads `labels`: every sample would be scored against None. Set "
                "--data.label_key to the column holding the answers, or use a reward that does not need labels"
            )
        return
    warnings.warn(
        f"none of the {missing} training prompts has a label ({where}); the reward {src or 'source'} receives "
        "None as every label",
        stacklevel=2,
    )
