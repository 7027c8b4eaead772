"""examples/slurm/launch.py: SLURM host lists expanded without scontrol, the plan printed by --dry-run (head
first, srun per node, {address} filled in), and (slow) two Ray nodes started on this host by the same script,
a command run on them that sees both nodes, and everything stopped afterwards."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "examples" / "slurm" / "launch.py"


def _module():
    spec = importlib.util.spec_from_file_location("slurm_launch", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = sys.modules.get("slurm_launch") or importlib.util.module_from_spec(spec)
    sys.modules["slurm_launch"] = mod  # its dataclasses look their module up by name
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu5", ["gpu5"]),
        ("a[8-10],b1,c[1,3]", ["a8", "a9", "a10", "b1", "c1", "c3"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("n[009-011]", ["n009", "n010", "n011"]),
    ],
)
def test_nodelists_expand_in_order_with_their_padding(text, hosts):
    assert _module().expand_nodelist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node01]", "node[3-1]", "node[a-b]"])
def test_a_malformed_nodelist_is_refused_by_name(text):
    with pytest.raises(ValueError, match="nodelist"):
        _module().expand_nodelist(text)


def test_dry_run_plans_the_head_first_and_srun_per_node(monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-03]")
    code = _module().main(["--dry-run", "--port", "6380", "--gpus-per-node", "8", "--", "relayrl", "rl",
                           "--dist.ray_address", "{address}"])  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0] == "nodes (3): gpu01 gpu02 gpu03" and out[1] == "address: gpu01:6380"
    starts = [line for line in out if line.startswith("start on ")]
    assert [s.split(":")[0] for s in starts] == ["start on gpu01", "start on gpu02", "start on gpu03"]
    assert "--nodelist=gpu01" in starts[0] and "--head" in starts[0] and "--port=6380" in starts[0]
    for s in starts[1:]:
        assert "--address=gpu01:6380" in s and "--head" not in s and "srun" in s and "--block" in s
        assert "--num-gpus=8" in s
    assert out[-1] == "run: relayrl rl --dist.ray_address gpu01:6380"


def test_without_an_allocation_it_says_how_to_run(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    with pytest.raises(SystemExit, match="SLURM_JOB_NODELIST is not set"):
        _module().main(["--dry-run", "--", "true"])


PROBE = (
    "import ray,sys; ray.init(address=sys.argv[1]); "
    "print('NODES', len([n for n in ray.nodes() if n['Alive']])); sys.exit(3)"
)


@pytest.fixture
def short_dir():
    """A temp dir with a short path: Ray's socket paths under it must stay within 107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow  # starts two Ray nodes with `ray start`
@pytest.mark.timeout(300)
def test_two_ray_nodes_on_this_host_run_a_command_and_stop(short_dir):
    args = [sys.executable, str(SCRIPT), "--local", "2", "--port", "0", "--cpus-per-node", "1"]
    args += ["--temp-dir", str(short_dir / "ray"), "--join-timeout", "180"]
    args += ["--", sys.executable, "-c", PROBE, "{address}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=280)
    assert "NODES 2" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 3  # the command's exit code
    # the cluster is gone: no process of it (they all name its temp dir) is left
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_text()
        except OSError:
            continue  # a process that ended meanwhile
        if str(short_dir / "ray") in text:
            left.append(text.replace("\0", " ")[:200])
    assert not left, left
