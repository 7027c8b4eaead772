"""The multi-node path on one host: a Ray cluster of two nodes started with `ray start` (head + worker, one CPU
each), joined by `relayrl rl --dist.ray_address`: the run places its roles on both nodes, finishes, and leaves
the cluster it did not start running (docs/distributed.md has the recipe for real nodes)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts a Ray cluster with `ray start`

DATA = Path(__file__).parents[1] / "trainers" / "data"
RAY = str(Path(sys.executable).parent / "ray")


def _ray(env: dict, *args: str) -> str:
    out = subprocess.run([RAY, *args], capture_output=True, text=True, timeout=120, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"ray {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return out.stdout + out.stderr


DRIVER = """
import json, sys
from dataclasses import replace
from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer
model, out, reward, address = sys.argv[1:]
cfg = tiny_cpu_config(model, out, steps=1, reward=reward)
cfg = replace(cfg, dist=replace(cfg.dist, mode="ray", ray_address=address, policy_num_gpus_per_node=2, timeout_s=120))
trainer = RLTrainer(cfg)
nodes = sorted(set(trainer.roles.policy.nodes))  # the reward (a reward_func file) runs in this process
result = trainer.fit()
import ray
alive = len([n for n in ray.nodes() if n["Alive"]])
print("RESULT " + json.dumps({"exit": result.exit_code, "message": result.message, "nodes": nodes,
                              "still_connected": ray.is_initialized(), "alive": alive}))
"""


@pytest.fixture
def two_nodes():
    """A head and a worker node started with `ray start` (token auth as Ray's default; the driver below is its
    own process, as a user's would be); stopped afterwards."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if shutil.which(RAY) is None:
        pytest.skip("the ray CLI is not installed")
    env = {**os.environ, "RAY_AUTH_MODE": "token"}  # head, worker and driver share the token in ~/.ray
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    ip = ray.util.get_node_ip_address()
    _ray(
        env,
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=1",
        "--include-dashboard=false",
        "--disable-usage-stats",
    )
    try:
        _ray(env, "start", f"--address={ip}:{port}", "--num-cpus=1", "--disable-usage-stats")
        yield f"{ip}:{port}", env
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120, env=env)


@pytest.mark.timeout(300)
def test_rl_on_a_two_node_cluster_started_with_ray_start(two_nodes, tiny_model_path, tmp_path):
    address, env = two_nodes
    run = tmp_path / "run"
    args = [
        sys.executable,
        "-c",
        DRIVER,
        str(tiny_model_path),
        str(run),
        str(DATA / "digit_reward.py"),
        address,
    ]
    out = subprocess.run(
        args, capture_output=True, text=True, timeout=280, env=env, cwd=Path(__file__).parents[2]
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stdout[-3000:] + out.stderr[-3000:]
    got = json.loads(line[len("RESULT ") :])
    assert got["exit"] == 0, got["message"]
    assert len(got["nodes"]) == 2, got  # two policy ranks of one CPU each: one per node
    assert got["still_connected"] and got["alive"] == 2  # a cluster we joined is left running
    assert (run / "final/model.safetensors").is_file()
