"""Draw every OUT/<run>/curve.jsonl in one picture (OUT/curves.png) and write the table (OUT/results.{md,json}).

    python examples/recipes/plot.py OUT

The head-to-head pair (TRL's `trl_grpo` and relayrl's `grpo_vs_trl`, the same GRPO from the same checkpoint for
the same wall time, run_gpu.sh) goes to its own picture (OUT/h2h.png) and table: TRL's final accuracy, the
time relayrl's curve first reached it (its first evaluated point at or above it), and that time over TRL's.
Per-step times: the median of each `timing/*` over OUT/<run>/metrics.jsonl (relayrl), and of `step_time` in
OUT/trl_grpo/summary.json (TRL).

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
H2H = ("trl_grpo", "grpo_vs_trl")
"""The head-to-head pair: TRL's GRPO and relayrl's, from the same checkpoint for the same wall time."""
H2H_TARGET = 0.5
"""The target: relayrl reaches TRL's final accuracy in at most this fraction of TRL's wall time."""


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


def head_to_head(curves: dict[str, list[dict[str, float]]]) -> dict[str, Any] | None:
    """TRL's final accuracy and wall time, and when relayrl's curve first reached that accuracy (None when
    the pair is not there)."""
    trl, ours = (curves.get(run) for run in H2H)
    if not trl or not ours:
        return None
    final, seconds = trl[-1]["heldout_em"], trl[-1]["t"]
    reached = next((p for p in ours if p["heldout_em"] >= final), None)
    row: dict[str, Any] = {
        "trl_sft_em": trl[0]["heldout_em"],
        "trl_final_em": final,
        "trl_seconds": seconds,
        "trl_steps": trl[-1]["step"],
        "relayrl_sft_em": ours[0]["heldout_em"],
        "relayrl_final_em": ours[-1]["heldout_em"],
        "relayrl_seconds": ours[-1]["t"],
        "relayrl_steps": ours[-1]["step"],
        "relayrl_em_at_trl_end": at_time(ours, seconds),
        "relayrl_seconds_to_trl_final": None if reached is None else reached["t"],
        "time_ratio": None if reached is None or not seconds else round(reached["t"] / seconds, 3),
    }
    row["target_met"] = row["time_ratio"] is not None and row["time_ratio"] <= H2H_TARGET
    return row


def step_times(out: Path, runs: list[str]) -> dict[str, dict[str, float]]:
    """run -> median seconds of each part of a step (relayrl: timing/* in OUT/<run>/metrics.jsonl; TRL:
    step_time in OUT/trl_grpo/summary.json), for the runs that wrote them."""
    times: dict[str, dict[str, float]] = {}
    for run in runs:
        metrics, summary = out / run / "metrics.jsonl", out / run / "summary.json"
        columns: dict[str, list[float]] = {}
        if metrics.is_file():
            for line in metrics.read_text().splitlines():
                row = json.loads(line) if line.strip() else {}
                for k, v in row.items():
                    if k.startswith("timing/") and isinstance(v, int | float):
                        columns.setdefault(k.removeprefix("timing/"), []).append(float(v))
        elif summary.is_file():
            steps = json.loads(summary.read_text()).get("per_step", {}).values()
            columns["step"] = [float(s["step_time"]) for s in steps if "step_time" in s]
        if columns:
            times[run] = {k: round(sorted(v)[len(v) // 2], 4) for k, v in columns.items() if v}
    return times


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


def h2h_markdown(h: dict[str, Any]) -> str:
    reached = h["relayrl_seconds_to_trl_final"]
    ratio = h["time_ratio"]
    return (
        "| run | SFT EM | final EM | seconds | steps |\n|---|---|---|---|---|\n"
        f"| TRL + vLLM (trl_grpo) | {h['trl_sft_em']:.3f} | {h['trl_final_em']:.3f} | {h['trl_seconds']:.0f} | "
        f"{h['trl_steps']} |\n"
        f"| relayrl (grpo_vs_trl) | {h['relayrl_sft_em']:.3f} | {h['relayrl_final_em']:.3f} | "
        f"{h['relayrl_seconds']:.0f} | {h['relayrl_steps']} |\n\n"
        f"relayrl at TRL's end time: {h['relayrl_em_at_trl_end']:.3f}; relayrl first reached TRL's final "
        f"{h['trl_final_em']:.3f} at "
        + ("never" if reached is None else f"{reached:.0f} s = {ratio:.2f}x TRL's {h['trl_seconds']:.0f} s")
        + f" (target <= {H2H_TARGET}x: {'met' if h['target_met'] else 'not met'})\n"
    )


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
    """curves.png (+ h2h.png), results.md, results.json under `out`; returns the main table."""
    everything = read_curves(out)
    curves = {run: pts for run, pts in everything.items() if run not in H2H}
    h2h = head_to_head(everything)
    table = summarize(curves)
    times = step_times(out, list(everything))
    extra: dict[str, Any] = {"head_to_head": h2h, "step_times": times}
    sft = out / CONTROL / "sft.json"
    if sft.is_file():
        extra["sft"] = json.loads(sft.read_text())
    (out / "results.json").write_text(
        json.dumps({"table": table, **extra, "meta": meta or {}, "curves": everything}, indent=1, default=str)
        + "\n"
    )
    text = markdown(table)
    if "sft" in extra:
        f = extra["sft"]
        text += (
            f"\nSFT: {f.get('sft_steps')} steps in {f.get('sft_seconds')} s, stopped by "
            f"{f.get('stopped_by', 'time')}, held-out EM {f.get('sft_heldout_em')}; validation checks "
            + " ".join(f"{c['step']}:{c['val_em']:.3f}" for c in f.get("validation_checks", [])[-6:])
            + "\n"
        )
    if times:
        text += (
            "\nMedian seconds per step: "
            + "; ".join(
                f"{run} " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                for run, parts in times.items()
            )
            + "\n"
        )
    if h2h is not None:
        text += "\n" + h2h_markdown(h2h)
    (out / "results.md").write_text(text)
    try:
        if curves:
            plot(curves, out / "curves.png")
        else:
            print(f"recipe plot: no curve.jsonl under {out}; no picture", file=sys.stderr)
        pair = {run: everything[run] for run in H2H if run in everything}
        if pair:
            plot(pair, out / "h2h.png")
    except ImportError as e:
        print(f"recipe plot: no picture ({e}); the table is in {out / 'results.md'}", file=sys.stderr)
    print(text, flush=True)
    return table


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/recipes/plot.py OUT")
    meta_file = Path(sys.argv[1]) / "results.json"
    meta = json.loads(meta_file.read_text()).get("meta") if meta_file.is_file() else None
    write_results(Path(sys.argv[1]), meta)
