"""The bucketed gather of a sharded model (relayrl.distributed.fsdp.full_tensors) on 2 and 3 real gloo CPU
ranks (torch.multiprocessing): it yields exactly the (name, tensor) sequence of the per-parameter path
(bucket_bytes=0), bit for bit, and equal to the unsharded weights (cast), in fp32 and cast to bf16, with
`names` filtering, for a tied tiny Qwen2 with uneven shards (101 / 34 / 17 / 50 rows), a tiny Qwen3-MoE (3-D
expert tensors; 2 experts over 3 ranks: one rank holds none) and a model mixing sharded and plain
parameters; small buckets make several collectives and a parameter bigger than a bucket goes alone; the
collectives drop from one per sharded parameter to one per bucket. One spawn per world size (~10 s each on
2 cores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import bucket_gather_ranks as ranks
import pytest
import torch
from rank_spawn import spawn_ranks

BF16 = torch.bfloat16
NAMES = {
    "model.norm.weight",
    "model.embed_tokens.weight",
    "model.layers.1.mlp.experts.down_proj",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.q_proj.bias",
}
CASES: list[dict[str, Any]] = [
    {"kind": "qwen2", "dtype": None, "names": None, "bucket": 4096},
    {"kind": "qwen2", "dtype": BF16, "names": None, "bucket": 4096},
    {"kind": "qwen2", "dtype": BF16, "names": NAMES, "bucket": 2048},
    {"kind": "qwen2", "dtype": None, "names": None, "bucket": 2**30},  # everything in one bucket
    {"kind": "moe", "dtype": None, "names": None, "bucket": 8192},
    {"kind": "moe", "dtype": BF16, "names": NAMES, "bucket": 8192},
    {"kind": "mixed", "dtype": None, "names": None, "bucket": 2**30},
    {"kind": "mixed", "dtype": BF16, "names": None, "bucket": 64},  # every parameter bigger than a bucket
    {"kind": "qwen2", "dtype": BF16, "names": None, "bucket": None},  # the default: per parameter on gloo
]


def _padded_bytes(shape: tuple[int, ...], world: int, itemsize: int) -> int:
    """Bytes a parameter takes in a gather: every rank's piece padded to ceil(rows / world) rows."""
    rows = -(-shape[0] // world)
    return rows * world * int(torch.tensor(shape[1:]).prod()) * itemsize


@pytest.mark.parametrize("world", [2, 3])
def test_bucketed_gather_equals_the_per_parameter_one(world, tmp_path: Path):
    spawn_ranks(ranks.rank_main, (world, str(tmp_path / "store"), str(tmp_path), CASES), nprocs=world)
    for r in range(world):
        for case, got in zip(CASES, torch.load(tmp_path / f"rank{r}.pt", weights_only=False), strict=True):
            ref, new, plain, shapes = got["ref"], got["new"], got["plain"], got["shapes"]
            want = [n for n in plain if case["names"] is None or n in case["names"]]
            assert [n for n, _ in ref["items"]] == [n for n, _ in new["items"]] == want, case
            assert want, case
            for (name, a), (_, b) in zip(ref["items"], new["items"], strict=True):
                dtype = case["dtype"] or torch.float32
                assert a.dtype == b.dtype == dtype and a.shape == b.shape == plain[name].shape, (case, name)
                assert torch.equal(a, b), (case, name)  # bit for bit (no NaN in these weights)
                assert torch.equal(b, plain[name].to(dtype)), (case, name)
            # collectives: one per sharded parameter before, one per bucket now, each parameter gathered once
            sharded = [n for n in want if shapes[n][1]]
            itemsize = 2 if case["dtype"] is BF16 else 4
            sizes = [_padded_bytes(shapes[n][0], world, itemsize) for n in sharded]
            assert ref["full_tensor"] == len(sharded) and not ref["gathers"], case
            if case["bucket"] is None:  # a CPU (gloo) mesh's default is the per-parameter path (fsdp.py)
                assert new["full_tensor"] == len(sharded) and not new["gathers"], case
                continue
            assert new["full_tensor"] == 0 and sum(new["gathers"]) == sum(sizes), case
            bucket = case["bucket"]
            big = [s for s in sizes if s > bucket]
            assert all(g <= bucket or g in big for g in new["gathers"]), (case, new["gathers"])
            assert sorted(g for g in new["gathers"] if g > bucket) == sorted(big), case  # each alone
            if bucket == 2**30:
                assert len(new["gathers"]) == 1, case
            elif bucket == 64:
                assert len(new["gathers"]) == len(sharded), case  # nothing fits with its neighbour
            else:
                assert 2 <= len(new["gathers"]) < len(sharded), (case, new["gathers"], len(sharded))
