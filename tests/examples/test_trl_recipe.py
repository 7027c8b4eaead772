"""examples/recipes/trl_recipe.py (the recipe's GRPO through TRL): the reward and the held-out metric are the
recipe's `score` / `exact_match` over batched greedy generations, and a `--cpu-smoke` run (TRL's GRPOTrainer,
model.generate, a tiny model) writes the curve at step 0, every eval interval and the step where the training
budget ran out, with the evaluation's time left out of `t`. Skipped when TRL is not installed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("trl") is None:  # not imported here: collection stays cheap
    pytest.skip("needs TRL (pip install -e '.[bench]')", allow_module_level=True)

RECIPES = Path(__file__).parents[2] / "examples" / "recipes"
sys.path.insert(0, str(RECIPES))

import recipe_task  # noqa: E402
import trl_recipe  # noqa: E402


def _rows(n: int, seed: int) -> list[dict[str, str]]:
    return [{"prompt": r["prompt"], "answer": r["answer"]} for r in recipe_task.make_rows(n, seed)]


def test_reward_is_the_recipes_score_per_completion():
    rows = _rows(3, 0)
    right = [recipe_task.solve(*map(int, r["prompt"][:-1].split("+"))) for r in rows]
    completions = [right[0], right[1].replace("ans ", "ans 1"), right[2] + "<|im_end|>junk"]
    rewards = trl_recipe.recipe_reward(completions, answer=[r["answer"] for r in rows], trainer_state=None)
    assert rewards == [1.0, 0.0, 1.0]


class ScriptedModel(torch.nn.Module):
    """Answers each prompt with a fixed completion (padded on the right), whatever the settings."""

    def __init__(self, tok, completions: dict[str, str]) -> None:
        super().__init__()
        self.tok, self.completions, self.calls = tok, completions, []
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = SimpleNamespace(eos_token_id=tok.eos_token_id)

    def generate(self, input_ids, attention_mask, generation_config):
        assert generation_config.do_sample is False and not self.training
        self.calls.append(len(input_ids))
        prompts = self.tok.batch_decode(input_ids, skip_special_tokens=True)
        new = [[*self.tok.encode(self.completions[p]), self.tok.eos_token_id] for p in prompts]
        width = max(map(len, new))
        new = torch.tensor([ids + [self.tok.pad_token_id] * (width - len(ids)) for ids in new])
        return torch.cat([input_ids, new], dim=1)


def test_heldout_em_is_greedy_exact_match_over_every_batch(tiny_tokenizer):
    rows = _rows(5, 1)
    completions = {}
    for i, r in enumerate(rows):  # rows 0, 2, 4 right; 1, 3 wrong by one digit
        worked = recipe_task.solve(*map(int, r["prompt"][:-1].split("+")))
        completions[r["prompt"]] = worked if i % 2 == 0 else worked[:-1] + str((int(worked[-1]) + 1) % 10)
    model = ScriptedModel(tiny_tokenizer, completions)
    model.train()
    em = trl_recipe.heldout_em(model, tiny_tokenizer, rows, max_new_tokens=96, batch=2)
    assert em == pytest.approx(3 / 5, abs=0)
    assert model.calls == [2, 2, 1] and model.training  # batches of 2, train mode restored


def _work(tmp_path: Path) -> Path:
    from relayrl.models.tiny import save_tiny

    work = tmp_path / "work"
    save_tiny(work / "sft" / "final")
    (work / "data").mkdir()
    for name, rows in (("train_prompts", _rows(16, 2)), ("heldout", _rows(6, 3))):
        (work / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return work


@pytest.mark.slow
def test_cpu_smoke_run_writes_the_curve_and_stops_at_the_budget(tmp_path):
    work, out = _work(tmp_path), tmp_path / "out"
    common = ["--cpu-smoke", "--work", str(work), "--out", str(out), "--max-steps", "3"]
    summary = trl_recipe.main([*common, "--eval-seconds", "0"])  # an evaluation after every step
    curve = [json.loads(line) for line in (out / "trl_grpo" / "curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [0, 1, 2, 3]
    assert curve[0]["t"] == 0.0 and all(0.0 <= p["heldout_em"] <= 1.0 for p in curve)
    for i in range(3):  # the clock runs through each evaluation (as the recipe's relayrl runs count time)
        evaluated = curve[i]["eval_s"] - (curve[i - 1]["eval_s"] if i else 0.0)
        assert evaluated > 0 and curve[i + 1]["t"] - curve[i]["t"] >= evaluated
    assert summary["steps"] == 3 and summary["eval_s"] == curve[-1]["eval_s"]
    assert summary["train_s"] == pytest.approx(curve[-1]["t"] - curve[-1]["eval_s"], abs=1e-3)
    assert summary["trl_settings"]["num_generations"] == str(trl_recipe.SMOKE["group_size"])
    assert summary["trl_settings"]["learning_rate"] == str(recipe_task.RL_SETTINGS["learning_rate"])
    assert set(summary["per_step"]) == {1, 2, 3}

    # a budget of 0 s: the first step ends past it, is evaluated, and the run stops there (no other evaluation)
    summary = trl_recipe.main([*common, "--eval-seconds", "1e9", "--budget-s", "0"])
    curve = [json.loads(line) for line in (out / "trl_grpo" / "curve.jsonl").read_text().splitlines()]
    assert [p["step"] for p in curve] == [0, 1] and summary["steps"] == 1


def test_load_weights_copies_the_checkpoint_into_the_trainers_model_in_place(tmp_path):
    from transformers import AutoModelForCausalLM

    from relayrl.models.tiny import TinyModelSpec, save_tiny

    base = AutoModelForCausalLM.from_pretrained(save_tiny(tmp_path / "base", TinyModelSpec(seed=0)))
    sft = save_tiny(tmp_path / "sft", TinyModelSpec(seed=1))
    params = dict(base.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    trl_recipe.load_weights(base, sft)
    want = dict(AutoModelForCausalLM.from_pretrained(sft).named_parameters())
    for name, p in base.named_parameters():
        assert p is params[name]  # the same tensors (an optimizer made later sees them)
        assert torch.equal(p, want[name])
    changed = [n for n, p in base.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > len(params) // 2  # every randomly initialised one (biases start at 0 in both)
    other = save_tiny(tmp_path / "other", TinyModelSpec(hidden=48, seed=1))
    with pytest.raises(ValueError, match="shape"):
        trl_recipe.load_weights(base, other)


def test_budget_in_a_start_file():
    assert trl_recipe.budget_in("120", "f") == 120.0 and trl_recipe.budget_in("go", "f") is None
    with pytest.raises(SystemExit):
        trl_recipe.budget_in("-3", "f")


@pytest.mark.slow
def test_early_setup_builds_from_the_base_then_trains_the_sft_weights(tmp_path):
    """--start-after: the trainer is built from WORK/base once WORK/prepared exists, WORK/trl.ready is written,
    and after the start file appears (its number the budget) the SFT checkpoint's weights are trained."""
    from relayrl.models.tiny import TinyModelSpec, save_tiny

    work, out = _work(tmp_path), tmp_path / "out"
    save_tiny(work / "base", TinyModelSpec(seed=7))
    (work / "prepared").write_text("1\n")
    go = work / "trl.go"
    go.write_text("1e9\n")  # the budget: only --max-steps ends the run
    args = [
        "--cpu-smoke",
        "--work",
        str(work),
        "--out",
        str(out),
        "--max-steps",
        "1",
        "--eval-seconds",
        "1e9",
    ]
    summary = trl_recipe.main([*args, "--start-after", str(go), "--start-timeout", "5"])
    assert summary["trainer_built_from"] == str(work / "base") and summary["budget_s"] == 1e9
    assert (work / "trl.ready").is_file() and summary["steps"] == 1
    assert 0 <= summary["weights_load_s"] < 60  # the SFT weights were loaded (load_weights: the test above)
    go.write_text("abort\n")
    with pytest.raises(SystemExit) as stop:
        trl_recipe.main([*args, "--start-after", str(go), "--start-timeout", "5"])
    assert stop.value.code == 0
