"""`relayrl generate`: sampling, scoring, the five selections, failure counting, reproducibility, the output
contract (rows `relayrl sft` and the preference keys read) and config errors. Tiny local model, CPU."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.apps.generate import (
    SELECTORS,
    GenerateConfig,
    SelectOptions,
    main,
    run_generate,
    write_jsonl_atomic,
)
from relayrl.config.components import DataConfig, ModelConfig
from relayrl.config.rl import RewardConfig, RolloutConfig, TaskConfig
from relayrl.data.records import PromptSample

# The fraction of response characters with an even code point: spread over [0, 1] for a random model, so
# prompts have distinct best and worst samples. Labels must reach the function (it checks them).
EVEN_REWARD = """
def reward_func(queries, prompts, labels, responses):
    assert all(label is not None for label in labels)
    return [sum(ord(c) % 2 == 0 for c in r) / max(1, len(r)) for r in responses]
"""

# Raises for a batch whose label is a multiple of 3, returns NaN for labels = 1 mod 3, else the even reward.
FLAKY_REWARD = """
def reward_func(queries, prompts, labels, responses):
    if any(int(label) % 3 == 0 for label in labels):
        raise ValueError("cannot score this one")
    return [float("nan") if int(label) % 3 == 1 else sum(ord(c) % 2 == 0 for c in r) / max(1, len(r))
            for r, label in zip(responses, labels)]
"""


def even(text: str) -> float:
    return sum(ord(c) % 2 == 0 for c in text) / max(1, len(text))


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def config(model_path: Path, out: Path, **kw) -> GenerateConfig:
    """6 add2 prompts x 4 samples of 6 tokens."""
    base = GenerateConfig(
        model=ModelConfig(name_or_path=str(model_path)),
        task=TaskConfig(name="add2", train_rows=6),
        rollout=RolloutConfig(n_samples=4, max_new_tokens=6, max_len=64),
        output=str(out),
        seed=0,
        device="cpu",
    )
    return replace(base, **kw)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_prompt(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        out[r["input"]].append(r)
    return out


# ---------------------------------------------------------------------------------------------- selections
def test_every_select_mode_against_the_all_file(tiny_model_path, tmp_path):
    """Same seed -> same samples, so each mode's rows are checked against the `all` file of the run."""
    reward = RewardConfig(source=write(tmp_path / "even.py", EVEN_REWARD))
    runs = {
        mode: run_generate(
            config(tiny_model_path, tmp_path / f"{mode}.jsonl", reward=reward, select=mode, **kw)
        )
        for mode, kw in [
            ("all", {}),
            ("best_of_n", {}),
            ("rejection", {"threshold": 0.5, "max_per_prompt": 2}),
            ("pairs", {}),
            ("conditional", {}),
        ]
    }
    everything = runs["all"]
    assert (everything.prompts, everything.samples, everything.scored, everything.failed) == (6, 24, 24, 0)
    rows = read_rows(tmp_path / "all.jsonl")
    assert rows == everything.rows and len(rows) == 24 - everything.empty
    for r in rows:
        assert set(r) == {"input", "output", "reward", "label"}
        assert r["reward"] == pytest.approx(even(r["output"]), abs=1e-12)
        a, b = r["input"].removesuffix("=").split("+")
        assert int(a) + int(b) == int(r["label"])
    groups = by_prompt(rows)
    assert len(groups) == 6

    best = read_rows(tmp_path / "best_of_n.jsonl")
    assert best == [max(g, key=lambda r: r["reward"]) for g in groups.values()]

    kept = read_rows(tmp_path / "rejection.jsonl")
    expected = []
    for g in groups.values():
        expected += sorted((r for r in g if r["reward"] >= 0.5), key=lambda r: -r["reward"])[:2]
    assert kept == expected and runs["rejection"].kept == len(expected) > 0

    pairs = read_rows(tmp_path / "pairs.jsonl")
    want, ties = [], 0
    for prompt, g in groups.items():
        hi, lo = max(g, key=lambda r: r["reward"]), min(g, key=lambda r: r["reward"])
        if hi["reward"] == lo["reward"]:
            ties += 1
            continue
        want.append({"input": prompt, "chosen": hi["output"], "rejected": lo["output"],
                     "chosen_reward": hi["reward"], "rejected_reward": lo["reward"], "label": hi["label"]})  # fmt: skip
    assert pairs == want and len(pairs) >= 4 and runs["pairs"].ties == ties

    conditional = read_rows(tmp_path / "conditional.jsonl")
    assert conditional == [{**r, "input": f"<rm_score>: {r['reward']:.1f} {r['input']}"} for r in rows]


def _traj(index: int, text: str, reward: float | None, status=TrajectoryStatus.OK) -> Trajectory:
    sample = PromptSample(index=index, prompt=f"p{index}", prompt_ids=[1], label=None)
    return Trajectory(sample=sample, token_ids=[1, 2], action_mask=[False, True], rollout_logprobs=[0.0, -1.0],
                      reward=reward, status=status, response_text=text, failure_kind=None if reward is not None or status == TrajectoryStatus.OK else "nan")  # fmt: skip


def test_selectors_on_hand_built_groups():
    """Ties go to the first sample; failed and empty samples are never selected; equal best and worst = tie."""
    failed = _traj(0, "boom", None, TrajectoryStatus.FAILED)
    groups = [
        [_traj(0, "a", 0.2), _traj(0, "b", 0.9), _traj(0, "c", 0.9), failed, _traj(0, " ", 5.0)],
        [_traj(1, "x", 0.4), _traj(1, "y", 0.4)],
        [_traj(2, "only", 1.0)],
    ]
    opts = SelectOptions(scored=True, threshold=0.4, max_per_prompt=0)
    outputs = {name: [(r["input"], r.get("output"), r.get("reward")) for r in fn(groups, opts).rows]
               for name, fn in SELECTORS.items() if name != "pairs"}  # fmt: skip
    assert outputs["best_of_n"] == [("p0", "b", 0.9), ("p1", "x", 0.4), ("p2", "only", 1.0)]
    assert outputs["rejection"] == [("p0", "b", 0.9), ("p0", "c", 0.9), ("p1", "x", 0.4), ("p1", "y", 0.4),
                                    ("p2", "only", 1.0)]  # fmt: skip
    assert outputs["all"][3] == ("p0", "boom", None)  # written, marked; the whitespace response is not
    assert SELECTORS["all"](groups, opts).rows[3]["failure"] == "nan" and len(outputs["all"]) == 7
    capped = SELECTORS["rejection"](groups, replace(opts, max_per_prompt=1, threshold=0.5)).rows
    assert [(r["input"], r["output"]) for r in capped] == [("p0", "b"), ("p2", "only")]
    pairs = SELECTORS["pairs"](groups, opts)
    assert pairs.ties == 2  # p1 (0.4 == 0.4) and p2 (a single sample)
    assert pairs.rows == [
        {"input": "p0", "chosen": "b", "rejected": "a", "chosen_reward": 0.9, "rejected_reward": 0.2}
    ]
    assert [r["input"] for r in SELECTORS["conditional"](groups, opts).rows][:2] == [
        "<rm_score>: 0.2 p0",
        "<rm_score>: 0.9 p0",
    ]


def test_task_reward_through_the_command_line(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "best.jsonl"
    argv = ["--model.name_or_path", str(tiny_model_path), "--task.name", "add2", "--task.train_rows", "8",
            "--rollout.n_samples", "4", "--rollout.max_new_tokens", "6", "--rollout.max_len", "64",
            "--select", "best_of_n", "--device", "cpu", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.startswith("relayrl generate: 8 prompts, 32 samples, 32 scored, 0 failed, ")
    assert "kept [best_of_n]" in said and "tokens/s" in said and str(out) in said
    rows = read_rows(out)
    assert len(rows) == int(said.split(" kept")[0].split(", ")[-1])
    for r in rows:  # the task's exact-match reward against the row's label
        assert r["reward"] == (1.0 if r["output"].strip() == r["label"] else 0.0) and r["input"].endswith("=")
    saved = (tmp_path / "best.config.yaml").read_text()
    assert "select: best_of_n" in saved and "n_samples: 4" in saved
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.config.yaml",
        "best.jsonl",
    ]  # no temp file left


# ---------------------------------------------------------------------------------------------- failures
def test_failing_reward_is_counted_and_marked_never_zeroed(tiny_model_path, tmp_path):
    from relayrl.tasks import get_task

    reward = RewardConfig(source=write(tmp_path / "flaky.py", FLAKY_REWARD))
    cfg = config(
        tiny_model_path, tmp_path / "all.jsonl", reward=reward, task=TaskConfig(name="add2", train_rows=9)
    )
    result = run_generate(cfg)
    labels = [int(r["label"]) for r in get_task("add2").make_rows("train", 9, cfg.data.seed)]
    raising, nan = sum(v % 3 == 0 for v in labels), sum(v % 3 == 1 for v in labels)
    assert raising > 0 and nan > 0 and raising + nan < 9
    assert result.failures == {"exception": 4 * raising, "nan": 4 * nan}
    assert result.failed == 4 * (raising + nan) and result.scored == 36 - result.failed
    for r in read_rows(tmp_path / "all.jsonl"):
        kind = {0: "exception", 1: "nan"}.get(int(r["label"]) % 3)
        if kind is None:
            assert r["reward"] == pytest.approx(even(r["output"])) and "failure" not in r
        else:  # written by `all`, marked, no reward
            assert r["reward"] is None and r["failure"] == kind
    best = run_generate(replace(cfg, select="best_of_n", output=str(tmp_path / "best.jsonl")))
    assert best.failed == result.failed
    assert {int(r["label"]) % 3 for r in best.rows} == {2} and len(best.rows) == 9 - raising - nan


def test_reward_file_calling_sys_exit_fails_the_command(tiny_model_path, tmp_path, capsys):
    # before: exit 0, nothing printed, nothing written
    reward = write(
        tmp_path / "quits.py", "import sys\n\n\ndef reward_func(queries, prompts, labels):\n    sys.exit(0)\n"
    )
    out = tmp_path / "o.jsonl"
    argv = ["--model.name_or_path", str(tiny_model_path), "--task.name", "add2", "--task.train_rows", "2",
            "--rollout.n_samples", "2", "--rollout.max_new_tokens", "3", "--rollout.max_len", "64",
            "--reward.source", reward, "--device", "cpu", "--output", str(out)]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"reward_func in reward file '{reward}' called sys.exit(0) at {reward}, line 5" in err
    assert not out.exists()


def test_output_over_an_input_is_refused(tmp_path, capsys):
    data = write(tmp_path / "p.jsonl", '{"input": "1+1=", "label": "2"}\n')
    argv = ["--model.name_or_path", str(tmp_path), "--data.datasets", data]
    for output in (data, str(tmp_path / "." / "p.jsonl")):
        assert main([*argv, "--output", output]) == 2
        err = capsys.readouterr().err
        assert f"output: {output} is also an input (data.datasets[0])" in err
    folder_argv = ["--model.name_or_path", str(tmp_path), "--data.datasets", str(tmp_path)]
    assert main([*folder_argv, "--output", data]) == 2
    assert "is also an input (data.datasets[0] (a file of the folder))" in capsys.readouterr().err
    assert (tmp_path / "p.jsonl").read_text() == '{"input": "1+1=", "label": "2"}\n'


# ---------------------------------------------------------------------------------------------- output
def test_same_seed_writes_the_same_file(tiny_model_path, tmp_path):
    """Data-file prompts without labels or a reward: rows are {input, output}; a seed fixes the file."""
    data = DataConfig(
        datasets=[write(tmp_path / "p.jsonl", "".join(f'{{"input": "{i}*{i}="}}\n' for i in range(5)))]
    )
    outs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"]
    for out, seed in zip(outs, (7, 7, 8), strict=True):
        result = run_generate(config(tiny_model_path, out, seed=seed, data=data, task=TaskConfig()))
        assert (result.prompts, result.samples, result.scored) == (5, 20, 0)
    assert outs[0].read_bytes() == outs[1].read_bytes()
    assert outs[0].read_bytes() != outs[2].read_bytes()
    assert all(set(r) == {"input", "output"} for r in read_rows(outs[0]))


def test_pairs_rows_read_with_the_data_config_keys(tiny_model_path, tmp_path):
    from relayrl.data.loading import load_source

    reward = RewardConfig(source=write(tmp_path / "even.py", EVEN_REWARD))
    out = tmp_path / "pairs.jsonl"
    result = run_generate(config(tiny_model_path, out, reward=reward, select="pairs"))
    rows, bad = load_source(str(out))
    keys = DataConfig()
    assert bad == 0 and len(rows) == result.kept > 0 and result.kept + result.ties == 6
    for row in rows:
        prompt, chosen, rejected = (row.data[k] for k in (keys.input_key, keys.chosen_key, keys.rejected_key))
        assert all(isinstance(x, str) and x.strip() for x in (prompt, chosen, rejected))
        assert row.data["chosen_reward"] > row.data["rejected_reward"]
        assert row.data["chosen_reward"] == pytest.approx(even(chosen))


def test_chat_prompts_feed_the_sft_data_builder(tiny_model_path, tiny_tokenizer, tmp_path):
    """A data file rendered with the chat template: `all`, `rejection` and `conditional` rows build SFT
    samples with the default data flags (the input is the rendered prompt); `conditional` puts the reward in
    the user turn."""
    from relayrl.data.build import build_sft_data
    from relayrl.data.templates import encode, render_chat

    qs = ["What is 2+3?", "Name a color.", "Say hi."]
    prompts = write(tmp_path / "q.jsonl", "".join(json.dumps({"question": q, "label": str(i)}) + "\n" for i, q in enumerate(qs)))  # fmt: skip
    data = DataConfig(datasets=[prompts], input_key="question", apply_chat_template=True)
    reward = RewardConfig(source=write(tmp_path / "even.py", EVEN_REWARD))
    base = config(tiny_model_path, tmp_path / "all.jsonl", data=data, task=TaskConfig(), reward=reward)
    base = replace(base, rollout=replace(base.rollout, max_new_tokens=10))
    results = {m: run_generate(replace(base, select=m, output=str(tmp_path / f"{m}.jsonl")))
               for m in ("all", "rejection", "conditional")}  # fmt: skip
    for mode in ("all", "rejection", "conditional"):
        rows = results[mode].rows
        train, _, _ = build_sft_data(DataConfig(datasets=[str(tmp_path / f"{mode}.jsonl")]), tiny_tokenizer)
        assert len(train) == len(rows) > 0
        for r, s in zip(rows, train, strict=True):
            assert r["input"].startswith("<|im_start|>user\n") and r["input"].endswith("assistant\n")
            ids = encode(tiny_tokenizer, r["input"] + r["output"])
            assert s.input_ids == [*ids, tiny_tokenizer.eos_token_id]  # prompt + response + EOS, as generated
    for r in results["conditional"].rows:
        q = qs[int(r["label"])]
        user = {"role": "user", "content": f"<rm_score>: {r['reward']:.1f} {q}"}
        assert r["input"] == render_chat(tiny_tokenizer, [user], add_generation_prompt=True)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    out = tmp_path / "rows.jsonl"
    write_jsonl_atomic(out, [{"input": "a", "output": "b"}])
    with pytest.raises(TypeError):
        write_jsonl_atomic(out, [{"input": "c", "output": "d"}, {"input": object()}])
    assert read_rows(out) == [{"input": "a", "output": "b"}]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


# ---------------------------------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--select", "best_of_n"], "select: 'best_of_n' ranks samples by reward"),
        (["--select", "pairs", "--task.name", "add2", "--rollout.n_samples", "1"], "rollout.n_samples"),
        (["--select", "conditional", "--condition_template", "{input} only"], "condition_template"),
        (["--select", "best"], "'best' is not a valid choice"),
        (["--rollout.engine", "fast"], "rollout.engine: 'fast' is not known"),
        (["--rollout.agent", "multi"], "rollout.agent"),
        (["--max_per_prompt", "-1"], "max_per_prompt: -1 is invalid"),
        (["--rollout.top_p", "0"], "rollout.top_p: 0.0 is invalid; expected a float in (0, 1]"),
        (["--output", ""], "output: required"),
    ],
)
def test_config_errors_name_the_field(tmp_path, capsys, flags, message):
    data = write(tmp_path / "p.jsonl", '{"input": "1+1=", "label": "2"}\n')
    argv = [
        "--model.name_or_path",
        str(tmp_path),
        "--data.datasets",
        data,
        "--output",
        str(tmp_path / "o.jsonl"),
    ]
    assert main(argv + flags) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_settings_without_effect_warn(tmp_path):
    from relayrl.apps.generate import validate_generate_config
    from relayrl.config.base import ConfigWarning

    cfg = config(
        tmp_path, tmp_path / "o.jsonl", threshold=0.9, reward=RewardConfig(source="task:add2", clip=1.0)
    )
    with pytest.warns(ConfigWarning) as seen:
        validate_generate_config(cfg)
    said = [str(w.message) for w in seen]
    assert said == [
        "reward.clip has no effect: generate writes raw rewards",
        "threshold has no effect: select='all'",
    ]


def test_a_model_in_memory_gives_the_folder_result(tiny_model_path, tiny_model, tiny_tokenizer, tmp_path):
    """Iterative DPO passes its policy: no model folder needed, the same samples as the saved copy (same
    weights and vocabulary; add2 prompts have no spaces, which the reloaded tiny tokenizer would drop), and the
    caller's global RNG is left alone."""
    import torch

    from_folder = run_generate(config(tiny_model_path, tmp_path / "a.jsonl", select="best_of_n"))
    state = torch.get_rng_state()
    cfg = config(tmp_path, tmp_path / "b.jsonl", select="best_of_n", model=ModelConfig())
    in_memory = run_generate(cfg, model=tiny_model.eval(), tokenizer=tiny_tokenizer)
    assert in_memory.rows == from_folder.rows and len(in_memory.rows) == 6
    assert torch.equal(torch.get_rng_state(), state)
