# pyright: reportMissingImports=false
# (bench/ is put on sys.path at run time, below)
"""bench/exact_mode.py on the CPU: the smoke run's correctness line (exact vs default logits) and summary, and
its RL part's comparison: ONE model (same vocabulary) for both modes, per-token ratios, the equal-tokens flag.

The GPU run of 10:17 compared the modes on different models: bench/rl_step.py's build_model popped
`vocab_size` out of its shared shape table, so the second mode's model got the char tokenizer's ~100-row
vocabulary (samples ended at EOS 2.4x sooner, step time 1.03x "for free")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import exact_mode  # noqa: E402
import rl_step  # noqa: E402

SHAPE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, vocab_size=1000)  # fmt: skip


def test_rl_step_builds_the_same_model_every_time(tmp_path, monkeypatch):
    monkeypatch.setitem(rl_step.SHAPES, "probe", (dict(SHAPE), "fp32", 2, 2, 4, 512))
    for i in range(2):
        folder = rl_step.build_model("probe", tmp_path / str(i))
        assert json.loads((folder / "config.json").read_text())["vocab_size"] == 1000
    assert rl_step.SHAPES["probe"][0] == SHAPE  # the table is left as it was


def test_rl_part_runs_both_modes_on_one_model_and_reports_per_token(tmp_path, monkeypatch):
    monkeypatch.setitem(rl_step.SHAPES, "probe", (dict(SHAPE), "fp32", 2, 2, 4, 512))
    seen = []

    def fake_run(
        device, shape, steps, *, exact, model_dir
    ):  # rl_step.run's result, with fewer tokens in exact
        seen.append(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
        tokens = 500.0 if exact else 1000.0
        return {"seconds": {"generation": 1.0, "update": 2.0, "step": 3.0}, "gen_tokens_per_step": tokens,
                "train_tokens_per_s": 100.0, "per_step": [], "peak_mem_gib": 0.0, "gen_tokens_per_s": tokens}  # fmt: skip

    monkeypatch.setattr(rl_step, "run", fake_run)
    args = exact_mode.argparse.Namespace(device="cpu", shape="probe", rl_steps=2)
    row: dict = {}
    exact_mode.rl_steps(args, row, lambda: None)
    assert seen == [1000, 1000]
    rl = row["rl_step"]
    assert rl["exact_over_default"]["step"] == 1.0 and rl["exact_over_default"]["step_per_gen_token"] == 2.0
    assert rl["equal_tokens"] is False


def test_cpu_smoke_run_compares_exact_and_default_logits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    exact_mode.main(["--prompts", "2", "--n", "2", "--new-tokens", "4", "--micro-seqs", "4"])
    row = json.loads((tmp_path / "exact_mode.json").read_text())["cpu/tiny"]
    assert row["bit_equal"] and row["exact"]["mismatch_max"] == 0.0
    lg = row["logits"]
    assert lg["max_abs_diff"] <= 1e-5 and abs(lg["kl_mean"]) <= 1e-6  # fp32: rounding only
    assert abs(lg["p_id1_exact"] - lg["p_id1_default"]) <= 1e-4 * lg["p_id1_default"]
    out = capsys.readouterr().out
    assert "[phases]" in out and "[mismatch]" in out and "[logits] exact vs default" in out
