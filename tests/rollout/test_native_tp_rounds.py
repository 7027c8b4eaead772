"""What a tensor-parallel native engine does per round outside its decode graphs (relayrl/rollout/native_tp.py,
"Round messages"), counted over a real gloo group of 2 processes by bench/tp_phases.RoundCounter (which wraps
torch.distributed's collectives, the host reads of tensors and the engine's phases).

The design allows, per rank: ONE broadcast of a fixed header a round over the group's CPU backend, a second
one only in a round that carries requests or cancellations, and one at release (the stop); no other collective
outside the decode steps and prefills (finished slots, stop tokens, batch size and kv bucket are never agreed
at run time: they follow from the identical tokens); and no more host reads of engine tensors than a one-GPU
engine makes on the same workload (its retire's, one a round plus the finished rows'). Before, every round
was a `broadcast_object_list` (two broadcasts; on GPUs two NCCL launches and, on each follower, two device
syncs). A request cancelled mid-way reaches every rank through that message (the leader collects cancelled
ids from its callers' futures' callbacks instead of scanning every request a round)."""

from __future__ import annotations

import pytest
import torch
import tp_workers
from rank_spawn import spawn_ranks

from relayrl.rollout import native_tp
from relayrl.rollout.base import generate_all
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.native_tp import control_device


def test_round_messages_take_the_groups_cpu_backend_where_it_has_one(monkeypatch):
    cuda = torch.device("cuda", 0)
    for config, control, want in (
        ("cpu:gloo,cuda:nccl", "auto", "cpu"),  # distributed/group.py's groups
        ("cuda:nccl", "auto", "cuda"),  # an NCCL-only group: through the device, as before
        ("cpu:gloo,cuda:nccl", "device", "cuda"),
        ("cpu:gloo,cuda:gloo", "cpu", "cpu"),
    ):
        monkeypatch.setattr(native_tp.dist, "get_backend_config", lambda group, c=config: c)
        assert control_device(None, cuda, control).type == want, (config, control)
    monkeypatch.setattr(native_tp.dist, "get_backend_config", lambda group: "cuda:nccl")
    assert control_device(None, torch.device("cpu")).type == "cpu"  # a CPU engine
    with pytest.raises(ValueError, match="has no CPU backend"):
        control_device(None, cuda, "cpu")
    with pytest.raises(ValueError, match="control='gpu'"):
        control_device(None, cuda, "gpu")


@pytest.mark.slow
def test_a_tp2_round_costs_one_cpu_broadcast_and_no_extra_host_reads(tmp_path):
    one = NativeEngine(tp_workers.tiny_model(), **tp_workers.COUNT_ENGINE)
    try:
        base = tp_workers.count_rounds(
            one, lambda: tp_workers.outputs(generate_all(one, tp_workers.count_requests()))
        )
    finally:
        one.close()
    out = str(tmp_path / "out")
    spawn_ranks(tp_workers.count_worker, (2, str(tmp_path / "store"), out), nprocs=2)
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    tokens = [[tok for tok, _ in req] for req in base["outputs"]]
    assert [[tok for tok, _ in req] for req in ranks[0]["outputs"]] == tokens  # lock step kept the samples
    layers = tp_workers.SPEC.layers
    for rep in ranks:
        assert (rep["rounds"], rep["steps"]) == (base["rounds"], base["steps"]) and base["rounds"] >= 4
        # one header a round, one payload (the round that admitted the requests), one stop at release
        assert rep["collectives_outside_graph"] == {"broadcast@cpu": base["rounds"] + 2}, rep["collectives"]
        assert rep["collectives"]["control"] == {"broadcast@cpu": base["rounds"] + 2}
        assert rep["control_device"] == "cpu" and rep["control_messages"] == base["rounds"] + 2
        # inside a step (a CUDA graph on GPUs): o_proj + down_proj a layer and the sampler's two reductions
        assert rep["collectives"]["step"] == {"all_reduce@cpu": base["steps"] * (2 * layers + 2)}
        for phase in ("step", "admit", "retire", "round", "outside"):  # control reads are of CPU tensors
            assert rep["cpu_reads"][phase] == base["cpu_reads"][phase], (phase, rep["cpu_reads"], base)
        assert sum(rep["syncs"].values()) == 0  # (no CUDA tensor on a CPU run)
    # the longest request cancelled mid-way: the followers drop it in the same round (out of step they would
    # deadlock), the others sample what they sampled uncancelled (per-sample seeds), and the round ends earlier
    lead, follow = ranks[0]["cancel"], ranks[1]["cancel"]
    assert lead["steps"] == follow["steps"] and lead["messages"] == follow["messages"]
    assert (
        lead["steps"] < base["steps"]
    )  # the longest sample no longer runs: the cancellation reached every rank
    got = lead["outputs"]
    assert got[-1] is None and [[tok for tok, _ in g] for g in got[:-1]] == tokens[:-1]
    assert (
        lead["left"] == follow["left"] == (0, 0, tp_workers.COUNT_ENGINE["max_slots"])
    )  # all forgotten, freed
