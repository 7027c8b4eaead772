"""What of `timing/generation` grows with the ranks at a fixed per-rank batch, without a model (CPU, Ray).

    PYTHONPATH=. python bench/gen_return.py [--per-rank 512 --ranks 1,2,4 --prompt 20 --response 107
                                             --max-response 256 --out x.json]

Each of --ranks Ray actors stands in for a policy rank holding --per-rank synthetic trajectories (groups of 8,
GPU-scale lengths: the 0.5B weak-scaling run's ~107 mean new tokens, at most 256) and returns them through
`RayRole.call` exactly as `PolicyWorker.rollout` does; then the driver runs the rest of the rollout phase
(relayrl.trainers.rl.rollout) on the merged batch. Seconds, best of --repeats, per part:

    ranks_ready      the call until every rank's result is in the object store (RayRole.ready_s: serialising
                     on the ranks; the actors share this host's cores, so it grows here, not on a GPU host)
    return           from the last rank ready to the merged list in the driver (fetch + unpickle)
    driver_unpickle  pickle.loads of every rank's share in the driver alone (the serial part of `return`)
    reward           the reward in the driver (the RL tests' digit reward file: decode of all ids + function)
    reward_decode    its decode of every trajectory's token ids (agents.rewards.base.decode_all)
    reward_ranks_decoded  the reward when the ranks made `Trajectory.query_text` (Ray with a reward_func file
                     or remote RM, relayrl.trainers.rl.roles.decode_queries): the driver decodes nothing
    rank_decode      what that costs one rank: decoding its own --per-rank trajectories (in parallel)
    failure_groups   failure policy + complete groups + rollout/* metrics

Prints one line per rank count and writes the JSON (--out). ~1 minute.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.reward_phase import best_of
from relayrl.agents.base import Trajectory
from relayrl.agents.failures import apply_failure_policy
from relayrl.agents.rewards.base import decode_all
from relayrl.config.dist import DistConfig
from relayrl.distributed.group import merged
from relayrl.distributed.launch.ray import RayLauncher
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.trainers.rl.experience import complete_groups, rollout_metrics
from relayrl.workers.reward import RewardSpec, RewardWorker

REWARD = Path(__file__).parents[1] / "tests" / "trainers" / "data" / "digit_reward.py"


class Rank:
    """A policy rank whose rollout returns prepared trajectories (its share of a weak-scaling step)."""

    def __init__(self, per_rank: int, prompt: int, response: int, max_response: int) -> None:
        from bench.driver_step import trajectories

        self.trajs = trajectories(per_rank, 8, prompt, response, build_tiny_tokenizer(), max_response)

    @merged("concat")
    def rollout(self) -> list[Trajectory]:
        return self.trajs


def driver_parts(trajs: list[Trajectory], reward: RewardWorker, per_rank: int, n: int, repeats: int) -> dict:
    """The driver's serial work on the merged trajectories of `n` ranks (see module doc), seconds."""
    tok = reward.source.tokenizer  # type: ignore[attr-defined]  (a reward_func file's source has one)
    t: dict[str, float] = {}
    shares = [pickle.dumps(trajs[i * per_rank : (i + 1) * per_rank]) for i in range(n)]
    t["driver_unpickle"] = best_of(repeats, lambda: [pickle.loads(s) for s in shares])
    texts = decode_all(tok, [x.token_ids for x in trajs])
    decoded = [replace(x, query_text=q) for x, q in zip(trajs, texts, strict=True)]

    def score(batch: list[Trajectory]) -> None:
        for x in batch:
            x.reward = x.score = None
        reward.score(batch)

    t["reward"] = best_of(repeats, lambda: score(trajs))
    t["reward_decode"] = best_of(repeats, lambda: decode_all(tok, [x.token_ids for x in trajs]))
    t["reward_ranks_decoded"] = best_of(repeats, lambda: score(decoded))
    assert [x.reward for x in decoded] == [x.reward for x in trajs]  # the same rewards
    mine = [x.token_ids for x in trajs[:per_rank]]
    t["rank_decode"] = best_of(repeats, lambda: decode_all(tok, mine))
    t["failure_groups"] = best_of(
        repeats, lambda: rollout_metrics(complete_groups(apply_failure_policy(trajs, "drop_group")[0], 8))
    )
    return t


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--per-rank", type=int, default=512)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--prompt", type=int, default=20)
    p.add_argument("--response", type=int, default=107)
    p.add_argument("--max-response", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="")
    args = p.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    tok = build_tiny_tokenizer()
    folder = Path("/tmp") / "relayrl_gen_return_tok"
    tok.save_pretrained(folder)
    reward = RewardWorker(RewardSpec(source=str(REWARD), tokenizer=str(folder)))
    results: dict[str, Any] = {"per_rank": args.per_rank, "response": args.response}
    for n in [int(x) for x in args.ranks.split(",")]:
        cfg = DistConfig(mode="ray", num_cpus=4, gpus="no", policy_num_gpus_per_node=n, timeout_s=120)
        launcher = RayLauncher(cfg, {"policy": n})
        try:
            role = launcher.spawn(
                "policy", Rank, args.per_rank, args.prompt, args.response, args.max_response
            )
            t: dict[str, float] = {}
            trajs: list[Trajectory] = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                trajs = role.call(Rank.rollout)
                call_s = time.perf_counter() - t0
                ready = max(role.ready_s["rollout"])
                if call_s < t.get("call", float("inf")):
                    t.update(call=call_s, ranks_ready=ready, **{"return": call_s - ready})
            t.update(driver_parts(trajs, reward, args.per_rank, n, args.repeats))
        finally:
            launcher.shutdown()
        results[str(n)] = t
        print(n, "ranks,", len(trajs), "trajectories:", {k: round(v, 4) for k, v in t.items()}, flush=True)
    ray.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
