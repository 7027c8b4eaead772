"""GPU failures name themselves, checked on a CPU (relayrl/distributed/launch/oom.py, watchdog.py):

- a torch.OutOfMemoryError raised in a role's method becomes ONE line naming the role, rank, phase (generation,
  log-probs, update, refresh), the memory figures ("no CUDA device" here) and the settings that lower it;
- a call that makes no progress for dist.stall_timeout_s writes every thread's Python stack to the stacks
  folder and reports the stuck role / rank / phase (local mode: the process exits 1, checked in a subprocess);
- dist.stall_timeout_s is validated (>= 0, finite).

The same on a real Ray cluster (an OOM on a rank, a stalled rank, an engine actor killed mid-call) is in
test_gpu_failures_ray.py (slow).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relayrl.config.base import ConfigError
from relayrl.config.dist import DistConfig
from relayrl.distributed.launch import build_launcher
from relayrl.distributed.launch.local import LocalLauncher
from relayrl.distributed.launch.oom import OutOfMemory

ROOT = Path(__file__).resolve().parents[2]

TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.2 GiB "
    "is free.\nOf the allocated memory 70.1 GiB is allocated by PyTorch, and 3.2 GiB is reserved but unallocated."
)
"""torch's own message (two lines, as CUDA's caching allocator writes it)."""


class Greedy:
    """A worker whose every method runs out of memory, or sleeps."""

    def rollout(self) -> None:
        raise torch.OutOfMemoryError(TORCH_OOM)

    def logprobs(self) -> None:
        raise torch.OutOfMemoryError(TORCH_OOM)

    def update(self) -> None:
        raise torch.OutOfMemoryError(TORCH_OOM)

    def sync(self) -> None:
        raise torch.OutOfMemoryError(TORCH_OOM)

    def slow_update(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"


@pytest.mark.parametrize(
    ("method", "phase", "setting"),
    [
        (Greedy.rollout, "generation", "rollout.vllm_gpu_util"),
        (Greedy.logprobs, "log-probs", "algo.micro_batch_tokens"),
        (Greedy.update, "update", "model.gradient_checkpointing true"),
        (Greedy.sync, "refresh", "dist.engine_sleep yes"),
    ],
)
def test_out_of_memory_is_one_line_naming_role_rank_phase_memory_and_settings(method, phase, setting):
    role = LocalLauncher().spawn("policy", Greedy)
    with pytest.raises(OutOfMemory) as err:
        role.call(method)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"policy rank 0 ran out of GPU memory in {phase} (Greedy.{method.__name__}): "), msg
    assert "tried to allocate 2.00 GiB" in msg, msg
    assert "no CUDA device in this process" in msg, msg  # the figures there are on a GPU
    assert setting in msg, msg
    # more samples, more memory (not for a weight refresh)
    assert ("rollout.n_samples" in msg) == (phase != "refresh"), msg
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)  # the original, with its traceback


def test_a_stalled_local_call_dumps_its_stack_and_names_role_rank_and_phase(tmp_path):
    launcher = build_launcher(DistConfig(stall_timeout_s=1.0), {"policy": 1}, tmp_path)
    assert isinstance(launcher, LocalLauncher)
    reports: list[str] = []
    launcher.watch.on_stall = reports.append  # instead of exiting this process
    role = launcher.spawn("policy", Greedy)
    try:
        assert role.call(Greedy.slow_update, 0.1) == "done"  # a quick call: nothing
        assert reports == []
        assert role.call(Greedy.slow_update, 3.5) == "done"  # the watchdog checks every 0.25 s
    finally:
        launcher.shutdown()
    assert len(reports) == 1, reports
    stack = tmp_path / "stacks" / "policy_rank0.txt"
    assert reports[0].startswith("policy rank 0 on host"), reports[0]
    assert "no progress in slow_update (slow_update) for " in reports[0] and str(stack) in reports[0]
    text = stack.read_text()
    assert text.startswith("policy rank 0 on host") and "dist.stall_timeout_s 1" in text.splitlines()[0]
    assert "in slow_update" in text and "test_gpu_failures.py" in text, text  # the stuck frame, by name


def test_watchdog_off_and_calls_over_a_dataset_are_not_watched(tmp_path):
    launcher = LocalLauncher(0.0, tmp_path)  # 0 = off
    reports: list[str] = []
    launcher.watch.on_stall = reports.append
    launcher.spawn("policy", Greedy).call(Greedy.slow_update, 0.3)
    assert launcher.watch._thread is None and reports == []


@pytest.mark.slow
def test_a_stalled_local_run_exits_1_naming_the_stuck_rank(tmp_path):
    script = f"""
import time
from pathlib import Path
from relayrl.distributed.launch.local import LocalLauncher
class W:
    def update(self):
        time.sleep(60)
LocalLauncher(1.0, Path({str(tmp_path)!r})).spawn("critic", W).call(W.update)
"""
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 1, out
    assert time.monotonic() - t0 < 45  # not the 60 s sleep
    assert "relayrl: error: critic rank 0 on host" in out.stderr and "no progress in update" in out.stderr
    assert "in update" in (tmp_path / "critic_rank0.txt").read_text()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_stall_timeout_is_validated(bad):
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        DistConfig(stall_timeout_s=bad)


class Hog:
    def update(self) -> None:
        torch.empty(2**50, dtype=torch.uint8, device="cuda")  # 1 PiB: more than any GPU holds


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_oom_is_one_line_with_the_devices_memory_figures():
    with pytest.raises(OutOfMemory) as err:
        LocalLauncher().spawn("policy", Hog).call(Hog.update)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert msg.startswith("policy rank 0 ran out of GPU memory in update (Hog.update): tried to allocate "), (
        msg
    )
    assert "cuda:0 allocated " in msg and " reserved " in msg and " peak " in msg and " free " in msg, msg
