"""Metrics logging for every trainer: JSONL file, console progress bar, TensorBoard and W&B when asked.

    logger = MetricsLogger(run_dir, total_steps=100, tensorboard=True)
    logger.log({"train/loss": 1.2, "train/lr": 1e-4, "perf/tokens_per_s": 900.0}, step=3)
    logger.close()

Each `log` call appends one JSON line `{"step": 3, "time": <unix s>, "train/loss": 1.2, ...}` to
`<run_dir>/metrics.jsonl` (flushed, so a crash loses nothing; a resumed run keeps the rows up to its
checkpoint and continues the file), writes the same scalars to TensorBoard
(`<run_dir>/tensorboard/`) and W&B when enabled, and advances the console bar, which shows step/total, loss,
lr, tokens/s and ETA (rich; plain lines when stdout is not a terminal). Metric names are "<group>/<name>":
train/*, eval/*, rollout/*, perf/*, timing/*. `read_jsonl(path)` reads the file back (tests, plots).
W&B and TensorBoard are imported lazily; asking for W&B without the package is a clear error.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _scalar(value: Any) -> float | int | None:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    return None


class ConsoleProgress:
    """A one-line progress display: step/total, loss, lr, tokens/s, ETA.

    Uses rich when stdout is a terminal, otherwise prints a plain line every `print_every` steps (so CI logs
    and pytest output stay readable).
    """

    def __init__(self, total_steps: int, *, enabled: bool = True, print_every: int = 10, start_step: int = 0):
        self.total = max(1, total_steps)
        self.enabled = enabled
        self.print_every = max(1, print_every)
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self._rich = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._rich = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._task = self._rich.add_task("train", total=self.total, completed=start_step, info="")
            self._rich.start()

    def eta_s(self, step: int) -> float:
        """Seconds left, extrapolated from the steps done in this process."""
        done = step - self.start_step
        if done <= 0:
            return math.nan
        return (time.perf_counter() - self.t0) / done * (self.total - step)

    @staticmethod
    def describe(metrics: Mapping[str, Any]) -> str:
        """The short text shown on the bar."""
        parts = []
        for key, label, fmt in (
            ("train/loss", "loss", "{:.4f}"),
            ("eval/loss", "eval", "{:.4f}"),
            ("train/lr", "lr", "{:.2e}"),
            ("perf/tokens_per_s", "tok/s", "{:.0f}"),
        ):
            if key in metrics and _scalar(metrics[key]) is not None:
                parts.append(f"{label} {fmt.format(_scalar(metrics[key]))}")
        return "  ".join(parts)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        info = self.describe(metrics)
        if self._rich is not None:
            self._rich.update(self._task, completed=step, info=info)
        elif step % self.print_every == 0 or step == self.total:
            eta = self.eta_s(step)
            eta_txt = f"  eta {eta:.0f}s" if math.isfinite(eta) else ""
            print(f"step {step}/{self.total}  {info}{eta_txt}", flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


class MetricsLogger:
    """Writes scalar metrics to JSONL (always), TensorBoard and W&B (when asked) and the console bar.

    Args:
        run_dir: the run folder; `metrics.jsonl` and `tensorboard/` go here. A resumed run (start_step > 0)
            continues the file, dropping rows after start_step (logged by the interrupted run after its
            last checkpoint), so every step appears once; a fresh run (start_step 0) starts a new file.
        total_steps: for the progress bar / ETA.
        tensorboard: also write TensorBoard event files.
        wandb: also log to Weights & Biases (needs `pip install wandb`).
        wandb_project, wandb_run_name: W&B project and run name.
        config: the resolved config as a dict, attached to the W&B run.
        console: show the progress bar.
        start_step: the step a resumed run starts from (the ETA, and which old rows to keep).
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int = 0,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "relayrl",
        wandb_run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        console: bool = True,
        print_every: int = 10,
        start_step: int = 0,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        keep_rows_up_to(self.path, start_step)
        self._file = self.path.open("a")
        self._tb = None
        self._wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_mod  # pyright: ignore[reportMissingImports]  (optional, not installed)
            except ImportError as err:
                raise ImportError(
                    "logger.wandb is on but the `wandb` package is missing: `pip install wandb` "
                    "(or `pip install relayrl[wandb]`), or turn logger.wandb off"
                ) from err
            self._wandb = wandb_mod.init(
                project=wandb_project, name=wandb_run_name, config=dict(config or {}), dir=str(self.run_dir)
            )
        self.progress = ConsoleProgress(
            total_steps, enabled=console, print_every=print_every, start_step=start_step
        )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record scalar `metrics` at `step` (non-scalars are skipped; NaN is written as null)."""
        clean = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        row = {"step": step, "time": round(time.time(), 3)}
        row.update(
            {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in clean.items()}
        )
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)
        self.progress.update(step, clean)

    def close(self) -> None:
        """Flush and close every sink (safe to call twice)."""
        self.progress.close()
        if not self._file.closed:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def keep_rows_up_to(path: Path, step: int) -> None:
    """Rewrite a JSONL file of {"step": ...} rows (atomically) with only its rows of step <= `step`; remove it
    when `step` is 0. A torn line (a crash mid-write) is dropped with a warning naming the file and line."""
    if not path.is_file():
        return
    if step <= 0:
        path.unlink()
        return
    kept = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            warnings.warn(f"{path}, line {n}: not a complete JSON row (torn write?); dropped", stacklevel=2)
            continue
        if row_step <= step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a metrics JSONL file."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
