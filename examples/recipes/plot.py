"""Draw every OUT/<run>/curve.jsonl in one picture (OUT/curves.png) and write the table (OUT/results.{md,json}).

    python examples/recipes/plot.py OUT

A run is any folder under OUT with a curve.jsonl (relayrl's grpo / ppo / reinforce++, the more-SFT control
`sft_control`, TRL's `trl_grpo`, ...). Lines: {"t": seconds since the run's start, "step": k, "heldout_em": x}.
The table gives, per run: the SFT model's accuracy (its t=0 point), the last and the best accuracy, the gain,
the wall time, and for an RL run the more-SFT control's accuracy at the same wall time (its point nearest
in time) and the margin over it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CONTROL = "sft_control"
"""The more-SFT control's run folder."""
GAIN_TARGET = 0.25
"""The recipe's target: RL lifts held-out exact match by at least this over the SFT model."""


def read_curves(out: Path) -> dict[str, list[dict[str, float]]]:
    """run name (its folder's path under OUT) -> curve points, in time order. The curves kept in an earlier
    call's results.json copied anywhere below OUT join too (a run of the same name found as curve.jsonl wins),
    so two calls' runs (e.g. relayrl's and TRL's) make one picture."""
    curves: dict[str, list[dict[str, float]]] = {}
    for path in sorted(out.rglob("curve.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            curves[str(path.parent.relative_to(out))] = sorted(rows, key=lambda r: r["t"])
    for path in sorted(out.rglob("results.json")):
        if path.parent != out:
            for run, rows in json.loads(path.read_text()).get("curves", {}).items():
                curves.setdefault(run, rows)
    return curves


def at_time(points: list[dict[str, float]], t: float) -> float:
    """The accuracy a run had at time t: its point nearest in time (runs of the same budget end within a
    step of each other, so a run's last point meets the other's last point)."""
    return min(points, key=lambda p: abs(p["t"] - t))["heldout_em"]


def summarize(curves: dict[str, list[dict[str, float]]]) -> list[dict[str, Any]]:
    control = curves.get(CONTROL)
    table = []
    for run, pts in curves.items():
        row: dict[str, Any] = {
            "run": run,
            "sft_em": pts[0]["heldout_em"],
            "final_em": pts[-1]["heldout_em"],
            "best_em": max(p["heldout_em"] for p in pts),
            "gain": round(pts[-1]["heldout_em"] - pts[0]["heldout_em"], 4),
            "seconds": pts[-1]["t"],
            "steps": pts[-1]["step"],
        }
        if control is not None and run != CONTROL:
            row["control_em_same_time"] = at_time(control, pts[-1]["t"])
            row["margin_over_control"] = round(row["final_em"] - row["control_em_same_time"], 4)
            row["beats_control"] = row["margin_over_control"] > 0
            row["gain_target_met"] = row["gain"] >= GAIN_TARGET
        table.append(row)
    return table


def markdown(table: list[dict[str, Any]]) -> str:
    head = "| run | SFT EM | final EM | best EM | gain | more-SFT EM, same time | margin | seconds | steps |"
    lines = [head, "|" + "---|" * 9]
    for r in table:
        ctrl = r.get("control_em_same_time")
        margin = r.get("margin_over_control")
        lines.append(
            f"| {r['run']} | {r['sft_em']:.3f} | {r['final_em']:.3f} | {r['best_em']:.3f} | {r['gain']:+.3f} | "
            f"{'' if ctrl is None else f'{ctrl:.3f}'} | {'' if margin is None else f'{margin:+.3f}'} | "
            f"{r['seconds']:.0f} | {r['steps']} |"
        )
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, pts in curves.items():
        style = "--" if run == CONTROL else "-"
        ax.plot([p["t"] for p in pts], [p["heldout_em"] for p in pts], style, marker="o", ms=3, label=run)
    ax.set_xlabel("wall time since the SFT checkpoint (s)")
    ax.set_ylabel("held-out exact match (greedy)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(out: Path, meta: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """curves.png, results.md, results.json under `out`; returns the table."""
    curves = read_curves(out)
    table = summarize(curves)
    extra = {}
    sft = out / CONTROL / "sft.json"
    if sft.is_file():
        extra["sft"] = json.loads(sft.read_text())
    (out / "results.json").write_text(
        json.dumps({"table": table, **extra, "meta": meta or {}, "curves": curves}, indent=1, default=str)
        + "\n"
    )
    (out / "results.md").write_text(markdown(table))
    try:
        if curves:
            plot(curves, out / "curves.png")
        else:
            print(f"recipe plot: no curve.jsonl under {out}; no picture", file=sys.stderr)
    except ImportError as e:
        print(f"recipe plot: no picture ({e}); the table is in {out / 'results.md'}", file=sys.stderr)
    print(markdown(table), flush=True)
    return table


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/recipes/plot.py OUT")
    meta_file = Path(sys.argv[1]) / "results.json"
    meta = json.loads(meta_file.read_text()).get("meta") if meta_file.is_file() else None
    write_results(Path(sys.argv[1]), meta)
