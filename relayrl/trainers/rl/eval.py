"""Evaluation metrics of `relayrl rl`: mean reward, pass@1 and pass@k, overall and per data source.

    metrics = evaluate(generate, score, eval_prompts, seed=train.seed, eval=cfg.eval)   # + timing/eval
    metrics = eval_metrics(trajs, n_samples=k, threshold=0.5)
      eval/reward, eval/pass@1, eval/pass@k, eval/failed        over every eval prompt
      eval/<datasource>/reward, .../pass@1, .../pass@k          per data source

`evaluate` is the one eval pass of the RL loop (its roles generate and score) and of `relayrl eval`
(relayrl/apps/eval.py: an engine and a reward source in this process, no trainer): the eval prompts sampled
with the eval settings (eval=True) under seed train.seed + EVAL_SEED_OFFSET, then scored.

A sample is correct when its score (default: its reward) is > `threshold`; a FAILED sample counts as
incorrect and is counted in eval/failed. pass@k uses the unbiased estimator of Chen et al. 2021 (Codex,
arXiv 2107.03374): with n samples of which c are correct, pass@k = 1 - C(n - c, k) / C(n, k), averaged over
prompts. With n = 1 (greedy), pass@1 is the exact-match accuracy.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from math import comb

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.config.rl import EvalConfig
from relayrl.data.records import PromptSample

EVAL_SEED_OFFSET = 12345
"""The eval generation seed is train.seed + this (apart from every training step's seeds)."""

Generate = Callable[[list[PromptSample], int, bool], list[Trajectory]]
"""(prompts, seed, eval) -> n trajectories per prompt, grouped (a Generates role's rollout)."""


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
    per_source: dict[str | None, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
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


def evaluate(
    generate: Generate,
    score: Callable[[list[Trajectory]], list[Trajectory]],
    prompts: list[PromptSample],
    *,
    seed: int,
    eval: EvalConfig,
) -> dict[str, float]:
    """eval/* of `prompts` (see module doc) and timing/eval, its seconds."""
    t0 = time.perf_counter()
    trajs = score(generate(prompts, seed + EVAL_SEED_OFFSET, True))
    metrics = eval_metrics(trajs, n_samples=eval.n_samples, threshold=eval.correct_threshold)
    metrics["timing/eval"] = time.perf_counter() - t0
    return metrics
