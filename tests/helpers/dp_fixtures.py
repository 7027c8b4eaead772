"""Helpers shared by the data-parallel tests (2 and 4 ranks against 1): a small addition dataset, one
`relayrl sft` run through the CLI, and the per-step metric comparison (imported by name: tests/helpers is on
pytest's pythonpath).

    data = addition_rows(tmp_path / "train.jsonl")
    metrics = run_sft(model, data, tmp_path / "one", batch_size=8)           # + extra CLI flags
    assert_metrics_close(one[i], four[i], f"step {i}")
    cfg = rl_cfg(model, tmp_path / "two", 2, replicate=False, exact=False)   # + ckpt fields (e.g. resume=)
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

DIGIT_REWARD = Path(__file__).parents[1] / "trainers" / "data" / "digit_reward.py"

VOLATILE = ("timing/", "perf/")
"""Metric prefixes that differ between runs by nature (wall times, memory), left out of comparisons."""


def assert_metrics_close(a: dict, b: dict, where: str) -> None:
    """The same metric names (VOLATILE aside), every value within rtol 1e-4 / atol 1e-5: the ranks compute the
    same sums in another order (fp32 rounding); a lost share or a wrong denominator moves a loss by > 1e-2."""
    keys = {k for k in a if not k.startswith(VOLATILE)}
    assert keys == {k for k in b if not k.startswith(VOLATILE)}, where
    for k in sorted(keys):
        assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-5), f"{where} {k}: {a[k]} vs {b[k]}"


def addition_rows(path: Path) -> Path:
    """28 rows "a+b=" -> "a+b" (a in 10..16, b in 20..23) as a jsonl file at `path`."""
    rows = [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(10, 17) for b in range(20, 24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_sft(model: Path, data: Path, out: Path, *extra: str, batch_size: int) -> list[dict]:
    """4 CPU steps of `relayrl sft` (micro-batches of 2, lr 3e-3, 15% eval split, a checkpoint every 2
    steps) writing to `out`; returns its metrics.jsonl rows."""
    from relayrl.cli import main as cli_main
    from relayrl.training.logging import read_jsonl

    argv = [
        "sft",
        *("--model.name_or_path", str(model), "--data.datasets", str(data)),
        *("--data.eval_split_ratio", "0.15", "--train.batch_size", str(batch_size)),
        *("--train.micro_batch_size", "2", "--train.output_dir", str(out)),
        *("--optim.lr", "3e-3", "--optim.warmup_steps", "1", "--logger.progress_bar", "false"),
        *("--train.device", "cpu", "--train.max_steps", "4", "--ckpt.save_every", "2", *extra),
    ]
    assert cli_main(argv) == 0
    return read_jsonl(out / "metrics.jsonl")


def rl_cfg(model: Path, out: Path, ranks: int, *, replicate: bool = False, exact: bool = False, **ckpt: Any):
    """A 2-step CPU PPO run (GAE, a reference with a KL loss, a critic; a checkpoint every step) with policy,
    reference and critic each on `ranks` ranks (Ray when > 1; `replicate`: dist.replicate), `exact`:
    rollout.exact; `ckpt`: more ckpt fields."""
    from relayrl.config.presets import tiny_cpu_config

    cfg = tiny_cpu_config(str(model), str(out), steps=2, reward=str(DIGIT_REWARD))
    return replace(
        cfg,
        algo=replace(cfg.algo, advantage="gae", kl_mode="loss", kl_coef=0.1),
        rollout=replace(cfg.rollout, exact=exact),
        ckpt=replace(cfg.ckpt, save_every=1, **ckpt),
        dist=replace(
            cfg.dist,
            mode="ray" if ranks > 1 else "local",
            replicate=replicate,
            policy_num_gpus_per_node=ranks,
            ref_num_gpus_per_node=ranks,
            critic_num_gpus_per_node=ranks,
            timeout_s=120,
        ),
    )


def one_and_two_ranks(cfg_one: Any, cfg_two: Any) -> tuple[Any, Any, dict, list[float]]:
    """`cfg_one` run on one rank, then `cfg_two` (its roles on 2 ranks); returns (one's result, two's result,
    two's PolicyWorker.info, two's weight canary read after each step)."""
    from relayrl.trainers.rl.loop import RLTrainer, run_rl
    from relayrl.workers.policy import PolicyWorker

    one = run_rl(cfg_one)
    trainer = RLTrainer(cfg_two)
    info = trainer.roles.policy.call(PolicyWorker.info)
    canaries: list[float] = []
    two = trainer.fit(
        on_step=lambda step, m: canaries.append(trainer.roles.policy.call(PolicyWorker.weight_canary))
    )
    return one, two, info, canaries
