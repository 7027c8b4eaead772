"""A Ray cluster over the nodes of a SLURM allocation, one command run on it, everything stopped at the end.

Inside `sbatch` / `salloc` (see relayrl.sbatch beside this file):

    python examples/slurm/launch.py -- relayrl rl --config run.yaml --dist.mode ray \\
        --dist.ray_address {address} --dist.policy_num_nodes 2 --dist.policy_num_gpus_per_node 8 \\
        --train.output_dir /shared/runs/grpo

1. The nodes come from SLURM_JOB_NODELIST (`node[01-03,07]` is expanded here, without scontrol).
2. The first node runs the Ray head (`ray start --head --block`), the others a Ray worker each, every one
   started by `srun --nodes 1 --ntasks 1 -w NODE` (so SLURM tracks and cleans them up).
3. It waits until every node has joined (bounded by --join-timeout), then runs the command on this node with
   `{address}` replaced by HEAD_IP:PORT (and RELAYRL_RAY_ADDRESS set to it).
4. On exit (the command's end, an error, Ctrl-C or SIGTERM from scancel) the Ray processes are stopped; the
   exit code is the command's.

Requirements:
- A filesystem every node sees for the model, the data and `--train.output_dir` (checkpoint shards are written
  by the ranks of every node) and the same Python environment (path) on every node.
- Token authentication (`RAY_AUTH_MODE=token`, set here unless the environment sets it): the head writes
  its token to ~/.ray/auth_token; the workers and the driver must read the same token, so either the home
  directory is shared, or pass `--token-file /shared/path/token` (exported as RAY_AUTH_TOKEN_PATH to every
  process; create it once, e.g. by copying the head's token).
- The head's port (--port, default 6379) and Ray's worker ports reachable between the nodes.

`--dry-run` prints the nodes and the commands without running anything. `--local N` (tests, no SLURM) starts
N Ray nodes on this host instead (no srun), each on its own ports. Standard library only (the `ray` CLI must
be on PATH or beside this Python).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def expand_nodelist(text: str) -> list[str]:
    """SLURM's compressed host list -> host names, in order: "node[01-03,07],gpu5" -> node01 node02 node03
    node07 gpu5 (zero padding kept; several bracket groups in one name are expanded left to right)."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            hosts.extend(_expand_one(item))
    return hosts


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"nodelist {text!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise ValueError(f"nodelist {text!r}: unbalanced '['")
    parts.append(cur)
    return parts


def _expand_one(item: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", item)
    if m is None:
        return [item]
    head, tail = item[: m.start()], item[m.end() :]
    out = []
    for piece in m.group(1).split(","):
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(lo) > int(hi):
                raise ValueError(f"nodelist item {item!r}: bad range {piece!r}")
            width = len(lo)
            names = [f"{i:0{width}d}" for i in range(int(lo), int(hi) + 1)]
        else:
            if not piece.isdigit():
                raise ValueError(f"nodelist item {item!r}: bad index {piece!r}")
            names = [piece]
        for n in names:
            out.extend(_expand_one(head + n + tail))
    return out


def this_host_ip() -> str:
    """The IP this host reaches others from (Ray's own rule: the address a UDP socket would use; nothing
    is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def ray_cli() -> str:
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if found is None:
        raise SystemExit(
            "launch.py: the `ray` command is not installed in this environment (pip install ray)"
        )
    return found


@dataclass
class Plan:
    """The nodes and the commands that start Ray on them."""

    nodes: list[str]
    head_ip: str
    port: int
    starts: list[list[str]] = field(default_factory=list)
    """One command per node (head first), each blocking while its Ray node runs."""

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.port}"


def build_plan(a: argparse.Namespace, env: dict[str, str]) -> Plan:
    """The nodes (SLURM or --local), the head's address and each node's `ray start` command."""
    ray = ray_cli()
    if a.local:
        nodes = ["localhost"] * a.local
        head_ip = a.head_ip or this_host_ip()
    else:
        text = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not text:
            raise SystemExit(
                "launch.py: SLURM_JOB_NODELIST is not set: run inside an allocation (sbatch / salloc), or "
                "use --local N to try it on this host"
            )
        nodes = expand_nodelist(text)
        head_ip = a.head_ip or (socket.gethostbyname(nodes[0]) if not a.dry_run else nodes[0])
    common = ["--block", "--disable-usage-stats", *shlex.split(a.ray_args)]
    if a.cpus_per_node:
        common.append(f"--num-cpus={a.cpus_per_node}")
    if a.gpus_per_node is not None:
        common.append(f"--num-gpus={a.gpus_per_node}")
    plan = Plan(nodes=nodes, head_ip=head_ip, port=a.port or free_port())
    for i, node in enumerate(nodes):
        if i == 0:
            ray_start = [ray, "start", "--head", f"--port={plan.port}", f"--node-ip-address={head_ip}"]
            ray_start += ["--include-dashboard=false"]
        else:
            ray_start = [ray, "start", f"--address={plan.address}"]
            if a.local:
                ray_start.append(f"--node-ip-address={head_ip}")
        if a.temp_dir:
            ray_start.append(f"--temp-dir={a.temp_dir}")
        if a.local:  # several nodes on one host: every port of its own
            ray_start += [
                f"--node-manager-port={free_port()}",
                f"--object-manager-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--metrics-export-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}",
            ]
        prefix = [] if a.local else ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap"]
        plan.starts.append([*prefix, *ray_start, *common])
    return plan


def wait_for_nodes(plan: Plan, env: dict[str, str], timeout: float, procs: list[subprocess.Popen]) -> int:
    """Poll the cluster (a short Python driver) until len(nodes) are alive; returns how many joined."""
    probe = (
        "import ray,sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(len([n for n in ray.nodes() if n['Alive']]))"
    )
    deadline = time.monotonic() + timeout
    alive = 0
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise SystemExit(
                f"launch.py: a Ray node exited early ({dead[0].args[:6]} ... rc {dead[0].returncode})"
            )
        try:
            out = subprocess.run(
                [sys.executable, "-c", probe, plan.address],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            continue  # the head is not answering yet
        if out.returncode == 0 and out.stdout.strip().splitlines():
            alive = int(out.stdout.strip().splitlines()[-1])
            if alive >= len(plan.nodes):
                return alive
        time.sleep(2)
    raise SystemExit(
        f"launch.py: only {alive} of {len(plan.nodes)} Ray nodes joined {plan.address} within {timeout:.0f} s; "
        "check that the nodes reach the head's port and share the auth token (see --token-file)"
    )


def stop(procs: list[subprocess.Popen], grace: float = 30.0) -> None:
    """SIGTERM every `ray start --block` (it stops its node's Ray processes), then SIGKILL what is left."""
    for p in reversed(procs):  # workers first, the head last
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" not in argv:
        raise SystemExit("usage: launch.py [options] -- COMMAND ... (see --help)" if "-h" not in argv else "")
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=6379, help="the head's GCS port (0: a free one)")
    p.add_argument("--head-ip", default="", help="the head's IP (default: resolved from its host name)")
    p.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs Ray offers per node (default: detect)"
    )
    p.add_argument("--cpus-per-node", type=int, default=0, help="CPUs Ray offers per node (0: detect)")
    p.add_argument("--temp-dir", default="", help="Ray's temp dir on every node (default /tmp/ray)")
    p.add_argument("--token-file", default="", help="shared auth token file (RAY_AUTH_TOKEN_PATH)")
    p.add_argument("--ray-args", default="", help="extra `ray start` arguments for every node")
    p.add_argument("--join-timeout", type=float, default=300.0, help="seconds to wait for every node")
    p.add_argument("--local", type=int, default=0, help="N Ray nodes on this host, no SLURM (tests)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    a = p.parse_args(argv[:cut])
    command = argv[cut + 1 :]
    if not command:
        raise SystemExit("launch.py: no command after --")
    return a, command


def main(argv: list[str] | None = None) -> int:
    a, command = parse(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "token")
    if a.token_file:
        env["RAY_AUTH_TOKEN_PATH"] = a.token_file
    plan = build_plan(a, env)
    command = [c.replace("{address}", plan.address) for c in command]
    if a.dry_run:
        print(f"nodes ({len(plan.nodes)}): {' '.join(plan.nodes)}")
        print(f"address: {plan.address}")
        for node, cmd in zip(plan.nodes, plan.starts, strict=True):
            print(f"start on {node}: {shlex.join(cmd)}")
        print(f"run: {shlex.join(command)}")
        return 0
    procs: list[subprocess.Popen] = []

    def on_term(signum, frame):  # scancel / kill: leave through the finally below
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        procs.append(subprocess.Popen(plan.starts[0], env=env))
        time.sleep(3)  # let the head bind its port before the workers dial it
        for cmd in plan.starts[1:]:
            procs.append(subprocess.Popen(cmd, env=env))
        alive = wait_for_nodes(plan, env, a.join_timeout, procs)
        print(f"launch.py: {alive} Ray nodes at {plan.address}; running: {shlex.join(command)}", flush=True)
        return subprocess.run(command, env={**env, "RELAYRL_RAY_ADDRESS": plan.address}).returncode
    except KeyboardInterrupt:
        return 130
    finally:
        stop(procs)


if __name__ == "__main__":
    sys.exit(main())
