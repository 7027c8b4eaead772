"""The demo's figures in README.md and docs/rl.md are the ones bench/demo.py recorded, with today's defaults.

bench/demo.py runs `relayrl demo` per seed and writes bench/results/demo.json (accuracies, gain, step counts,
CPU seconds, and the DemoConfig defaults it ran with). This test fails when a default changes without the
bench being rerun, or when the README / docs quote figures the recorded run did not produce. It runs nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from relayrl.config.apps import DemoConfig

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "demo.json"


def _report() -> dict:
    return json.loads(RESULTS.read_text())


def _default_row(report: dict) -> dict:
    rows = {r["seed"]: r for r in report["rows"]}
    return rows[DemoConfig().seed]


def test_recorded_demo_ran_with_todays_defaults():
    report = _report()
    today = asdict(DemoConfig())
    today.pop("output_dir")
    assert report["demo_args"] == [], "the recorded run passed extra flags: it is not `make demo`"
    assert report["defaults"] == today, "DemoConfig's defaults changed: rerun `python bench/demo.py`"


def test_readme_and_docs_quote_the_recorded_default_seed_run():
    row = _default_row(_report())
    gain = row["accuracy_rl"] - row["accuracy_sft"]
    headline = (
        f"{row['accuracy_sft']:.3f} after SFT -> {row['accuracy_rl']:.3f} after {row['rl_steps']} GRPO steps "
        f"(+{gain:.3f})"
    )
    cpu = f"{row['cpu_s']:.0f} s of CPU time in all (SFT {row['cpu_sft_s']:.0f} s, RL {row['cpu_rl_s']:.0f} s"
    for doc in ("README.md", "docs/rl.md"):
        text = " ".join((ROOT / doc).read_text().split())  # line breaks inside a sentence count as spaces
        assert headline in text, f"{doc} does not quote bench/results/demo.json's seed-0 figures: {headline}"
        assert cpu in text, f"{doc} does not quote the recorded CPU time: {cpu}"


def test_docs_table_lists_every_recorded_seed():
    text = (ROOT / "docs" / "rl.md").read_text()
    for row in _report()["rows"]:
        gain = row["accuracy_rl"] - row["accuracy_sft"]
        line = (
            f"| {row['seed']}{' (default)' if row['seed'] == DemoConfig().seed else ''} | "
            f"{row['sft_steps']} ({row['dev_accuracy_sft']:.3f}) | {row['accuracy_sft']:.3f} | "
            f"{row['accuracy_rl']:.3f} | **{gain:+.3f}** | {row['rl_steps']} | {row['cpu_s']:.0f} s |"
        )
        assert line in text, f"docs/rl.md lacks the recorded row of seed {row['seed']}: {line}"
