"""The colocated engine's refresh from a sharded policy (relayrl.distributed.weights.local.LocalWeights, gather)
on 2 real gloo CPU ranks: after an optimizer step, the bucketed gather (what a CUDA mesh uses:
`fsdp.full_tensors`) and the per-FSDP-unit gather (`fsdp.unit_tensors`, a CPU's default) leave every rank's
engine replica holding exactly the trained fp32 weights cast to the engine dtype, bit for bit the same in fp32
and bf16 (the weight canary reads 0), with one all-gather per bucket (small buckets: several; a big one: a
single collective instead of one per FSDP unit); with LoRA only the adapters train and are refreshed, the frozen
base staying as copied. One spawn (~3-6 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest
import refresh_ranks as ranks
import torch
from rank_spawn import spawn_ranks

pytestmark = pytest.mark.slow  # two spawned gloo ranks


def test_bucketed_refresh_holds_exactly_the_trained_weights(tmp_path: Path):
    world = 2
    spawn_ranks(ranks.rank_main, (world, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for case in ("full", "lora"):
        master = got[0][case]["master"]
        assert all(torch.equal(master[n], got[1][case]["master"][n]) for n in master)  # gathered alike
        initial = dict(ranks.build(case == "lora").named_parameters())
        trained = set(got[0][case]["trained"])
        moved = {n for n, p in initial.items() if not torch.equal(p.detach(), master[n])}
        assert moved == trained and trained, case  # the step moved what trains: a stale replica would show
        if case == "lora":
            assert all("lora_" in n for n in trained) and len(trained) < len(master)
        for r, res in enumerate(x[case] for x in got):
            for (kind, dtype), engine in res["engine"].items():
                want = torch.float32 if dtype == str(torch.float32) else torch.bfloat16
                assert list(engine) == list(master), (case, r, kind)
                for name, t in engine.items():
                    assert t.dtype == want, (case, r, kind, dtype, name)
                    assert torch.equal(t, master[name].to(want)), (case, r, kind, dtype, name)
                assert res["canary"][(kind, dtype)] == 0.0, (case, r, kind, dtype)
            for dtype in (str(torch.float32), str(torch.bfloat16)):
                assert res["gathers"][("unit", dtype)] == 0  # FSDP's own unshard, one per unit
                assert res["gathers"][("default", dtype)] == 0  # a CPU (gloo) mesh: per unit
                assert res["gathers"][("buckets", dtype)] >= 2, res["gathers"]  # 4 KiB buckets: several
                assert res["gathers"][("one_bucket", dtype)] == 1 < res["units"]  # one, not one per unit
