"""bench/scale.py's rows, time plan and case processes, in plain Python (no torch): the parent process, which
never loads a model, writes a row for a case it killed.

Processes: every case runs in a child process of its own group (`run_killable`), killed whole (its Ray
cluster and actors too) at the end of its slot or when the bench gets SIGTERM (an outer `timeout`).

Rows: a case's row is computed from its run folder's `metrics.jsonl` (one row per optimizer step, written as
the step ends), by the case itself when it finishes and by the parent when it kills the case: a case killed
after some timed steps still gives a row, marked `partial` with the reason. The first WARMUP steps are not
timed. Every figure is the MEDIAN over the timed steps; `step_s_min` (the fastest step) and `step_s_spread`
((slowest - fastest) / median) say how noisy the median is. `startup_s`: from the case's launch to the start
of its first step.

Time plan: with `--time-budget`, cases run largest GPU count first (the case that matters most, and the one
with the longest start-up, is never the one starved), and each case may run until the budget minus the
minimum still reserved for every later case (`case_min`), capped at `--case-timeout`. A case whose share would
be below its own minimum is not started ("skipped"), never started and then killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WARMUP = 1
"""Leading steps of every run left out of the figures (compilation, allocator and engine warm-up)."""
METRICS = "metrics.jsonl"
RL_PARTS = ("generation", "experience", "update", "sync", "engine_refresh", "step")


class NoTimedStep(ValueError):
    """The run folder holds no step past the warm-up: no row can be made from it."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of <run_dir>/metrics.jsonl in step order ([] without the file). A torn last line (the run
    killed while writing it) is dropped; a step logged twice keeps its last row."""
    path = run_dir / METRICS
    if not path.is_file():
        return []
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows[int(row["step"])] = row
    return [rows[k] for k in sorted(rows)]


def _spread(values: list[float]) -> dict[str, float]:
    med = statistics.median(values)
    return {
        "median": round(med, 4),
        "min": round(min(values), 4),
        "spread": round((max(values) - min(values)) / med, 3) if med > 0 else 0.0,
    }


def _timed(history: list[dict], key: str) -> tuple[list[dict], list[dict]]:
    """(the step rows: those with `key`, the timed ones: after the warm-up); NoTimedStep when none is timed."""
    steps = [h for h in history if h.get(key) is not None]
    timed = steps[WARMUP:]
    if not timed:
        raise NoTimedStep(f"{len(steps)} step(s) done, none timed (the first {WARMUP} is a warm-up)")
    return steps, timed


def _common(steps: list[dict], timed: list[dict], step_key: str, launched: float | None) -> dict:
    step = _spread([h[step_key] for h in timed])
    row = {
        "steps_done": len(steps),
        "steps_timed": len(timed),
        "step_s": step["median"],
        "step_s_min": step["min"],
        "step_s_spread": step["spread"],
        "step_s_by_step": [h[step_key] for h in steps],  # the warm-up included
    }
    first = steps[0]
    if launched is not None and "time" in first:  # the row is logged as the step ends
        row["startup_s"] = round(first["time"] - first[step_key] - launched, 1)
    return row


def rl_row(history: list[dict], *, launched: float | None = None) -> dict:
    """An RL case's figures from its metrics rows: `seconds` per timing/* part, generated tokens a step and
    `throughput` (generated tokens / step seconds), each the median over the timed steps; `throughput_best`
    the fastest step's; `seconds_by_step`: each part's seconds in every step, the warm-up included (medians of
    parts come from different steps and need not add up; a stall in some steps shows only here).
    `launched`: the case's start (time.time()) for `startup_s`."""
    steps, timed = _timed(history, "timing/step")
    parts = sorted({k.removeprefix("timing/") for h in timed for k in h if k.startswith("timing/")})
    parts += [p for p in RL_PARTS if p not in parts]
    med = statistics.median
    gen = [h["rollout/response_len"] * h["rollout/samples"] for h in timed]
    tput = [g / h["timing/step"] for g, h in zip(gen, timed, strict=True)]
    row = _common(steps, timed, "timing/step", launched)
    row.update(
        seconds={p: round(med(h.get(f"timing/{p}") or 0.0 for h in timed), 4) for p in parts},
        seconds_by_step={p: [round(h.get(f"timing/{p}") or 0.0, 4) for h in steps] for p in parts},
        gen_tokens_per_step=round(med(gen), 1),
        throughput=round(med(tput), 1),
        throughput_best=round(max(tput), 1),
        step_gen_tokens_per_s=round(med(tput), 1),
        peak_mem_gib=round(max(h.get("perf/peak_mem_gib") or 0.0 for h in steps), 2),
        response_len=round(med(h["rollout/response_len"] for h in timed), 1),
        losses={k: [h.get(k) for h in steps] for k in ("train/policy_loss", "critic/loss") if k in steps[0]},
    )
    return row


SFT_RANK_KEYS = (
    "timing/pack_s",
    "timing/put_s",
    "perf/rank_tokens_max",
    "perf/rank_tokens_min",
    "perf/rank_run_tokens_max",
    "perf/rank_passes_max",
)
"""Per-rank balance and the driver's own work (relayrl.trainers.recipe's rank loads), medians."""


def sft_row(history: list[dict], *, launched: float | None = None) -> dict:
    """An SFT case's figures from its metrics rows: real tokens per second of the whole step (every rank),
    `throughput` the median over the timed steps, `throughput_best` the fastest step's."""
    steps, timed = _timed(history, "perf/step_s")
    med = statistics.median
    tps = [h["perf/tokens_per_s"] for h in timed]
    row = _common(steps, timed, "perf/step_s", launched)
    row.update(
        throughput=round(med(tps), 1),
        throughput_best=round(max(tps), 1),
        tokens_per_s=round(med(tps), 1),
        tokens_per_step=round(med(h["perf/tokens_per_s"] * h["perf/step_s"] for h in timed), 1),
        train_losses=[h.get("train/loss") for h in steps],
        **{
            k.split("/")[1]: round(med(h[k] for h in timed), 4)
            for k in SFT_RANK_KEYS
            if all(h.get(k) is not None for h in timed)
        },
    )
    return row


def save_seconds(run_dir: Path, history: list[dict]) -> float | None:
    """The end-of-run save: from the last step's metrics row to the newest file written under checkpoints/
    and final/ (the last checkpoint, then the HF export); None when nothing was saved after the last step."""
    if not history or "time" not in history[-1]:
        return None
    files = [f for d in ("checkpoints", "final") for f in (run_dir / d).rglob("*") if f.is_file()]
    newest = max((f.stat().st_mtime for f in files), default=0.0)
    return round(newest - history[-1]["time"], 2) if newest > history[-1]["time"] else None


# ------------------------------------------------------------------------------------------ processes
class GpuMemory:
    """Peak memory used on each GPU by ALL its processes (policy, reference, critic actors together), from
    nvidia-smi every 0.5 s while a case runs (short spikes between samples are missed); {} without it."""

    def __init__(self) -> None:
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                lines = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                return
            for line in lines:
                i, used = (x.strip() for x in line.split(","))
                self.peak[int(i)] = max(self.peak.get(int(i), 0.0), round(float(used) / 1024, 2))
            self._stop.wait(0.5)

    def __enter__(self) -> GpuMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def _gpu_used_gib() -> dict[int, float]:
    """Each GPU's used memory (all processes) from nvidia-smi; {} without it or when it fails."""
    query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.splitlines()
        return {int(i): float(used) / 1024 for i, used in (line.split(",") for line in lines if "," in line)}
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}


def wait_gpus_released(limit_s: float = 20.0, below_gib: float = 2.0) -> float:
    """After a killed case: wait (at most limit_s) until each visible GPU uses < below_gib (a killed case's Ray
    workers exit a few seconds after their raylet), so the next case does not start on full GPUs. The seconds
    waited; 0 without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return 0.0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    mine = {int(x) for x in visible.split(",") if x.strip().isdigit()}
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        used = {i: u for i, u in _gpu_used_gib().items() if not mine or i in mine}
        if all(u < below_gib for u in used.values()):
            break
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1)


class Interrupted(Exception):
    """SIGTERM to the bench (e.g. an outer `timeout`): the running case is killed and its row recovered."""


def raise_interrupted(*_: object) -> None:
    raise Interrupted


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...), from /proc; [] where /proc is missing."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except OSError:
            continue  # the process ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def run_killable(cmd: list[str], row_file: Path, timeout_s: float) -> tuple[dict, str | None]:
    """Run `cmd` in its own process group, killed (the whole group and every process below it: its Ray
    cluster and actors too) after timeout_s or when this process is interrupted. (the row file's content, None | "timeout" | "interrupted")."""
    proc = subprocess.Popen(cmd, start_new_session=True)
    stopped, code = None, 0
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stopped = "timeout"
    except (Interrupted, KeyboardInterrupt):
        stopped = "interrupted"
    finally:  # no orphan case, whatever stopped the wait
        if proc.poll() is None:
            tree = descendants(proc.pid)  # Ray's workers set their own process groups: kill them by id too
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
    try:
        row = json.loads(row_file.read_text()) if row_file.is_file() else {}
    except json.JSONDecodeError:  # killed while writing it
        row = {}
    if stopped is None and code != 0 and "error" not in row:
        row["error"] = f"exit code {code}"
    return row, stopped


# ------------------------------------------------------------------------------------------ time plan
def run_order(gpus: list[int]) -> list[int]:
    """The order the cases run in: the largest GPU count first (see the module doc)."""
    return sorted(gpus, reverse=True)


def default_case_min(gpus: int, device: str) -> float:
    """Seconds a case needs at least (start-up, the warm-up and a few timed steps of the 0.5B-1.5B tables:
    start-up is ~10 s on 1 GPU and 40-60 s on 2-4 with Ray); 7B runs should pass --case-min."""
    return 30.0 + 10.0 * gpus if device == "cuda" else 15.0 + 5.0 * gpus


@dataclass(frozen=True, slots=True)
class Slot:
    """How long a case may run, and what bounds it."""

    seconds: float
    """Wall-clock seconds before the case is killed."""
    bound: str
    """"case timeout" (--case-timeout) or "time budget" (its share of --time-budget)."""


def case_slot(left: float, case_timeout: float, need: float, later_needs: list[float]) -> Slot | str:
    """The slot of the next case: `left` seconds of the budget remain and `later_needs` are the minimums of the
    cases after it; or why it is not started (its share would be below its minimum `need`)."""
    share = left - sum(later_needs)
    if share < need:
        return (
            f"not started: {max(left, 0):.0f} s of the time budget left, {sum(later_needs):.0f} s reserved for "
            f"the {len(later_needs)} later case(s), this case needs {need:.0f} s (--case-min)"
        )
    if case_timeout <= share:
        return Slot(seconds=case_timeout, bound="case timeout")
    return Slot(seconds=share, bound="time budget")


def killed_reason(slot: Slot | None, ran_s: float, steps_done: int, steps_asked: int) -> str:
    """Why and when a killed case stopped, distinguishing the budget from a hang and the end-of-run save."""
    if slot is None:
        cause = f"interrupted (the bench was stopped) after {ran_s:.0f} s"
    elif slot.bound == "time budget":
        cause = f"killed at the end of its {slot.seconds:.0f} s share of --time-budget (not --case-timeout)"
    else:
        cause = f"killed at --case-timeout {slot.seconds:.0f} s"
    if steps_done == 0:
        where = "before its first step (start-up)"
    elif steps_done < steps_asked:
        where = f"after {steps_done} of {steps_asked} steps"
    else:
        where = f"after all {steps_asked} steps (in the end-of-run save or shutdown)"
    return f"{cause}, {where}"
