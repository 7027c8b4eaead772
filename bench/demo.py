"""`relayrl demo` as `make demo` runs it, per seed: the accuracies, gain, step counts and CPU / wall seconds.

    .venv/bin/python bench/demo.py                  # seeds 0 1 2, defaults (about 4 minutes of CPU each)
    .venv/bin/python bench/demo.py --seeds 0        # the default seed only (the README's figures)

Each seed runs `python -m relayrl.cli demo --seed N --output_dir <tmp>/demo_N` in a child process (the demo's
defaults otherwise, one torch thread) and reads its runs/demo/summary.json. CPU seconds are the child's user +
system time (getrusage of the finished child): on a machine shared with other jobs wall time says little, while
with one thread the CPU time is what the wall time would be on a quiet machine. The 1-minute load average
before and after each run says how shared the machine was.

Prints one row per seed and writes bench/results/demo.json (replaced): the rows, the DemoConfig defaults they
ran with, and the package versions. README.md and docs/rl.md quote its default-seed row; tests/docs/test_demo_
numbers.py checks that they do and that the recorded defaults are today's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "demo.json"
COLUMNS = ("seed", "sft_steps", "accuracy_sft", "accuracy_rl", "gain", "rl_steps", "cpu_s", "cpu_sft_s", "cpu_rl_s")  # fmt: skip


def children_cpu() -> float:
    """User + system seconds of this process's finished children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_seed(seed: int, folder: Path, extra: list[str]) -> dict:
    """One `relayrl demo` in a child process; its summary plus the child's CPU and wall seconds."""
    out = folder / f"demo_{seed}"
    cmd = [sys.executable, "-m", "relayrl.cli", "demo", "--seed", str(seed), "--output_dir", str(out), *extra]
    load0, c0, t0 = os.getloadavg()[0], children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall, cpu = time.perf_counter() - t0, children_cpu() - c0
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise SystemExit(f"bench/demo.py: seed {seed} exited {proc.returncode}:\n{tail}")
    s = json.loads((out / "summary.json").read_text())
    return {
        "seed": seed,
        "sft_steps": s["sft_steps"],
        "dev_accuracy_sft": s["dev_accuracy_sft"],
        "accuracy_sft": s["accuracy_sft"],
        "accuracy_rl": s["accuracy_rl"],
        "gain": round(s["accuracy_rl"] - s["accuracy_sft"], 3),
        "rl_steps": s["rl_steps"],
        "cpu_s": round(cpu, 1),
        "cpu_sft_s": s["cpu_seconds_sft"],
        "cpu_rl_s": s["cpu_seconds_rl"],
        "wall_s": round(wall, 1),
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON (replaced)")
    p.add_argument(
        "--keep", type=Path, default=None, help="keep the run folders here (default: a temporary one)"
    )
    args, extra = p.parse_known_args()  # anything else goes to `relayrl demo` (then not the defaults)
    sys.path.insert(0, str(ROOT))
    from relayrl.config.apps import DemoConfig

    defaults = asdict(DemoConfig())
    defaults.pop("output_dir")
    rows = []
    print("  ".join(f"{c:>12}" for c in COLUMNS), flush=True)
    with tempfile.TemporaryDirectory(prefix="relayrl-bench-demo-") as tmp:
        for seed in args.seeds:
            row = run_seed(seed, args.keep or Path(tmp), extra)
            rows.append(row)
            print("  ".join(f"{row[c]:>12}" for c in COLUMNS), flush=True)
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "versions": versions(),
        "demo_args": extra,
        "defaults": defaults,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
