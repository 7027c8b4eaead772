"""The colocated engine's refresh from a sharded policy (relayrl.distributed.weights.local.LocalWeights, gather)
on 2 real gloo CPU ranks: after an optimizer step, the bucketed gather (what a CUDA mesh uses:
`fsdp.full_tensors`) and the per-FSDP-unit gather (`fsdp.unit_tensors`, a CPU's default) leave every rank's
engine replica holding exactly the trained fp32 weights cast to the engine dtype, bit for bit the same in fp32
and bf16 (the weight canary reads 0), with one all-gather per bucket (small buckets: several; a big one: a
single collective instead of one per FSDP unit). One spawn (~10 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
import refresh_ranks as ranks
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow  # two spawned gloo ranks


def test_bucketed_refresh_holds_exactly_the_trained_weights(tmp_path: Path):
    world = 2
    mp.spawn(ranks.rank_main, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    master = got[0]["master"]
    assert all(torch.equal(master[n], got[1]["master"][n]) for n in master)  # one model, gathered alike
    initial = ranks.build_tiny_model(
        ranks.build_tiny_tokenizer(),
        ranks.TinyModelSpec(hidden=36, layers=2, heads=2, kv_heads=1, intermediate=50),
    )
    moved = [n for n, p in initial.named_parameters() if not torch.equal(p.detach(), master[n])]
    assert len(moved) == len(master)  # the step changed every parameter: a stale replica would show
    for r, res in enumerate(got):
        for (kind, dtype), engine in res["engine"].items():
            want = torch.float32 if dtype == str(torch.float32) else torch.bfloat16
            assert list(engine) == list(master), (r, kind)
            for name, t in engine.items():
                assert t.dtype == want and torch.equal(t, master[name].to(want)), (r, kind, dtype, name)
            assert res["canary"][(kind, dtype)] == 0.0, (r, kind, dtype)
        units = res["units"]
        for dtype in (str(torch.float32), str(torch.bfloat16)):
            assert res["gathers"][("unit", dtype)] == 0  # FSDP's own unshard, one per unit
            assert res["gathers"][("default", dtype)] == 0  # a CPU (gloo) mesh: per unit
            assert res["gathers"][("buckets", dtype)] >= 2, res["gathers"]  # 4 KiB buckets: several
            assert res["gathers"][("one_bucket", dtype)] == 1 < units  # one collective, not one per unit
