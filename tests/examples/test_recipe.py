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
sys.path.insert(0, str(RECIPES))  # recipe_scales imports recipe_task by name
scales = _load("recipe_scales")


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


def test_sft_stops_at_the_validation_target_or_a_fixed_step_count():
    full = scales.SCALES["full"]
    assert full.sft_target_em == 0.45 and full.val_rows > 0
    # checks every 25 steps from step 400; the first check at or above the target stops SFT there
    assert [s for s in range(0, 500) if full.checks_at(s)] == [400, 425, 450, 475]
    assert full.sft_stop(399, 10.0, None) is None
    assert full.sft_stop(400, 10.0, 0.449) is None and full.sft_stop(425, 10.0, 0.45) == "target"
    assert full.sft_stop(326, full.sft_seconds, None) == "time"  # the cap
    # a fixed step count replaces the target (no checks) and still has the cap
    fixed = scales.dataclasses.replace(full, sft_steps=700)
    assert not any(fixed.checks_at(s) for s in range(2000))
    assert fixed.sft_stop(699, 10.0, 0.99) is None and fixed.sft_stop(700, 10.0, None) == "steps"
    assert fixed.sft_stop(10, full.sft_seconds, None) == "time"
    with pytest.raises(ValueError, match="val_rows"):
        scales.dataclasses.replace(full, val_rows=0)
    with pytest.raises(ValueError, match="sft_target_em"):
        scales.dataclasses.replace(full, sft_target_em=1.5)


def test_command_line_picks_one_stop_rule():
    import argparse

    def args(**kw):
        base = dict(scale="full", sft_seconds=0.0, rl_seconds=0.0, eval_seconds=0.0, sft_rows=0)
        return argparse.Namespace(**{**base, "sft_steps": 0, "sft_target_em": 0.0, **kw})

    assert scales.scale_of(args()) == scales.SCALES["full"]
    s = scales.scale_of(args(sft_steps=800, eval_seconds=15.0))
    assert (s.sft_steps, s.sft_target_em, s.eval_seconds) == (800, 0.0, 15.0)
    s = scales.scale_of(args(scale="tiny", sft_target_em=0.3))
    assert (s.sft_steps, s.sft_target_em) == (0, 0.3) and s.val_rows > 0


@pytest.mark.parametrize("algo", ["grpo", "ppo", "reinforce++"])
def test_rl_runs_no_reference_and_no_old_logprob_pass_and_one_micro_batch(algo, tmp_path):
    from relayrl.algorithms.registry import needs_critic, needs_reference
    from relayrl.trainers.rl.validate import validate_rl
    from relayrl.workers.builders import exact_on_policy

    full = scales.SCALES["full"]
    cfg = validate_rl(scales.rl_config(full, tmp_path, algo, 0, "cpu"))
    a = cfg.algo
    # the presets' KL modes (grpo: loss, ppo / reinforce++: reward) would build a reference model and run its
    # forward every step even at kl_coef 0; reward-KL also forces the old-log-prob forward
    assert a.kl_mode == "none" and not needs_reference(a.kl_mode) and exact_on_policy(a)
    assert needs_critic(a.advantage) == (algo == "ppo")
    s = full.rl
    longest = s["prompts_per_step"] * s["group_size"] * (16 + s["max_new_tokens"])  # prompts <= 16 tokens
    assert a.micro_batch_tokens >= longest // 2  # a whole step in at most two micro-batches
    assert a.lam == (1.0 if algo == "ppo" else 0.95)
    assert cfg.train.output_dir == str(tmp_path / "rl" / algo)
    assert scales.rl_config(full, tmp_path, algo, 0, "cpu", "other").train.output_dir.endswith("rl/other")


def test_head_to_head_is_the_time_relayrl_first_reaches_trls_final_accuracy():
    trl = [
        {"t": 0.0, "step": 0, "heldout_em": 0.45},
        {"t": 60.0, "step": 20, "heldout_em": 0.8},
        {"t": 120.0, "step": 40, "heldout_em": 0.9},
    ]
    ours = [
        {"t": 0.0, "step": 0, "heldout_em": 0.45},
        {"t": 15.0, "step": 20, "heldout_em": 0.7},
        {"t": 45.0, "step": 60, "heldout_em": 0.9},
        {"t": 120.0, "step": 160, "heldout_em": 0.95},
    ]
    h = plot.head_to_head({"trl_grpo": trl, "grpo_vs_trl": ours, "grpo": ours})
    assert h is not None and h["relayrl_seconds_to_trl_final"] == 45.0 and h["time_ratio"] == 0.375
    assert h["target_met"] and h["relayrl_em_at_trl_end"] == 0.95
    slow = [ours[0], {"t": 100.0, "step": 9, "heldout_em": 0.9}]
    h = plot.head_to_head({"trl_grpo": trl, "grpo_vs_trl": slow})
    assert h is not None and h["time_ratio"] == pytest.approx(100 / 120, abs=1e-3) and not h["target_met"]
    never = plot.head_to_head({"trl_grpo": trl, "grpo_vs_trl": ours[:2]})
    assert never is not None and never["relayrl_seconds_to_trl_final"] is None and not never["target_met"]
    assert plot.head_to_head({"grpo": ours}) is None


def test_results_keep_the_head_to_head_out_of_the_main_table(tmp_path):
    pts = [{"t": 0.0, "step": 0, "heldout_em": 0.4}, {"t": 30.0, "step": 9, "heldout_em": 0.6}]
    for run in ("grpo", "sft_control", "trl_grpo", "grpo_vs_trl"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "curve.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pts))
    metrics = [
        {"timing/step": 1.0, "timing/update": 0.2},
        {"timing/step": 3.0, "timing/update": 0.4},
        {"timing/step": 2.0, "timing/update": 0.3},
    ]
    (tmp_path / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    summary = {"per_step": {"1": {"step_time": 2.5}, "2": {"step_time": 1.5}, "3": {"step_time": 2.0}}}
    (tmp_path / "trl_grpo" / "summary.json").write_text(json.dumps(summary))
    table = plot.write_results(tmp_path)
    assert {r["run"] for r in table} == {"grpo", "sft_control"}
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["head_to_head"]["trl_final_em"] == 0.6 and set(results["curves"]) >= {"trl_grpo"}
    assert results["step_times"]["grpo"] == {"step": 2.0, "update": 0.3}
    assert results["step_times"]["trl_grpo"] == {"step": 2.0}
    text = (tmp_path / "results.md").read_text()
    assert "| TRL + vLLM (trl_grpo) | 0.400 | 0.600 | 30 | 9 |" in text and "| grpo |" in text


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
