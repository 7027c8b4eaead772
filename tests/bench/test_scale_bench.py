"""bench/scale.py (no GPU needed): argument checks, rows from a run's metrics (medians, partial rows of killed
cases), the time plan, killing a case's process group; two slow end-to-end CPU runs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


# ---------------------------------------------------------------------------------------- rows and time plan
sys.path.insert(0, str(SCALE.parent))  # bench/ (its scripts import each other by name)
import scale  # noqa: E402  # pyright: ignore[reportMissingImports]  (bench/scale.py: torch, no GPU)
import scale_plan as plan  # noqa: E402  # pyright: ignore[reportMissingImports]


def _rl_rows(steps: list[float], t0: float = 1000.0) -> list[dict]:
    """metrics.jsonl rows of an RL run: step i took steps[i] s and generated 100 x (i + 1) tokens."""
    rows, t = [], t0
    for i, s in enumerate(steps):
        t += s
        rows.append({"step": i + 1, "time": t, "timing/step": s, "timing/generation": s / 2,
                     "rollout/response_len": 10.0 * (i + 1), "rollout/samples": 10, "train/policy_loss": 0.1})  # fmt: skip
    return rows


def test_rl_row_medians_min_and_spread_after_the_warm_up():
    # warm-up 9 s (left out); timed 1, 2, 3, 10 s: median 2.5, fastest 1, spread (10 - 1) / 2.5 = 3.6;
    # throughput per step 200/1, 300/2, 400/3, 500/10 tokens/s: median (150 + 133.33) / 2 = 141.67
    row = plan.rl_row(_rl_rows([9.0, 1.0, 2.0, 3.0, 10.0]), launched=990.0)
    assert (row["steps_done"], row["steps_timed"]) == (5, 4)
    assert (row["step_s"], row["step_s_min"], row["step_s_spread"]) == (2.5, 1.0, 3.6)
    assert row["seconds"]["step"] == 2.5 and row["seconds"]["generation"] == 1.25
    # every step's parts, the warm-up included, in step order (a stall in some steps shows only here)
    assert row["seconds_by_step"]["generation"] == [4.5, 0.5, 1.0, 1.5, 5.0]
    assert row["seconds_by_step"]["step"] == [9.0, 1.0, 2.0, 3.0, 10.0]
    assert row["throughput"] == round((150 + 400 / 3) / 2, 1) and row["throughput_best"] == 200.0
    # launched at 990; the first step's row is logged at 1009 after 9 s: it started at 1000
    assert row["startup_s"] == 10.0


def test_weak_efficiency_is_from_medians_against_the_fewest_gpus():
    # run largest first: the 4-GPU row comes first but the base is the 1-GPU row
    rows = [{"gpus": 4, "algo": "grpo", "throughput": 300.0, "step_s": 2.0},
            {"gpus": 1, "algo": "grpo", "throughput": 100.0, "step_s": 1.0}]  # fmt: skip
    scale._summarise(rows, "rl", weak=True)
    assert rows[0]["efficiency"] == 0.75 and rows[1]["efficiency"] == 1.0
    scale._summarise(rows, "rl", weak=False)
    assert rows[0]["speedup_vs_first"] == 0.5 and rows[0]["efficiency"] == 0.125


def test_the_plan_never_starts_a_case_it_cannot_give_its_minimum():
    # largest first; every case started gets at least its minimum, later ones keep theirs reserved
    order = plan.run_order([1, 2, 4])
    assert order == [4, 2, 1]
    needs = [plan.default_case_min(g, "cuda") for g in order]  # 70, 50, 40
    left, slots = 240.0, []
    for i in range(len(order)):
        slot = plan.case_slot(left, 1000.0, needs[i], needs[i + 1 :])
        assert isinstance(slot, plan.Slot) and slot.seconds >= needs[i] and slot.bound == "time budget"
        slots.append(slot.seconds)
        left -= slot.seconds  # each case runs its whole share (the worst case)
    assert slots == [150.0, 50.0, 40.0] and left == 0.0
    # too little left for the 4-GPU case and the two reserved after it: not started, and it says why
    skip = plan.case_slot(150.0, 1000.0, 70.0, [50.0, 40.0])
    assert (
        isinstance(skip, str) and "not started" in skip and "90 s reserved" in skip and "needs 70 s" in skip
    )
    # with time to spare the case timeout bounds it
    assert plan.case_slot(1000.0, 95.0, 70.0, [50.0]) == plan.Slot(seconds=95.0, bound="case timeout")


def _args(kind: str = "rl", steps: int = 6) -> argparse.Namespace:
    return argparse.Namespace(kind=kind, shape="tiny", prompts=4, samples=2, batch=8, weak=True, offload=False,
                              grad_ckpt=False, steps=steps)  # fmt: skip


def test_a_case_killed_mid_run_gives_a_partial_row_from_its_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(r) for r in _rl_rows([5.0, 1.0, 3.0, 2.0])]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "ti')  # torn by the kill
    slot = plan.Slot(seconds=61.0, bound="time budget")
    row = scale.recover_row(_args(), "grpo", 4, run, {"card": "X"}, slot, 61.2, 990.0)
    assert row["partial"] is True and row["killed"] == "time budget"
    assert row["partial_reason"] == (
        "killed at the end of its 61 s share of --time-budget (not --case-timeout), after 4 of 6 steps"
    )
    assert (row["steps_timed"], row["step_s"], row["step_s_min"]) == (3, 2.0, 1.0)
    assert (row["gpus"], row["global_batch"], row["card"], row["wall_s"]) == (4, 32, "X", 61.2)
    assert "error" not in row
    # only the warm-up done: no row, an error that says when and by what it was killed
    (run / "metrics.jsonl").write_text(lines[0] + "\n")
    timeout = plan.Slot(seconds=95.0, bound="case timeout")
    row = scale.recover_row(_args(), "grpo", 4, run, {}, timeout, 95.0, 990.0)
    assert row["killed"] == "case timeout" and "partial" not in row
    assert row["error"].startswith(
        "killed at --case-timeout 95 s, after 1 of 6 steps; 1 step(s) done, none timed"
    )
    # every step done, killed in the end-of-run save: still a row, and the reason says where
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")
    row = scale.recover_row(_args(steps=3), "grpo", 4, run, {}, timeout, 95.0, 990.0)
    assert row["partial"] and row["partial_reason"].endswith(
        "after all 3 steps (in the end-of-run save or shutdown)"
    )


def test_run_killable_kills_the_case_and_its_children(tmp_path):
    # the case starts a grandchild in a session of its own (as Ray starts its workers) and hangs: both are gone
    # after the timeout (killing the case's process group alone would leave the grandchild)
    pid_file, row_file = tmp_path / "pid", tmp_path / "row.json"
    code = (
        "import json, subprocess, sys, time, pathlib\n"
        f"row = pathlib.Path({str(row_file)!r}); row.write_text(json.dumps({{'card': 'c'}}))\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    row, stopped = plan.run_killable([sys.executable, "-c", code], row_file, 3.0)
    assert stopped == "timeout" and row == {"card": "c"} and time.monotonic() - t0 < 20
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(grandchild):
        time.sleep(0.1)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by its parent's parent) counts as gone
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.slow
def test_a_case_killed_at_its_timeout_still_writes_its_row(tmp_path):
    # a tiny RL run on the CPU with far more steps than 30 s allow (4,000 x 1 prompt; the add2 task has 6,445
    # rows): the case is killed, its row comes from the steps its metrics.jsonl holds (~40 s). 30 s, not less:
    # in a fresh clone (no bytecode yet) beside another test worker, start-up alone took over 10 s.
    proc = subprocess.run(
        [sys.executable, str(SCALE), "rl", "--device", "cpu", "--shape", "tiny", "--gpus", "1", "--steps", "4000",
         "--prompts", "1", "--samples", "2", "--new-tokens", "4", "--case-timeout", "30", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(SCALE.parents[1])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "scale_rl_tiny_grpo.json").read_text())["rows"]
    assert row.get("partial") is True and row["killed"] == "case timeout", json.dumps(row)
    assert row["partial_reason"].startswith("killed at --case-timeout 30 s, after ")
    assert 2 <= row["steps_done"] < 4000 and row["steps_timed"] == row["steps_done"] - 1
    assert "PARTIAL: killed at --case-timeout" in proc.stdout


@pytest.mark.slow
def test_no_case_starts_when_the_budget_cannot_give_it_its_minimum(tmp_path):
    # 60 s of budget, 100 s needed a case: both cases are skipped (not started and killed), the table says why
    proc = subprocess.run(
        [sys.executable, str(SCALE), "sft", "--device", "cpu", "--shape", "tiny", "--gpus", "1,2",
         "--time-budget", "60", "--case-min", "100", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(SCALE.parents[1])},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "scale_sft_tiny.json").read_text())["rows"]
    assert [r["gpus"] for r in rows] == [1, 2]
    assert all(
        r["skipped"].startswith("not started: ") and "needs 100 s (--case-min)" in r["skipped"] for r in rows
    )
    assert not list(tmp_path.glob("**/metrics.jsonl"))


def test_after_a_kill_the_next_case_waits_for_the_gpus_to_be_released(tmp_path, monkeypatch):
    # a fake nvidia-smi: GPU 1 holds 30 GiB for its first 2 queries (the killed case's actors exiting), then 0.1;
    # GPU 0 is busy throughout but not visible to the bench (CUDA_VISIBLE_DEVICES=1)
    count = tmp_path / "count"
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!/bin/sh\n"
        f"n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}\n"
        'echo "0, 40000"\n'
        'if [ "$n" -lt 2 ]; then echo "1, 30000"; else echo "1, 100"; fi\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    waited = plan.wait_gpus_released(limit_s=10.0)
    assert count.read_text().strip() == "3" and 1.5 <= waited < 5.0
