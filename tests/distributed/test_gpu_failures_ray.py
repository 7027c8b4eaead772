"""GPU failures name themselves on a REAL local Ray cluster (2 CPUs, gloo; relayrl/distributed/launch):

- an out-of-memory error on a rank reaches the controller as one line naming role, rank, host and phase;
- a stalled call (both ranks sleep past dist.stall_timeout_s = 1 s): every rank writes its stacks to the stacks
  folder, the controller raises Stalled naming both ranks within the timeout + 2 s grace, a later call of the
  role fails at once (its actors are stuck), and shutdown returns promptly;
- an engine actor killed in the middle of a rollout: an error naming the engine rank and "died", never a hang.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from relayrl.config.dist import DistConfig
from relayrl.distributed.group import merged, rank
from relayrl.distributed.launch.base import RoleError
from relayrl.distributed.launch.failures import Stalled
from relayrl.distributed.launch.ray import RayLauncher

pytestmark = pytest.mark.slow  # Ray actors

ROOT = Path(__file__).resolve().parents[2]


class Faulty:
    """A model-free worker that fails as a GPU rank does."""

    @merged("concat")
    def ping(self) -> list[int]:
        return [rank()]

    def update(self) -> None:
        if rank() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB.\nsecond line")

    def logprobs(self, seconds: float) -> None:
        time.sleep(seconds)

    def rollout(self, seconds: float) -> int:
        time.sleep(seconds)
        return os.getpid()


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    assert not ray.is_initialized(), "an earlier test left Ray running"
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _launcher(roles: dict[str, int], stacks: Path | None = None, stall_s: float = 0.0) -> RayLauncher:
    cfg = DistConfig(
        mode="ray", num_cpus=2, gpus="no", policy_num_gpus_per_node=2, timeout_s=20, stall_timeout_s=stall_s
    )
    return RayLauncher(cfg, roles, stacks)


@pytest.mark.timeout(120)
def test_an_oom_is_one_line_and_a_stall_dumps_every_ranks_stack_naming_the_stuck_ranks(ray_cluster, tmp_path):
    """One role for both (starting actors is the slow part): the OOM first (the role stays usable), then the
    stall (its actors stay stuck until shutdown)."""
    launcher = _launcher({"policy": 2}, tmp_path, stall_s=1.0)
    try:
        role = launcher.spawn("policy", Faulty)
        with pytest.raises(RoleError) as oom:
            role.call(Faulty.update)
        assert role.call(Faulty.ping) == [0, 1]  # the role stays usable
        role.call(Faulty.logprobs, 0.1)  # a quick call: no stall
        t0 = time.monotonic()
        with pytest.raises(Stalled) as err:
            role.call(Faulty.logprobs, 600)
        elapsed = time.monotonic() - t0
        with pytest.raises(RoleError, match="not called, the role is stuck in an earlier call"):
            role.call(Faulty.ping)  # would queue behind the stuck call
        stacks = [tmp_path / f"policy_rank{r}.txt" for r in (0, 1)]
        deadline = time.monotonic() + 20  # written ~1 s into the call; slack for a loaded machine
        while not all(p.is_file() and "in logprobs" in p.read_text() for p in stacks):
            assert time.monotonic() < deadline, [p.is_file() for p in stacks]
            time.sleep(0.2)
    finally:
        t0 = time.monotonic()
        launcher.shutdown()
        shutdown_s = time.monotonic() - t0
    msg = str(oom.value)
    assert "\n" not in msg, msg
    assert msg.startswith("policy rank 1/2 on host"), msg
    assert "OutOfMemory: policy rank 1 ran out of GPU memory in update (Faulty.update)" in msg, msg
    assert "tried to allocate 512.00 MiB" in msg and "algo.micro_batch_tokens" in msg, msg

    msg = str(err.value)
    assert msg.startswith("policy rank 0/2 on host") and "policy rank 1/2 on host" in msg, msg
    assert "made no progress in log-probs (policy.logprobs) for 1 s" in msg, msg
    assert elapsed < 1.0 + 2.0 + 10.0, elapsed  # timeout + grace (3 s), plus slack for a loaded machine
    assert shutdown_s < 15, shutdown_s
    for r in (0, 1):
        text = (tmp_path / f"policy_rank{r}.txt").read_text()
        assert text.startswith(f"policy rank {r} on host") and "in logprobs" in text, text


@pytest.mark.timeout(90)
def test_an_engine_actor_killed_mid_rollout_is_named_not_a_hang(ray_cluster):
    import ray

    launcher = _launcher({"engine": 1})
    try:
        engine = launcher.spawn("engine", Faulty)
        job = engine.submit(Faulty.rollout, 600)
        threading.Timer(1.0, lambda: ray.kill(engine.actors[0])).start()  # dies in the middle of the call
        t0 = time.monotonic()
        with pytest.raises(RoleError) as err:
            job.result()
        elapsed = time.monotonic() - t0
    finally:
        launcher.shutdown()
    msg = str(err.value)
    assert msg.startswith("engine rank 0/1 on host") and "failed in rollout" in msg and "died" in msg, msg
    assert elapsed < 30, elapsed
