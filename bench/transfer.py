"""Driver-to-rank transfer on Ray (CPU, gloo): how many bytes the driver serialises per step, against the
data's own size, for RL (the experience passes and updates) and for SFT (each optimizer step's micro-batches).

    PYTHONPATH=. python bench/transfer.py --ranks 2 --new-tokens 64 [--out results/transfer.json]      # RL
    PYTHONPATH=. python bench/transfer.py --kind sft --ranks 2 [--out results/transfer_sft.json]       # SFT
    PYTHONPATH=. python bench/transfer.py --kind sft-cost --ranks 4     # seconds at GPU sizes, no training

Counts every object the driver's Ray worker serialises (`ray.put` and inlined call arguments, through Ray's
SerializationContext). RL: while `make_experience` and `update` run; the rollout (prompts out, trajectories
back, the reward call) is left out. Each policy rank then reads only its share of the rows (before
relayrl.distributed.launch.rows: the whole of every call's argument). SFT: while each training step's call
runs (`RemoteStep.step`), once with the micro-batches in the object store one per object
(launch.rows.StoredItems, the default) and once with the list passed whole (the code before it, `--sft-list`
or both with `--kind sft-both`); it reports the bytes each rank deserialises (its share's objects, or the
whole list) and checks the two paths' per-step losses are bit-identical. sft-cost: the seconds of serialising
one weak-scaling SFT step's micro-batches (256 samples of 64-1000 tokens) and of a rank reading them, both
ways, through Ray's object store in one process. Builds a tiny model locally; RL 2-4
minutes, SFT ~1 minute per path on the shared 2-core CPU machine.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import tempfile
import time
from contextlib import contextmanager
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import torch

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


def sft_data(path: Path, rows: int, seed: int = 0) -> Path:
    """`rows` jsonl samples of random characters, 40-160 long (a quarter prompt, the rest response)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    with path.open("w") as f:
        for _ in range(rows):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(40, 160)))
            f.write(json.dumps({"input": text[: len(text) // 4], "output": text[len(text) // 4 :]}) + "\n")
    return path


def build_sft_cfg(model: Path, data: Path, out: Path, ranks: int, steps: int = 3):
    """SFT on `ranks` gloo ranks: 16 samples a step in micro-batches of 2, an eval every 2 steps."""
    from relayrl.config.dist import DistConfig
    from relayrl.config.recipes import SFTConfig

    cfg = SFTConfig()
    return replace(
        cfg,
        model=replace(cfg.model, name_or_path=str(model)),
        data=replace(cfg.data, datasets=[str(data)], eval_split_ratio=0.1),
        train=replace(
            cfg.train, batch_size=16, micro_batch_size=2, max_steps=steps, eval_every=2, device="cpu",
            output_dir=str(out),
        ),
        optim=replace(cfg.optim, lr=1e-3),
        ckpt=replace(cfg.ckpt, save_every=0),
        logger=replace(cfg.logger, progress_bar=False),
        dist=DistConfig(mode="ray", num_cpus=2, gpus="no", num_gpus_per_node=ranks, timeout_s=300),
    )  # fmt: skip


def tensor_bytes(records: list[Any]) -> int:
    """Bytes of the tensors in `records` (micro-batches: tensor fields and lists of tensors)."""
    total = 0
    for r in records:
        for f in fields(r):
            x = getattr(r, f.name)
            for t in x if isinstance(x, list) else [x]:
                total += t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
    return total


def measure_sft(cfg, stored: bool = True) -> dict[str, Any]:
    """Run SFT per `cfg` (ray mode); per training step: driver bytes, the micro-batches' tensor bytes, bytes
    and micro-batches each rank deserialises; the per-step train losses. `stored` False: the list is passed
    whole (the code before launch.rows.StoredItems)."""
    from relayrl.distributed.group import shares
    from relayrl.distributed.launch.rows import pack
    from relayrl.trainers import recipe as recipe_mod
    from relayrl.trainers.sft import run_sft

    ranks = cfg.dist.num_gpus_per_node
    steps: list[dict[str, float]] = []
    original_step, original_init = recipe_mod.RemoteStep.step, recipe_mod.RemoteStep.__init__

    def counted_step(self, micro_batches):
        counter = {"bytes": 0, "objects": 0}
        with count_serialised(counter):
            out = original_step(self, micro_batches)
        parts = shares([getattr(m, "num_tokens", 1) for m in micro_batches], ranks)
        if stored:  # each rank deserialises its share's objects (and the small index of refs)
            read = [sum(len(pack(micro_batches[i])) for i in part) for part in parts]
            items = [len(part) for part in parts]
        else:  # every rank deserialises the whole list
            read, items = [counter["bytes"]] * ranks, [len(micro_batches)] * ranks
        steps.append({
            "driver_bytes": float(counter["bytes"]), "driver_objects": float(counter["objects"]),
            "tensor_bytes": float(tensor_bytes(micro_batches)), "micro_batches": float(len(micro_batches)),
            "max_rank_read_bytes": float(max(read)), "max_rank_micro_batches": float(max(items)),
        })  # fmt: skip
        return out

    def init(self, handle, **kwargs) -> None:  # stored=False: the list passed whole (the code before)
        original_init(self, handle, stored=kwargs.get("stored", False) and stored)

    recipe_mod.RemoteStep.step = counted_step  # type: ignore[method-assign]
    recipe_mod.RemoteStep.__init__ = init  # type: ignore[method-assign]
    try:
        result = run_sft(cfg)
    finally:
        recipe_mod.RemoteStep.step = original_step  # type: ignore[method-assign]
        recipe_mod.RemoteStep.__init__ = original_init  # type: ignore[method-assign]
    assert result.exit_code == 0
    last = dict(steps[-1])
    last["driver_bytes_per_tensor_byte"] = last["driver_bytes"] / last["tensor_bytes"]
    last["max_rank_read_bytes_per_tensor_byte"] = last["max_rank_read_bytes"] / last["tensor_bytes"]
    last["train_losses"] = [h["train/loss"] for h in result.history if "train/loss" in h]  # type: ignore[assignment]
    last["eval_losses"] = [h["eval/loss"] for h in result.history if "eval/loss" in h]  # type: ignore[assignment]
    last["ranks"] = float(ranks)
    last["path"] = "stored" if stored else "list"  # type: ignore[assignment]
    return last


def run_sft_paths(ranks: int, paths: list[bool]) -> dict[str, Any]:
    """measure_sft for each of `paths` (True: stored, False: the whole list) on one tiny model and data."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny(Path(tmp) / "model")
        data = sft_data(Path(tmp) / "sft.jsonl", 64)
        for stored in paths:
            name = "stored" if stored else "list"
            out[name] = measure_sft(build_sft_cfg(model, data, Path(tmp) / name, ranks), stored)
    if len(out) == 2:
        out["same_losses"] = (
            out["stored"]["train_losses"] == out["list"]["train_losses"]
            and out["stored"]["eval_losses"] == out["list"]["eval_losses"]
        )
    return out


def sft_cost(samples: int = 256, ranks: int = 4, budget: int = 16384, repeats: int = 5) -> dict[str, Any]:
    """Seconds to serialise one SFT step's micro-batches on the driver and to deserialise them on a rank, at
    GPU sizes (bench/scale.py's weak-scaling SFT step at `ranks` GPUs: `samples` samples of 64-1000 tokens in
    `budget`-token packs), through Ray's object store in this process: the list put whole (before) vs one
    packed object per micro-batch with each rank taking its share (launch.rows.StoredItems)."""
    import ray

    from relayrl.data.batches import SFTBatch
    from relayrl.distributed.group import shares
    from relayrl.distributed.launch.rows import StoredItems

    rng = random.Random(0)
    lengths = [rng.randint(64, 1000) for _ in range(samples)]
    groups: list[list[int]] = [[]]
    for n in lengths:  # greedy packs of <= budget tokens, as packing.MicroBatching does for packed rows
        if groups[-1] and sum(groups[-1]) + n > budget:
            groups.append([])
        groups[-1].append(n)
    mbs = [
        SFTBatch(
            input_ids=[torch.randint(0, 100, (n,)) for n in g],
            targets=[torch.ones(n, dtype=torch.bool) for n in g],
            num_tokens=sum(g),
        )
        for g in groups
    ]
    mine = list(shares([m.num_tokens for m in mbs], ranks)[0])
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        t: dict[str, list[float]] = {k: [] for k in ("put_list", "get_list", "put_items", "take_share")}
        for _ in range(repeats):
            t0 = time.perf_counter()
            ref = ray.put(mbs)
            t1 = time.perf_counter()
            ray.get(ref)
            t2 = time.perf_counter()
            items = StoredItems(mbs)
            t3 = time.perf_counter()
            pickle.loads(pickle.dumps(items)).take(mine)  # a rank's copy: its refs fetched on first use
            t4 = time.perf_counter()
            for k, v in zip(t, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                t[k].append(v)
    finally:
        if started:
            ray.shutdown()
    out: dict[str, Any] = {k: round(min(v), 4) for k, v in t.items()}
    out.update(
        samples=samples, tokens=sum(lengths), micro_batches=len(mbs), ranks=ranks, rank0_items=len(mine)
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kind", default="rl", choices=["rl", "sft", "sft-both", "sft-cost"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--sft-list", action="store_true", help="sft: pass the list whole (the code before)")
    p.add_argument("--out", default="")
    a = p.parse_args()
    if a.kind == "sft-cost":
        row: dict[str, Any] = sft_cost(ranks=a.ranks)
    elif a.kind.startswith("sft"):
        row = run_sft_paths(a.ranks, [True, False] if a.kind == "sft-both" else [not a.sft_list])
    else:
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
