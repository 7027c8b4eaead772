"""What the user sees during and after `relayrl rl`: the progress line, the per-step sample table
(console + <run>/samples.jsonl) and the PNG of the main curves.

    RLProgress                      step/total, reward, KL, response length, step time, ETA
    log_samples(trajs, step, run_dir, console)    a few prompt / response / reward rows per step
    plot_curves(metrics_jsonl, png)               reward, KL, response length and eval accuracy over steps
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.training.logging import ConsoleProgress, _scalar, read_jsonl

SAMPLES_FILE = "samples.jsonl"


class RLProgress(ConsoleProgress):
    """ConsoleProgress showing RL quantities instead of SFT's loss / tokens/s."""

    FIELDS = (
        ("rollout/reward_mean", "reward", "{:.3f}"),
        ("rollout/kl", "kl", "{:.4f}"),
        ("rollout/response_len", "len", "{:.1f}"),
        ("eval/pass@1", "eval", "{:.3f}"),
        ("timing/step", "step_s", "{:.2f}"),
    )

    @staticmethod
    def describe(metrics: Mapping[str, Any]) -> str:
        parts = []
        for key, label, fmt in RLProgress.FIELDS:
            value = _scalar(metrics[key]) if key in metrics else None
            if value is not None and math.isfinite(value):
                parts.append(f"{label} {fmt.format(value)}")
        dropped = metrics.get("filter/groups_dropped")
        if dropped:  # dynamic filtering: how many groups went, how many refill rounds it took
            parts.append(
                f"filtered {_scalar(dropped):.0f} groups, {_scalar(metrics.get('filter/refills', 0)):.0f} refills"
            )
        return "  ".join(parts)


def log_samples(trajs: list[Trajectory], step: int, run_dir: Path, *, console: bool, k: int = 4) -> None:
    """Append `k` samples (one per prompt first) to samples.jsonl; print them as a table when `console`."""
    seen, picked = set(), []
    for t in trajs:
        if t.sample.index not in seen:
            seen.add(t.sample.index)
            picked.append(t)
        if len(picked) == k:
            break
    rows = [
        {
            "step": step,
            "prompt": t.sample.prompt,
            "response": t.response_text,
            "reward": t.reward,
            "label": t.sample.label if isinstance(t.sample.label, str | int | float) else str(t.sample.label),
        }
        for t in picked
    ]
    with (run_dir / SAMPLES_FILE).open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    if console and rows:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"samples, step {step}", show_lines=False)
        for col in ("prompt", "response", "reward", "label"):
            table.add_column(col, overflow="fold", max_width=60)
        for r in rows:
            table.add_row(r["prompt"][-60:], r["response"][:60], f"{r['reward']}", str(r["label"]))
        Console().print(table)


PLOTS = (
    ("rollout/reward_mean", "reward (train)"),
    ("rollout/kl", "KL to reference"),
    ("rollout/response_len", "response length"),
    ("eval/pass@1", "eval accuracy (pass@1)"),
)


def plot_curves(metrics_path: Path, png: Path, title: str = "relayrl rl") -> Path | None:
    """A 2x2 PNG of the main curves from metrics.jsonl (panels without data say so); None if no rows."""
    if not Path(metrics_path).is_file():
        return None
    rows = read_jsonl(metrics_path)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, PLOTS, strict=True):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(pts) < 30 else None)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
