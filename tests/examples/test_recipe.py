"""examples/recipes: the task contract (worked answers, reward, exact match, disjoint rows), the table's
same-time comparison with the more-SFT control, and (slow) the whole recipe at --scale tiny on CPU: every
phase runs, the curves / table / picture are written, and the SFT checkpoint meets the contract the TRL side
relies on (an HF folder AutoModelForCausalLM / AutoTokenizer load, prompts encoded as in training)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]
RECIPES = ROOT / "examples" / "recipes"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


task = _load("recipe_task")
plot = _load("plot")


def test_worked_answer_carries_and_ends_with_the_sum():
    assert task.solve(7305, 968) == "5+8=13;0+6+1=7;3+9=12;7+0+1=8;ans 8273"
    assert task.solve(999, 1) == "9+1=10;9+0+1=10;9+0+1=10;ans 1000"
    for row in task.make_rows(200, seed=3):
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["answer"] == str(int(a) + int(b))
        assert task.final_answer(row["completion"]) == row["answer"]
        assert task.MIN_DIGITS <= len(a) <= task.MAX_DIGITS and task.MIN_DIGITS <= len(b) <= task.MAX_DIGITS
        assert len(row["completion"]) + 1 <= task.MAX_NEW_TOKENS  # + the end token


def test_exact_match_grades_the_final_answer_only():
    good = "5+8=13;0+6+1=7;3+9=12;7+0+1=8;ans 8273"
    assert task.exact_match(good, "8273") and task.score(good, "8273") == 1.0
    assert task.exact_match(good + "<|im_end|>junk", "8273")  # text after the end token is ignored
    assert task.exact_match("1+1=3;ans 8273", "8273")  # the steps are not graded
    assert not task.exact_match(good, "8274") and task.score(good, "8274") == 0.0
    assert not task.exact_match("ans 82734", "8273")
    assert not task.exact_match("ans 8273 and more", "8273")
    assert not task.exact_match("8273", "8273")  # no "ans ": the format is part of the answer
    out = task.reward_func(["1+2=ans 3", "1+2=ans 4"], ["1+2=", "1+2="], ["3", "3"])
    assert out["rewards"].tolist() == [1.0, 0.0] and out["scores"].tolist() == [1.0, 0.0]


def test_rows_are_distinct_and_exclusions_hold():
    held = task.make_rows(300, seed=1)
    train = task.make_rows(2000, seed=2, exclude={r["prompt"] for r in held})
    prompts = [r["prompt"] for r in train]
    assert len(set(prompts)) == len(prompts)
    assert not set(prompts) & {r["prompt"] for r in held}
    assert task.make_rows(5, seed=2) == task.make_rows(5, seed=2)


def test_table_compares_each_run_with_the_control_at_the_same_time():
    curves = {
        "sft_control": [
            {"t": 0.0, "step": 0, "heldout_em": 0.3},
            {"t": 30.0, "step": 90, "heldout_em": 0.35},
            {"t": 61.0, "step": 180, "heldout_em": 0.5},
        ],
        "grpo": [{"t": 0.0, "step": 0, "heldout_em": 0.3}, {"t": 60.0, "step": 40, "heldout_em": 0.7}],
    }
    rows = {r["run"]: r for r in plot.summarize(curves)}
    # the control's point nearest to t = 60 is the one at 61 s (not the one at 30 s)
    assert rows["grpo"]["control_em_same_time"] == 0.5
    assert rows["grpo"]["margin_over_control"] == pytest.approx(0.2, abs=1e-12)
    assert rows["grpo"]["beats_control"] and rows["grpo"]["gain_target_met"]
    assert rows["grpo"]["gain"] == pytest.approx(0.4, abs=1e-12)
    assert "control_em_same_time" not in rows["sft_control"]
    assert "| grpo | 0.300 | 0.700 | 0.700 | +0.400 | 0.500 | +0.200 | 60 | 40 |" in plot.markdown(
        plot.summarize(curves)
    )


@pytest.mark.slow
def test_tiny_recipe_writes_curves_table_and_a_contract_checkpoint(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    cmd = [sys.executable, str(RECIPES / "recipe.py"), "all", "--scale", "tiny", "--device", "cpu"]
    proc = subprocess.run(
        [*cmd, "--work", str(work), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {"sft_control", "grpo", "ppo", "reinforce++"}
    for run in runs:
        lines = [json.loads(x) for x in (out / run / "curve.jsonl").read_text().splitlines()]
        assert len(lines) >= 2 and lines[0]["t"] <= lines[-1]["t"] and lines[0]["step"] == 0
        assert set(lines[0]) >= {"t", "step", "heldout_em"} and 0.0 <= lines[-1]["heldout_em"] <= 1.0
    results = json.loads((out / "results.json").read_text())
    assert {r["run"] for r in results["table"]} == runs
    assert (out / "curves.png").stat().st_size > 1000 and "| grpo |" in (out / "results.md").read_text()
    # the contract: an HF folder with its tokenizer; prompt / answer files
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = work / "sft" / "final"
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    heldout = [json.loads(x) for x in (work / "data" / "heldout.jsonl").read_text().splitlines()]
    train = [json.loads(x) for x in (work / "data" / "train_prompts.jsonl").read_text().splitlines()]
    assert all(set(r) == {"prompt", "answer"} for r in heldout + train)
    assert not {r["prompt"] for r in heldout} & {r["prompt"] for r in train}
    ids = tok(heldout[0]["prompt"])["input_ids"]
    assert tok.decode(ids) == heldout[0]["prompt"] and len(ids) == len(heldout[0]["prompt"])
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
