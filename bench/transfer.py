"""Driver-to-rank transfer of one RL step on Ray (CPU, gloo): how many bytes the driver serialises for the
experience passes (old / reference log-probs, values) and the updates, against the experience's own size.

    PYTHONPATH=. python bench/transfer.py --ranks 2 --new-tokens 64 [--out results/transfer.json]

Counts every object the driver's Ray worker serialises (`ray.put` and inlined call arguments, through Ray's
SerializationContext) while `make_experience` and `update` run; the rollout (prompts out, trajectories back,
the reward call) is left out. Each policy rank then reads only its share of the rows (before
relayrl.distributed.launch.rows: the whole of every call's argument). Builds a tiny model locally; 2-4 minutes
on the shared 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import contextmanager
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.config.presets import tiny_cpu_config
from relayrl.models.tiny import save_tiny
from relayrl.trainers.rl.loop import RLTrainer

REWARD = Path(__file__).parents[1] / "tests" / "trainers" / "data" / "digit_reward.py"


@contextmanager
def count_serialised(counter: dict[str, int]):
    """Add the bytes of everything Ray serialises in this process to counter["bytes"]."""
    from ray._private.serialization import SerializationContext

    original = SerializationContext.serialize

    def serialize(self, value):
        out = original(self, value)
        counter["bytes"] += int(out.total_bytes)
        counter["objects"] += 1
        return out

    SerializationContext.serialize = serialize  # type: ignore[method-assign]
    try:
        yield counter
    finally:
        SerializationContext.serialize = original  # type: ignore[method-assign]


def nbytes(record: Any) -> int:
    """Tensor bytes of a record (nested records included)."""
    total = 0
    for f in fields(record):
        x = getattr(record, f.name)
        if is_dataclass(x):
            total += nbytes(x)
        elif x is not None:
            total += x.numel() * x.element_size()
    return total


def build_cfg(model: Path, out: Path, ranks: int, new_tokens: int):
    cfg = tiny_cpu_config(str(model), str(out), steps=2, reward=str(REWARD))
    return replace(
        cfg,
        algo=replace(cfg.algo, advantage="gae", kl_mode="loss", kl_coef=0.1, mini_batches=2),
        rollout=replace(cfg.rollout, max_new_tokens=new_tokens, max_len=new_tokens + 32),
        dist=replace(cfg.dist, mode="ray", num_cpus=2, policy_num_gpus_per_node=ranks, timeout_s=300),
    )


def measure(cfg) -> dict[str, float]:
    """Run cfg's steps; per step: driver bytes for make_experience + update, the experience's bytes."""
    trainer = RLTrainer(cfg, banner=False)
    steps: list[dict[str, float]] = []
    make, update = trainer.make_experience, trainer.update
    counter = {"bytes": 0, "objects": 0}

    def counted_make(trajs):
        with count_serialised(counter):
            exp, m = make(trajs)
        steps.append({"experience_bytes": float(nbytes(exp)), "rows": float(len(exp.rewards))})
        return exp, m

    def counted_update(exp, kl):
        with count_serialised(counter):
            out = update(exp, kl)
        steps[-1]["driver_bytes"] = float(counter["bytes"])
        steps[-1]["driver_objects"] = float(counter["objects"])
        counter.update(bytes=0, objects=0)
        return out

    trainer.make_experience = counted_make  # type: ignore[method-assign]
    trainer.update = counted_update  # type: ignore[method-assign]
    result = trainer.fit()
    assert result.exit_code == 0, result.message
    last = steps[-1]
    last["driver_bytes_per_experience_byte"] = last["driver_bytes"] / last["experience_bytes"]
    return last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default="")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny(Path(tmp) / "model")
        row = measure(build_cfg(model, Path(tmp) / "run", a.ranks, a.new_tokens))
    row["policy_ranks"] = a.ranks
    print(json.dumps(row, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
