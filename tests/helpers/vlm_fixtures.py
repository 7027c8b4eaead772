"""Helpers of the vision-language tests: the image task's rows as files, and greedy accuracy on them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from relayrl.agents.executors import SingleTurnExecutor, execute_all
from relayrl.config.components import DataConfig
from relayrl.data.build import build_prompt_data
from relayrl.rollout.base import SamplingParams
from relayrl.rollout.hf import HFEngine
from relayrl.tasks import get_task
from relayrl.tasks.image_digit import ImageDigit


def write_rows(path: Path, split: str, n: int, seed: int = 0, digits: str = "0123456789") -> Path:
    """`n` image_digit rows of `split` (pictures of `digits`) as JSONL at `path`."""
    rows = ImageDigit(digits=digits).make_rows(split, n, seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def greedy_accuracy(model: Any, tokenizer: Any, data: Path, max_new_tokens: int = 2) -> float:
    """Exact-match accuracy of greedy answers to the rows of `data` (hf engine, the task's reward)."""
    prompts, _, _ = build_prompt_data(DataConfig(datasets=[str(data)]), tokenizer, log=lambda _: None)
    engine = HFEngine(model, tokenizer, driver="loop")
    executor = SingleTurnExecutor(engine, tokenizer)
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        trajs = asyncio.run(execute_all(executor, prompts, params))
    finally:
        model.train(was_training)
        engine.close()
    task = get_task("image_digit")
    return sum(task.reward(t.response_text, t.sample.label) for t in trajs) / len(trajs)
