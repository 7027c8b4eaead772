"""The RL step's reward phase (timing/reward) at growing global batches: the Ray actor round trip vs in process.

    PYTHONPATH=. python bench/reward_phase.py [--sizes 512,1024,2048] [--repeats 5] [--source FILE|task:NAME]

Synthetic trajectories (groups of 8, --prompt prompt tokens, ~--response response tokens of the char
tokenizer, log-probs and versions filled as an engine fills them) are scored by the product's RewardWorker
with the reward of bench/scale.py (tests/trainers/data/digit_reward.py: a reward_func file, so every query is
the decode of all token ids). Rows, best of --repeats, seconds:

    actor_old    the phase as it was: RewardWorker.scores on its Ray actor (started by the product's
                 RayLauncher, one CPU actor) with every field pickled there, `Scored` back, apply_scores
    actor_new    the actor path kept for rm / prm / remote sources: score_trajectories over the actor (no
                 log-probs / versions pickled there)
    in_process   the path task: / reward_func / agent sources now take in every mode: score_trajectories
                 over a worker in this process (no pickling at all)
  breakdown of actor_old, each part timed in this process on the same data:
    pickle       list[Trajectory] -> bytes (what Ray does to the argument), MB alongside
    unpickle     bytes -> list[Trajectory] in the actor
    score        RewardWorker.scores (the source itself), of which `decode` (tokenizer.decode of each
                 trajectory's token ids, special tokens kept: the reward_func's queries)
    answer       the Scored list pickled and unpickled (the way back)
    apply        apply_scores on the driver
    ray_rest     actor_old - the parts above: Ray's own cost (task submit, object store, scheduling)

Prints a table and writes JSON to $OUT/reward_phase.json (else bench/results/reward_phase.json). CPU only;
about a minute on 2 cores (most of it Ray's start).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.agents.rewards import RewardFuncSource
from relayrl.agents.rewards.base import decode_all
from relayrl.config.dist import DistConfig
from relayrl.data.records import PromptSample
from relayrl.distributed.launch import build_launcher
from relayrl.distributed.launch.local import LocalRole
from relayrl.models.tiny import build_tiny_tokenizer
from relayrl.workers.reward import RewardSpec, RewardWorker, apply_scores, payload, score_trajectories

ROOT = Path(__file__).resolve().parents[1]
REWARD = ROOT / "tests" / "trainers" / "data" / "digit_reward.py"
ALPHABET = "abcdefghijklmnopqrstuvwxyz 0123456789+=\n"


def trajectories(n: int, prompt: int, response: int, tok: Any, samples: int = 8) -> list[Trajectory]:
    """`n` trajectories in groups of `samples`: `prompt` prompt tokens, response lengths uniform in
    [0.7, 1.3] x `response`, ending with EOS; engine-like log-probs and versions."""
    rng = random.Random(0)
    out = []
    for g in range(n // samples):
        text = "".join(rng.choice(ALPHABET) for _ in range(prompt))
        sample = PromptSample(index=g, prompt=text, prompt_ids=tok.encode(text), label="")
        p = len(sample.prompt_ids)
        for _ in range(samples):
            resp = "".join(
                rng.choice(ALPHABET) for _ in range(rng.randint(int(0.7 * response), int(1.3 * response)))
            )
            ids = [*tok.encode(resp), tok.eos_token_id]
            out.append(
                Trajectory(
                    sample=sample,
                    token_ids=sample.prompt_ids + ids,
                    action_mask=[False] * p + [True] * len(ids),
                    rollout_logprobs=[0.0] * p + [-rng.random() for _ in ids],
                    versions=[-1] * p + [3] * len(ids),
                    response_text=resp,
                )
            )
    return out


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    """The fastest of `repeats` timed calls of fn()."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class LoopDecode:
    """A tokenizer whose decode is one Python call per trajectory (what reward_func queries cost before
    relayrl.agents.rewards.base.decode_all)."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


class OldRewardWorker(RewardWorker):
    """The reward worker as it was: queries decoded one trajectory at a time."""

    def __init__(self, rs: RewardSpec) -> None:
        super().__init__(rs)
        if isinstance(self.source, RewardFuncSource) and self.source.tokenizer is not None:
            self.source.tokenizer = LoopDecode(self.source.tokenizer)


def breakdown(trajs: list[Trajectory], old: RewardWorker, tok: Any, repeats: int) -> dict[str, float]:
    """The old actor path's parts, each timed in this process on the same data (see module doc)."""
    blob = pickle.dumps(trajs)
    there = pickle.loads(blob)
    answer = old.scores(copy.deepcopy(there))
    ids = [t.token_ids for t in there]
    return {
        "pickle": best_of(repeats, lambda: pickle.dumps(trajs)),
        "pickle_mb": len(blob) / 1e6,
        "unpickle": best_of(repeats, lambda: pickle.loads(blob)),
        "score": best_of(repeats, lambda: old.scores(there)),
        "decode": best_of(repeats, lambda: [tok.decode(x, skip_special_tokens=False) for x in ids]),
        "answer": best_of(repeats, lambda: pickle.loads(pickle.dumps(answer))),
        "apply": best_of(repeats, lambda: apply_scores(trajs, answer)),
        "payload_mb": len(pickle.dumps([payload(t) for t in trajs])) / 1e6,
        "decode_all": best_of(repeats, lambda: decode_all(tok, ids)),
    }


def measure(n: int, args: argparse.Namespace, tok: Any, roles: dict[str, Any]) -> dict[str, float]:
    """One row of the table (see module doc)."""
    trajs = trajectories(n, args.prompt, args.response, tok)
    fresh = copy.deepcopy(trajs)  # unscored, for the in-process path
    old_actor, new_actor, local = roles["old_actor"], roles["new_actor"], roles["local"]
    old = best_of(args.repeats, lambda: apply_scores(trajs, old_actor.call(RewardWorker.scores, trajs)))
    via_actor = best_of(args.repeats, lambda: score_trajectories(new_actor, trajs))
    in_process = best_of(args.repeats, lambda: score_trajectories(local, fresh))
    if [(t.reward, t.score) for t in fresh] != [(t.reward, t.score) for t in trajs]:
        raise AssertionError("the in-process path scored differently from the actor")
    parts = breakdown(trajs, roles["old_local"], tok, args.repeats)
    known = sum(parts[k] for k in ("pickle", "unpickle", "score", "answer", "apply"))
    return {
        "actor_old": old,
        "actor_new": via_actor,
        "in_process": in_process,
        **parts,
        "ray_rest": max(0.0, old - known),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--sizes", default="512,1024,2048")
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens")
    p.add_argument("--response", type=int, default=110, help="mean response tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--source", default=str(REWARD), help="reward.source (default: bench/scale.py's reward)")
    args = p.parse_args()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = build_tiny_tokenizer()
    folder = Path(tempfile.mkdtemp(prefix="relayrl_reward_phase_"))
    tok.save_pretrained(folder)
    spec = RewardSpec(source=args.source, tokenizer=str(folder))
    roles: dict[str, Any] = {
        "local": LocalRole("reward", RewardWorker(spec)),
        "old_local": OldRewardWorker(spec),
    }
    launcher = build_launcher(DistConfig(mode="ray", num_cpus=2, gpus="no"), {"reward": 1, "old_reward": 1})
    rows: dict[str, dict[str, float]] = {}
    try:
        roles["new_actor"] = launcher.spawn("reward", RewardWorker, spec)
        roles["old_actor"] = launcher.spawn("old_reward", OldRewardWorker, spec)
        for n in [int(x) for x in args.sizes.split(",")]:
            rows[str(n)] = measure(n, args, tok, roles)
            print(n, " ".join(f"{k} {v:.4f}" for k, v in rows[str(n)].items()), flush=True)
    finally:
        launcher.shutdown()
    cols = list(next(iter(rows.values())))
    print("\n| trajectories | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    for n, r in rows.items():
        print(f"| {n} | " + " | ".join(f"{r[c]:.4f}" for c in cols) + " |")
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "source": args.source,
        "prompt_tokens": args.prompt,
        "response_tokens": args.response,
        "seconds": {n: {k: round(v, 4) for k, v in r.items()} for n, r in rows.items()},
    }
    path = out_dir / "reward_phase.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
