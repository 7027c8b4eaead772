"""The RL driver's own per-step work at growing global batches, without a model (CPU, Ray).

    PYTHONPATH=. python bench/driver_step.py --batches 512,1024,2048 [--prompt 20 --response 40] [--out x.json]
    PYTHONPATH=. python bench/driver_step.py --response 108 --max-response 256 --min-block-bytes 0   # 64 blocks

Synthetic trajectories (groups of --samples, `--prompt` prompt tokens, `--response` response tokens, the
digit reward of the RL tests) go through exactly what the controller (relayrl.trainers.rl.loop, rollout.py)
does in `dist.mode=ray` with 2 policy ranks, phase by phase, timed on the driver:

    rollout_return   the policy ranks' trajectories back to the driver (Ray pickles list[Trajectory])
    reward           RewardWorker.scores on its Ray actor (trajectories there, decode, reward_func, fields back)
    rollout_misc     failure policy, complete groups, rollout/* metrics
    collate          trajectories -> SequenceBatch
    rows_batch       the batch into Ray's object store (relayrl.distributed.launch.rows.RowStore)
    advantages       shaped rewards + group advantages
    rows_exp         the experience's own fields into the object store
    rank_fetch       one rank's share of the experience read back (in the driver process: an upper bound)

--max-response caps the response lengths (the GPU scale runs' 256 new tokens: 276-token rows);
--min-block-bytes sets relayrl.distributed.launch.rows.MIN_BLOCK_BYTES (0: the 64-block rule alone, as before
it existed); --threads the driver's torch CPU threads (default: what run_rl sets on a GPU host, min(torch's
default, relayrl.trainers.rl.setup.DRIVER_THREADS_GPU = 8); the JSON's "host" records them and the CPUs this process may use: more threads than CPUs
oversubscribes every small tensor op of the driver). Prints one line per batch and writes the seconds as JSON (--out). No GPU, no model; ~1 minute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from relayrl.agents.base import Trajectory
from relayrl.agents.failures import apply_failure_policy
from relayrl.config.presets import tiny_cpu_config
from relayrl.data.records import PromptSample
from relayrl.distributed.launch import rows
from relayrl.distributed.launch.rows import RowStore
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.trainers.rl.experience import (
    complete_groups,
    rollout_metrics,
    step_advantages,
    trajectory_rewards,
)
from relayrl.trainers.rl.setup import DRIVER_THREADS_GPU
from relayrl.trainers.rl.validate import validate_rl
from relayrl.workers.base import Experience, collate
from relayrl.workers.reward import RewardSpec, RewardWorker, apply_scores

REWARD = Path(__file__).parents[1] / "tests" / "trainers" / "data" / "digit_reward.py"


def trajectories(
    batch: int, samples: int, prompt: int, response: int, tokenizer, max_response: int = 0
) -> list[Trajectory]:
    """`batch` synthetic trajectories in groups of `samples` (response lengths vary around `response`, at
    most `max_response` when > 0)."""
    rng = random.Random(0)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    out = []
    for p in range(batch // samples):
        ids = [rng.choice(vocab) for _ in range(prompt)]
        sample = PromptSample(index=p, prompt=tokenizer.decode(ids), prompt_ids=ids, label="")
        for _ in range(samples):
            n = max(1, int(rng.expovariate(1 / response)))
            n = min(n, max_response) if max_response > 0 else n
            resp = [rng.choice(vocab) for _ in range(n)]
            out.append(
                Trajectory(
                    sample=sample,
                    token_ids=ids + resp,
                    action_mask=[False] * prompt + [True] * n,
                    rollout_logprobs=[0.0] * prompt + [-rng.random() for _ in range(n)],
                    versions=[-1] * prompt + [0] * n,
                    response_text=tokenizer.decode(resp),
                )
            )
    return out


class Echo:
    """Stands in for a policy rank: returns its share of the trajectories (Ray pickles them back)."""

    def back(self, x: list[Trajectory]) -> list[Trajectory]:
        return x


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--batches", default="512,1024,2048")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt", type=int, default=20)
    p.add_argument("--response", type=int, default=40)
    p.add_argument("--max-response", type=int, default=0, help="cap on response lengths (0: none)")
    p.add_argument("--min-block-bytes", type=int, default=-1, help="rows.MIN_BLOCK_BYTES (-1: the default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: as run_rl on a GPU, min(default, 8))"
    )
    p.add_argument("--out", default="")
    args = p.parse_args()
    import ray

    default_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or max(1, min(default_threads, DRIVER_THREADS_GPU)))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    host = {"torch_default_threads": default_threads, "threads": torch.get_num_threads(), "usable_cpus": cpus}
    print("threads", host, flush=True)
    if args.min_block_bytes >= 0:
        rows.MIN_BLOCK_BYTES = args.min_block_bytes
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    tok = build_tiny_tokenizer()
    pad: int = tok.pad_token_id  # type: ignore[assignment]  (the tiny tokenizer has one)
    folder = Path("/tmp") / "relayrl_driver_step_tok"
    tok.save_pretrained(folder)
    cfg = validate_rl(tiny_cpu_config(str(folder), "/tmp/relayrl_driver_step", reward=str(REWARD)))
    reward: Any = ray.remote(RewardWorker).remote(RewardSpec(source=str(REWARD), tokenizer=str(folder)))

    echo: Any = ray.remote(Echo).remote()
    results: dict[str, Any] = {"host": host}
    for b in [int(x) for x in args.batches.split(",")]:
        trajs = trajectories(b, args.samples, args.prompt, args.response, tok, args.max_response)
        halves = [ray.put(trajs[: b // 2]), ray.put(trajs[b // 2 :])]
        best: dict[str, float] = {}
        for _ in range(args.repeats):
            t: dict[str, float] = {}
            t0 = time.perf_counter()
            got = [
                t for part in ray.get([echo.back.remote(h) for h in halves]) for t in part
            ]  # two ranks' shares
            t["rollout_return"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            got = apply_scores(got, ray.get(reward.scores.remote(got)))  # as RolloutPhase does
            t["reward"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ok, _ = apply_failure_policy(got, "drop_group")
            ok = complete_groups(ok, args.samples)
            rollout_metrics(ok)
            t["rollout_misc"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            batch = collate(ok, pad)
            t["collate"] = time.perf_counter() - t0
            store = RowStore()
            t0 = time.perf_counter()
            store.put(batch)
            t["rows_batch"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            rewards, _ = trajectory_rewards(ok, cfg, None)
            adv, _, _, _ = step_advantages(
                cfg, rewards=rewards, action_mask=batch.action_mask, old_logprobs=batch.rollout_logprobs,
                ref_logprobs=None, values=None, kl_coef=0.0,
            )  # fmt: skip
            exp = Experience(tokens=batch, advantages=adv, rewards=rewards)
            t["advantages"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            stored = store.put(exp)
            t["rows_exp"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            lengths = stored.lengths
            mine = list(range(len(lengths) // 2))
            stored.select(mine)
            t["rank_fetch"] = time.perf_counter() - t0
            t["total"] = sum(t.values())
            best = {k: min(v, best.get(k, float("inf"))) for k, v in t.items()}
            del store, stored
        results[str(b)] = {k: round(v, 4) for k, v in best.items()}
        print(b, " ".join(f"{k} {v:.4f}" for k, v in best.items()), flush=True)

    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
