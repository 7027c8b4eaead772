"""The preference recipes learn, on CPU: a tiny Qwen2 (hidden 64, 2 layers, char tokenizer) on the add2 task.

A session fixture runs the demo's SFT phase (relayrl.apps.demo: 1000 SFT rows, batch 64, lr 2e-3, in
chunks of 100 steps until greedy accuracy on 200 dev rows reaches 0.3; the demo's own helpers), then each
test trains one recipe from that model and measures it on held-out rows. Prompts are disjoint pools of the task's *train* split
(make_demo_data): SFT, dev, preference training ("rl" rows) and evaluation (500 rows). The task's "test" split
only holds sums ending in 0 or 9 (see make_demo_data), which a model trained on the other split never
writes, so it would measure nothing.

Accuracy below is greedy exact match on the 500 eval prompts (the demo's `dev_accuracy`). Measured on a
2-core CPU, seed 0 / seed 1 (everything seeded by SEED: model init, data pools, pairs, training):

  SFT fixture                      800 / 300 SFT steps, eval exact match 0.464 / 0.550          24 s / 10 s
  RM (far pairs, 200 steps)        held-out pair accuracy 0.994 / 0.998 (margin 10.2 / 15.0)    5 s / 5 s
  DPO (own wrong answers, beta 2)  exact match 0.464 -> 0.630 / 0.550 -> 0.712; held-out pair
                                   accuracy 0 -> 0.822 / 0 -> 0.868, margin 0 -> 2.33 / 2.50    5 s / 7 s
  KTO (same data, unpaired)        exact match 0.464 -> 0.618 / 0.550 -> 0.764; held-out reward
                                   desirable - undesirable 0 -> 1.90 / 1.75                     8 s / 10 s
  KD (fresh student, 100 steps)    held-out KL(teacher || student) 4.16 -> 0.92 / 3.98 -> 0.70  3 s / 3 s
  PRM (far errors, 400 steps)      held-out step accuracy 0.932 / 0.965 (majority 0.517 / 0.514) 7 s / 6 s
The whole file: 52 s / 42 s on an idle machine (about twice that while other jobs share the cores).

What did not work within these budgets (and why the tests use what they use): an RM or PRM on near misses
(relayrl.tasks.preference pair_rows / step_rows: the wrong answer is 1-10 away, so the model must verify the
units digit) reach only 0.59 / 0.87 held-out pair accuracy after 400 RM steps (seeds 0 / 1), and a PRM stays
at the majority baseline (~0.53) after 1500 steps from an SFT model or a fresh one; wrong answers 20-60 away
(a wrong tens digit or length) are learned in ~150 steps. Plain DPO with the usual beta 0.1 lowers exact match (0.464 -> 0.356 with lr
3e-5, 240 steps: both sides' log-probs fall, likelihood displacement); beta 2 keeps the policy near the SFT
model and gains on every seed tried (0, 1, 2: +17, +16, +17 points). KTO with beta 0.1 (lr 1e-4 to 1e-3) lowers it too; beta 1
with lambda_D = 1.33 (inside the paper's [1, 4/3] for balanced data) gains +15, +21, +16 points.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import preference_fixtures as pf
import pytest
import torch

from relayrl.apps.demo import (
    DemoConfig,
    build_base_model,
    dev_accuracy,
    greedy_answers,
    make_demo_data,
    sft_until_target,
)
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)

pytestmark = pytest.mark.slow  # learning curves of whole DPO / KTO / RM runs

SEED = 0


# ---------------------------------------------------------------------------------------------- fixtures
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="session")
def add2(tmp_path_factory):
    """The SFT'd tiny model and the data pools: SimpleNamespace(model, tokenizer, hf, data, accuracy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("add2")
    cfg = DemoConfig(
        output_dir=str(out),
        seed=SEED,
        hidden=64,
        layers=2,
        sft_rows=1000,
        sft_steps=1500,
        sft_chunk=100,
        sft_target=0.3,
        sft_lr=2e-3,
        dev_rows=200,
        rl_rows=3000,
        eval_rows=500,
        device="cpu",
    )
    data = make_demo_data(cfg, out / "data")
    folder, _, _ = sft_until_target(cfg, build_base_model(cfg, out / "base"), data, out / "sft")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    accuracy = dev_accuracy(hf, tokenizer, data["eval"], "add2")
    return SimpleNamespace(model=folder, tokenizer=tokenizer, hf=hf, data=data, accuracy=accuracy)


@pytest.fixture(scope="session")
def own_pairs(add2, tmp_path_factory):
    """Pairs (correct answer, the SFT model's own greedy answer) on 1000 training prompts and on the eval
    prompts; where the greedy answer is right, the rejected side is a near miss instead."""
    out = tmp_path_factory.mktemp("own_pairs")
    rng = random.Random(SEED)
    files = {}
    for name, source, n in (("train", add2.data["rl"], 1000), ("eval", add2.data["eval"], None)):
        rows = _rows(source)[:n]
        part = pf.write_jsonl(out / f"{name}_prompts.jsonl", rows)
        _, answers = greedy_answers(add2.hf, add2.tokenizer, part)
        pairs = []
        for row, got in zip(rows, answers, strict=True):
            right = row["output"]
            wrong = got if got.strip() and got != right else str(pf.near_wrong(rng, int(right)))
            pairs.append({"input": row["input"], "chosen": right, "rejected": wrong})
        files[name] = pf.write_jsonl(out / f"{name}.jsonl", pairs)
    return files


def _config(model: Path, train: Path, evals: Path, out: Path, *, lr: float, steps: int) -> dict:
    """The shared sections of a recipe config: batch 32, constant lr, eval at the end only."""
    return dict(
        model=ModelConfig(name_or_path=str(model)),
        data=DataConfig(datasets=[str(train)], eval_dataset=str(evals), seed=SEED),
        optim=OptimConfig(lr=lr, warmup_steps=0, scheduler="constant"),
        train=TrainConfig(
            seed=SEED,
            batch_size=32,
            micro_batch_size=32,
            max_steps=steps,
            log_every=10,
            device="cpu",
            output_dir=str(out),
        ),
        ckpt=CkptConfig(resume="none", save_hf_model=False),
        logger=LoggerConfig(progress_bar=False),
    )


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.timeout(180)
def test_reward_model_ranks_held_out_answers(add2, tmp_path):
    """Bradley-Terry RM from the SFT model, on (correct sum, a sum 20-60 off) pairs: held-out pair accuracy
    >= 0.9 after 200 steps (measured 0.994 / 0.978 for seeds 0 / 1; 0.5 is chance)."""
    from relayrl.config.recipes import RMConfig
    from relayrl.trainers.rm import run_rm

    rng = random.Random(SEED)

    def pairs(rows: list[dict]) -> list[dict]:
        return [
            {"input": r["input"], "chosen": r["output"], "rejected": str(pf.far_wrong(rng, int(r["output"])))}
            for r in rows
        ]

    train = pf.write_jsonl(tmp_path / "train.jsonl", pairs(_rows(add2.data["rl"])[:2500]))
    evals = pf.write_jsonl(tmp_path / "eval.jsonl", pairs(_rows(add2.data["eval"])))
    result = run_rm(RMConfig(**_config(add2.model, train, evals, tmp_path / "rm", lr=1e-3, steps=200)))
    m = result.metrics
    assert m["eval/count"] == 500
    assert m["eval/acc"] >= 0.9, m
    assert m["eval/margin"] > 1.0, m


@pytest.mark.timeout(180)
def test_dpo_raises_margin_and_exact_match(add2, own_pairs, tmp_path):
    """DPO (beta 2, lr 1e-4, 240 steps of 32 pairs) on the SFT model's own wrong answers: the held-out
    implicit-reward margin goes from 0 (policy = reference at step 0) to > 1 with pair accuracy >= 0.75, and
    held-out greedy exact match rises by >= 8 points (measured 0.464 -> 0.630 / 0.550 -> 0.712, seeds 0 / 1;
    pair accuracy 0.822 / 0.868, margin 2.33 / 2.50)."""
    from relayrl.config.recipes import DPOConfig, DPOSection
    from relayrl.trainers.dpo import run_dpo

    cfg = _config(add2.model, own_pairs["train"], own_pairs["eval"], tmp_path / "dpo", lr=1e-4, steps=240)
    result = run_dpo(DPOConfig(**cfg, dpo=DPOSection(beta=2.0)))
    first, last = result.history[0], result.metrics
    assert first["train/margin"] == 0.0 and first["train/loss"] == pytest.approx(0.6931, abs=1e-4)
    assert last["eval/margin"] > 1.0 and last["eval/acc"] >= 0.75, last
    after = dev_accuracy(result.model, result.tokenizer, add2.data["eval"], "add2")
    assert after >= add2.accuracy + 0.08, (add2.accuracy, after)


@pytest.mark.timeout(180)
def test_kto_raises_reward_gap_and_exact_match(add2, own_pairs, tmp_path):
    """KTO (beta 1, lambda_D 1.33, lr 1e-4, 240 steps of 32 samples) on the same pairs read as unpaired
    feedback (each pair: one desirable, one undesirable sample): the held-out implicit reward of desirable
    answers ends above that of undesirable ones by > 0.5 (both 0 at step 0; measured 1.90 / 1.75), desirable
    above 0 (0.32 / 0.33: the desirable answers became likelier than under the reference), and held-out exact
    match rises by >= 8 points (measured 0.464 -> 0.618 / 0.550 -> 0.764, seeds 0 / 1)."""
    from relayrl.config.recipes import KTOConfig, KTOSection
    from relayrl.trainers.kto import run_kto

    cfg = _config(add2.model, own_pairs["train"], own_pairs["eval"], tmp_path / "kto", lr=1e-4, steps=240)
    result = run_kto(KTOConfig(**cfg, kto=KTOSection(beta=1.0, desirable_weight=1.33)))
    m = result.metrics
    assert m["eval/reward_desirable"] > 0.0, m
    assert m["eval/reward_desirable"] - m["eval/reward_undesirable"] > 0.5, m
    after = dev_accuracy(result.model, result.tokenizer, add2.data["eval"], "add2")
    assert after >= add2.accuracy + 0.08, (add2.accuracy, after)


def _forward_kl(student, teacher, tokenizer, rows: list[dict]) -> float:
    """Mean over held-out response tokens (answer digits and EOS) of KL(teacher || student), computed with
    plain HF forwards (independent of the recipe's chunked loss); rows of one length go in one batch."""
    from relayrl.data.templates import encode

    by_length: dict[int, list[tuple[list[int], int]]] = {}
    for row in rows:
        prompt = encode(tokenizer, row["input"])
        ids = prompt + encode(tokenizer, row["output"]) + [tokenizer.eos_token_id]
        by_length.setdefault(len(ids), []).append((ids, len(prompt)))
    total, count = 0.0, 0
    with torch.no_grad():
        for group in by_length.values():
            x = torch.tensor([ids for ids, _ in group])
            lq = torch.log_softmax(student(x).logits.double(), -1)
            lp = torch.log_softmax(teacher(x).logits.double(), -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)  # [B, T]: row t is the next-token distribution of t + 1
            for k, (ids, start) in enumerate(group):
                total += float(kl[k, start - 1 : len(ids) - 1].sum())
                count += len(ids) - start
    return total / count


@pytest.mark.timeout(180)
def test_distillation_lowers_kl_to_teacher(add2, tmp_path):
    """A fresh tiny student distilled from the SFT model (forward KL, kd.coef 0.4, lr 3e-3, 100 steps of 32
    rows): its held-out KL(teacher || student) falls >= 3x (measured 4.16 -> 0.92 / 3.98 -> 0.70, seeds
    0 / 1: 4.5x / 5.6x); the recipe's eval/kd equals the same KL computed with plain forwards (~1e-8)."""
    from transformers import AutoModelForCausalLM

    from relayrl.config.recipes import KDConfig, KDSection
    from relayrl.models.tiny import TinyModelSpec, build_tiny_model
    from relayrl.trainers.kd import run_kd

    student = build_tiny_model(add2.tokenizer, TinyModelSpec(hidden=64, layers=2, seed=SEED + 1)).eval()
    student.save_pretrained(tmp_path / "student")
    add2.tokenizer.save_pretrained(tmp_path / "student")
    held_out = _rows(add2.data["eval"])
    before = _forward_kl(student, add2.hf, add2.tokenizer, held_out)
    cfg = _config(
        tmp_path / "student", add2.data["rl"], add2.data["eval"], tmp_path / "kd", lr=3e-3, steps=100
    )
    result = run_kd(KDConfig(**cfg, kd=KDSection(teacher=str(add2.model))))
    trained = AutoModelForCausalLM.from_pretrained(result.final_model).eval()
    after = _forward_kl(trained, add2.hf, add2.tokenizer, held_out)
    assert result.metrics["eval/kd"] == pytest.approx(after, rel=1e-4)
    assert before >= 3 * after, (before, after)


@pytest.mark.timeout(180)
def test_process_reward_model_beats_majority_baseline(add2, tmp_path):
    """PRM from the SFT model on two-step sums "a+b=s1;s1+c=s2;" whose wrong steps are 20-60 off (label per
    step: is its arithmetic right), 400 steps: held-out step accuracy >= majority baseline + 0.25
    (measured 0.932 / 0.965 vs baselines 0.517 / 0.514, seeds 0 / 1)."""
    from relayrl.config.recipes import PRMConfig, PRMSection
    from relayrl.trainers.prm import run_prm

    rng = random.Random(SEED)

    def steps(rows: list[dict]) -> list[dict]:
        out = []
        for r in rows:
            a, b = (int(x) for x in r["input"][:-1].split("+"))
            c = rng.randint(1, 9)
            s1 = a + b if rng.random() < 0.5 else pf.far_wrong(rng, a + b)
            s2 = s1 + c if rng.random() < 0.5 else pf.far_wrong(rng, s1 + c)
            out.append({"input": f"{a}+{b}={s1};{s1}+{c}={s2};", "label": [s1 == a + b, s2 == s1 + c]})
        return out

    train = pf.write_jsonl(tmp_path / "train.jsonl", steps(_rows(add2.data["rl"])[:2500]))
    held_out = steps(_rows(add2.data["eval"]))
    evals = pf.write_jsonl(tmp_path / "eval.jsonl", held_out)
    labels = [y for r in held_out for y in r["label"]]
    majority = max(labels.count(True), labels.count(False)) / len(labels)
    cfg = _config(add2.model, train, evals, tmp_path / "prm", lr=1e-3, steps=400)
    result = run_prm(PRMConfig(**cfg, prm=PRMSection(placeholder=";")))
    assert result.metrics["eval/count"] == len(labels) == 1000
    assert result.metrics["eval/acc"] >= majority + 0.25, (majority, result.metrics)


@pytest.mark.timeout(240)
def test_rejection_sampling_then_sft_raises_exact_match(add2, tmp_path):
    """Rejection sampling (`relayrl generate --select rejection`: 8 samples per prompt at temperature 1, keep
    the right answers, at most 2 per prompt) then SFT on the kept samples, from the SFT model: held-out greedy
    exact match rises by >= 5 points. Measured (seed 0): 0.464 -> 0.664. The control, the same number of SFT
    steps on the original SFT rows, reached 0.622 (and with 80 steps each 0.652 against 0.620): the fixture's
    SFT model is under-trained, so most of the gain here is more training; the test does not show that
    rejection sampling beats more SFT on this task."""
    from relayrl.apps.generate import run_generate
    from relayrl.config.generate import GenerateConfig
    from relayrl.config.recipes import SFTConfig
    from relayrl.config.rl import RewardConfig, RolloutConfig
    from relayrl.trainers.sft import run_sft

    prompts = pf.write_jsonl(tmp_path / "prompts.jsonl", _rows(add2.data["rl"])[:600])
    gen = run_generate(
        GenerateConfig(
            model=ModelConfig(name_or_path=str(add2.model)),
            data=DataConfig(datasets=[str(prompts)]),
            rollout=RolloutConfig(
                n_samples=8, temperature=1.0, max_new_tokens=6, max_len=64, prompts_per_step=64
            ),
            reward=RewardConfig(source="task:add2"),
            select="rejection",
            threshold=1.0,
            max_per_prompt=2,
            output=str(tmp_path / "kept.jsonl"),
            seed=SEED,
            device="cpu",
        )
    )
    assert gen.kept > 100 and all(r["reward"] == 1.0 for r in gen.rows), gen.summary("rejection")

    def sft(data: Path, out: str) -> float:
        cfg = _config(add2.model, data, data, tmp_path / out, lr=5e-4, steps=120)
        cfg["data"] = DataConfig(datasets=[str(data)], seed=SEED)
        result = run_sft(SFTConfig(**cfg))
        return dev_accuracy(result.model, result.tokenizer, add2.data["eval"], "add2")

    after = sft(gen.output, "raft")
    control = sft(add2.data["sft"], "control")
    print(f"rejection sampling + SFT: {add2.accuracy:.3f} -> {after:.3f} (control, more SFT: {control:.3f})")
    assert after >= add2.accuracy + 0.05, (add2.accuracy, after, control)
