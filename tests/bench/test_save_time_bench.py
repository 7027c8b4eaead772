"""bench/save_time.py on CPU (2 gloo ranks, the tiny shape): every phase of both paths runs, the new export's
files are the old export's byte for byte, the parallel manifest equals the serial one, and the work folder is
removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two spawned ranks
@pytest.mark.timeout(180)
def test_save_time_bench_runs_both_paths_on_cpu(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, str(ROOT / "bench" / "save_time.py"), "--shape", "tiny", "--ranks", "2",
           "--device", "cpu", "--paths", "old,new", "--dir", str(work), "--out", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(cmd, check=True, env=env, timeout=170, capture_output=True)
    report = json.loads((tmp_path / "save_time_new_old.json").read_text())
    phases = report["phases"]
    assert list(phases) == report["plan"] and len(phases) == 6 and "error" not in report
    assert phases["manifest_old"]["same_as_new"] and phases["export_old"]["same_files"]
    assert phases["export_new"]["bytes"] == phases["export_old"]["bytes"] > 0
    assert all(len(p["ranks"]) == 2 for p in phases.values())
    assert list(work.iterdir()) == []  # the checkpoint and the exports are gone
