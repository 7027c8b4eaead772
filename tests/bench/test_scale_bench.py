"""bench/scale.py's argument checks (no GPU needed: they run before any case starts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCALE = Path(__file__).resolve().parents[2] / "bench" / "scale.py"


def test_sft_refuses_a_zero_token_budget_and_says_why():
    # 0 is automatic sizing for rl; for sft it would train one sample per micro-batch (a 10x slower step that
    # still looks like a valid row), so the bench stops before building anything
    proc = subprocess.run(
        [sys.executable, str(SCALE), "sft", "--device", "cpu", "--budget", "0", "--gpus", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "--budget 0" in proc.stderr and "one sample per micro-batch" in proc.stderr
