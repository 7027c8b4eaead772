"""Bad input to `relayrl rl`: each case gives a clear message, is counted, and the run either continues
or stops cleanly with a non-zero exit code, leaving no half-written checkpoint behind.

Cases: a reward function that raises / returns NaN / returns the wrong number of rewards; prompts over the
length limits; an empty dataset; every group filtered out; a missing model path; an unknown algorithm name.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from relayrl.config.base import ConfigWarning
from relayrl.trainers.rl.loop import main
from relayrl.training.logging import read_jsonl

DATA = Path(__file__).parents[1] / "data"

REWARD_FUNCS = {
    "raises": "def reward_func(queries, prompts, labels, **kw):\n    raise RuntimeError('reward server exploded')\n",
    "half_nan": (
        "import math\n"
        "def reward_func(queries, prompts, labels, **kw):\n"
        "    return [math.nan if i % 4 == 1 else float(len(q) % 2) for i, q in enumerate(queries)]\n"
    ),
    "wrong_length": "def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * (len(queries) + 1)\n",
    "constant": "def reward_func(queries, prompts, labels, **kw):\n    return [1.0] * len(queries)\n",
    "exits": "import sys\n\n\ndef reward_func(queries, prompts, labels, **kw):\n    sys.exit(0)\n",
    "mostly_constant": (  # every group zero-variance except those whose prompt has a 7 in it
        "def reward_func(queries, prompts, labels, **kw):\n"
        "    return [float(i % 2) if '7' in p else 1.0 for i, p in enumerate(prompts)]\n"
    ),
}


def _argv(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--model.name_or_path",
        str(model),
        "--train.output_dir",
        str(out),
        "--train.max_steps",
        "4",
        "--task.name",
        "add2",
        "--task.train_rows",
        "64",
        "--task.eval_rows",
        "0",
        "--rollout.prompts_per_step",
        "4",
        "--rollout.n_samples",
        "2",
        "--rollout.max_new_tokens",
        "4",
        "--logger.progress_bar",
        "false",
        "--ckpt.save_every",
        "1",
        *extra,
    ]


def _reward(tmp_path: Path, kind: str) -> str:
    path = tmp_path / f"{kind}.py"
    path.write_text(REWARD_FUNCS[kind])
    return str(path)


def _no_tmp_left(out: Path) -> None:
    ckpt = out / "checkpoints"
    assert not ckpt.exists() or not [p for p in ckpt.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,failure", [("raises", "exception"), ("wrong_length", "wrong_length")])
def test_reward_that_always_fails_stops_with_exit_1(tiny_model_path, tmp_path, capsys, kind, failure):
    out = tmp_path / "run"
    code = main(_argv(tiny_model_path, out, "--reward.source", _reward(tmp_path, kind)))
    err = capsys.readouterr().err
    assert code == 1
    assert "nothing to train" in err and "3 consecutive skipped step(s)" in err
    assert f"'{failure}'" in err or failure in err  # the failure kind is named
    assert not (out / "final").exists()  # no final model from a run that trained nothing
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").glob("step_*"))
    _no_tmp_left(out)


@pytest.mark.timeout(60)
def test_nan_rewards_are_counted_and_the_run_continues(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(_argv(tiny_model_path, out, "--reward.source", _reward(tmp_path, "half_nan")))
    assert code == 0, capsys.readouterr().err
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 4
    # every 4th sample's reward is NaN: with 2 samples per prompt, half of the 4 groups have one NaN
    # sample; drop_group drops those groups (2 failed, 4 dropped) and the step trains on the other 4
    for r in rows:
        assert r["rollout/failed/nan"] == r["rollout/failed"] == 2.0
        assert r["rollout/dropped"] == 4.0 and r["rollout/samples"] == 4.0
    _no_tmp_left(out)


@pytest.mark.timeout(60)
def test_every_group_filtered_out_stops_with_exit_1(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _argv(
        tiny_model_path, out, "--reward.source", _reward(tmp_path, "constant"), "--filter.enabled", "true"
    )
    code = main([*argv, "--filter.max_refills", "1"])
    err = capsys.readouterr().err
    assert code == 1
    assert "groups filtered out" in err and "filter.max_refills=1" in err
    _no_tmp_left(out)


@pytest.mark.timeout(60)
def test_prompts_over_the_length_limits_are_dropped_and_counted(tiny_model_path, tmp_path, capsys):
    rows = tmp_path / "prompts.jsonl"
    lines = ['{"input": "1+2=", "label": "3"}'] * 8 + ['{"input": "' + "9" * 40 + '", "label": "0"}'] * 2
    lines += ['{"input": "' + "1+" * 8 + '1=", "label": "9"}'] * 8
    rows.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    argv = _argv(tiny_model_path, out, "--reward.source", _reward(tmp_path, "half_nan"))
    argv = [a for a in argv if a not in ("--task.name", "add2")]
    code = main([*argv, "--data.datasets", str(rows), "--data.max_len", "20", "--rollout.max_len", "16"])
    captured = capsys.readouterr()
    assert code == 0
    assert "dropped_too_long 2" in captured.out  # data.max_len: the two 40-char prompts
    metrics = read_jsonl(out / "metrics.jsonl")
    # rollout.max_len 16 leaves the 17-token prompts no room: they fail as prompt_too_long, counted
    assert sum(r.get("rollout/failed/prompt_too_long", 0) for r in metrics) > 0


@pytest.mark.timeout(30)
def test_empty_dataset_is_a_clear_error(tiny_model_path, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    argv = [a for a in _argv(tiny_model_path, tmp_path / "run") if a not in ("--task.name", "add2")]
    code = main([*argv, "--data.datasets", str(empty), "--reward.source", _reward(tmp_path, "constant")])
    err = capsys.readouterr().err
    assert code == 1
    assert "empty" in err and str(empty) in err


@pytest.mark.timeout(30)
def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    code = main(_argv(missing, tmp_path / "run"))
    err = capsys.readouterr().err
    assert code == 1
    assert str(missing) in err and "model.name_or_path" in err


@pytest.mark.timeout(30)
def test_unknown_algorithm_name_fails_before_any_work(tiny_model_path, tmp_path, capsys):
    code = main([*_argv(tiny_model_path, tmp_path / "run"), "--algo.advantage", "grpo_typo"])
    err = capsys.readouterr().err
    assert code == 2
    assert "algo.advantage" in err and "'grpo_typo'" in err and "group_norm" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(90)
def test_filter_fractions_stay_fractions_over_refill_rounds(tiny_model_path, tmp_path):
    """Refill rounds add up group counts, and the fractions are taken of every group generated in the step, so
    they never exceed 1 (summing per-round fractions did); the refills are counted."""
    out = tmp_path / "run"
    argv = _argv(tiny_model_path, out, "--reward.source", _reward(tmp_path, "mostly_constant"))
    assert main([*argv, "--filter.enabled", "true", "--filter.max_refills", "3"]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert any(r["filter/refills"] >= 1 for r in rows)
    for r in rows:
        seen = r["filter/groups_kept"] + r["filter/groups_dropped"]
        assert 0.0 <= r["filter/zero_var_frac"] <= 1.0
        assert r["filter/zero_var_frac"] == pytest.approx(r["filter/groups_zero_var"] / seen)
        assert r["filter/refills"] == r["filter/rounds"] - 1


@pytest.mark.timeout(60)
def test_a_run_where_every_step_was_skipped_exits_1_without_a_final_model(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _argv(
        tiny_model_path, out, "--reward.source", _reward(tmp_path, "raises"), "--train.max_steps", "2"
    )
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "no update was made: all 2 step(s) of this run were skipped" in err
    assert "reward server exploded" in err
    assert not (out / "final").exists()


@pytest.mark.timeout(60)
def test_prompts_without_labels_and_a_reward_that_reads_labels_stop_before_training(
    tiny_model_path, tmp_path, capsys
):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(f'{{"prompt": "{a}+1="}}\n' for a in range(20)))  # no "label" column
    exact = tmp_path / "exact.py"
    exact.write_text(
        "def reward_func(queries, prompts, labels, **kw):\n"
        "    return [float(q[len(p):].strip() == str(l)) for q, p, l in zip(queries, prompts, labels)]\n"
    )
    base = ["--model.name_or_path", str(tiny_model_path), "--data.datasets", str(rows), "--data.input_key",
            "prompt", "--train.max_steps", "1", "--rollout.prompts_per_step", "2", "--rollout.n_samples", "2",
            "--rollout.max_new_tokens", "4", "--logger.progress_bar", "false"]  # fmt: skip
    assert main([*base, "--train.output_dir", str(tmp_path / "a"), "--reward.source", str(exact)]) == 1
    captured = capsys.readouterr()
    assert "no_label 20" in captured.out  # the data summary counts them
    assert "none of the 20 training prompts has a label" in captured.err and "reads `labels`" in captured.err
    assert not (tmp_path / "a/metrics.jsonl").exists()
    # a reward that does not read labels trains as before
    digits = str(DATA / "digit_reward.py")
    assert main([*base, "--train.output_dir", str(tmp_path / "b"), "--reward.source", digits]) == 0


@pytest.mark.timeout(60)
def test_max_steps_default_is_one_pass_over_the_prompts(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _argv(
        tiny_model_path, out, "--reward.source", str(DATA / "digit_reward.py"), "--task.train_rows", "10"
    )
    argv[argv.index("--train.max_steps") + 1] = "0"  # the default
    assert main(argv) == 0
    assert "one pass over the 10 training prompts: 3 steps of 4 prompts" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.timeout(60)
def test_rerunning_a_finished_run_says_it_is_complete(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _argv(
        tiny_model_path, out, "--reward.source", str(DATA / "digit_reward.py"), "--train.max_steps", "2"
    )
    # 4 samples per prompt: the 2 of _argv drew no digit in any group under this seed (every advantage 0: a
    # run with nothing to learn, which ends with exit code 1)
    argv[argv.index("--rollout.n_samples") + 1] = "4"
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 0
    said = capsys.readouterr().out
    assert "already complete at step 2" in said and "--train.max_steps" in said
    assert len(read_jsonl(out / "metrics.jsonl")) == 2


@pytest.mark.timeout(60)
def test_greedy_sampling_with_group_baselines_warns_and_stops_with_nothing_to_learn(
    tiny_model_path, tmp_path, capsys
):
    # temperature 0 makes a prompt's samples identical: every group's rewards are equal, every advantage 0,
    # loss 0 at every step; the run used to exit 0 with a "final" model equal to the starting one
    out = tmp_path / "run"
    argv = _argv(
        tiny_model_path, out, "--algo.preset", "grpo", "--rollout.temperature", "0", "--train.max_steps", "2"
    )
    with pytest.warns(ConfigWarning, match=r"rollout.temperature 0 \(greedy\) with 2 samples per prompt"):
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 1
    assert "nothing to learn: no step of the run had a non-zero advantage (group_norm" in err
    assert len(read_jsonl(out / "metrics.jsonl")) == 2  # the steps ran (and were logged): none had a signal
    assert not (out / "final").exists()


@pytest.mark.timeout(60)
def test_reward_file_calling_sys_exit_stops_the_run_with_an_error(tiny_model_path, tmp_path, capsys):
    # it used to end the process with exit 0: no checkpoint, no final/, empty metrics, nothing printed
    out = tmp_path / "run"
    reward = _reward(tmp_path, "exits")
    assert main(_argv(tiny_model_path, out, "--reward.source", reward, "--train.max_steps", "2")) == 1
    err = capsys.readouterr().err
    assert f"reward_func in reward file '{reward}' called sys.exit(0) at {reward}, line 5" in err
    assert not (out / "final").exists()
