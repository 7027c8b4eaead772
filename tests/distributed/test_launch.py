"""The launcher seam in local mode: roles called by method reference, Protocol methods dispatched by name, and
the mode table (relayrl/distributed/launch/). Ray mode is covered by test_fsdp_ray.py."""

from __future__ import annotations

from typing import Protocol

import pytest

from relayrl.config.dist import DistConfig
from relayrl.distributed.group import merged
from relayrl.distributed.launch import LAUNCHERS, build_launcher
from relayrl.distributed.launch.local import LocalLauncher, LocalRole
from relayrl.distributed.launch.placement import plan_pools, rank_gpus


class Counter:
    def __init__(self, start: int, *, step: int = 1) -> None:
        self.value, self.step = start, step

    def add(self, n: int) -> int:
        self.value += n * self.step
        return self.value

    @merged("concat")
    def pieces(self) -> list[int]:
        return [self.value]


class Adds(Protocol):
    def add(self, n: int) -> int: ...


def test_local_role_calls_and_submits_by_method_reference():
    launcher = LocalLauncher()
    role = launcher.spawn("policy", Counter, 10, step=2)
    assert isinstance(role, LocalRole) and role.instance.value == 10 and role.world == 1
    assert role.call(Counter.add, 1) == 12
    job = role.submit(Counter.add, 3)  # local mode runs it at submit ...
    assert role.instance.value == 18
    assert job.result() == 18  # ... and hands the result back
    assert role.call(Counter.pieces) == [18]


def test_a_protocol_method_runs_the_workers_own_method():
    role = LocalLauncher().spawn("policy", Counter, 0, step=5)
    via_protocol: LocalRole[Adds] = role  # a handle over a worker is a handle over a Protocol it satisfies
    assert via_protocol.call(Adds.add, 2) == 10 and role.instance.value == 10


def test_build_launcher_names_the_modes_on_a_bad_one():
    assert isinstance(build_launcher(DistConfig(), {"policy": 1}), LocalLauncher)
    assert sorted(LAUNCHERS) == ["local", "ray"]
    bad = DistConfig()
    bad.mode = "slurm"  # type: ignore[assignment]  # past the config's own check
    with pytest.raises(ValueError, match=r"unknown execution mode 'slurm'; choose one of \['local', 'ray'\]"):
        build_launcher(bad, {"policy": 1})


def test_placement_colocates_and_checks_sizes():
    cfg = DistConfig(mode="ray", colocate_policy_ref=True)
    where = plan_pools(cfg, {"policy": 2, "reference": 2, "reward": 1})
    assert where == {"policy": "policy", "reference": "policy", "reward": "reward"}
    with pytest.raises(ValueError, match="reference is colocated with policy but has 1 ranks against 2"):
        plan_pools(cfg, {"policy": 2, "reference": 1})
    assert (
        rank_gpus(DistConfig(engine_tp=2), "engine") == 2
        and rank_gpus(DistConfig(engine_tp=2), "policy") == 1
    )
