"""`relayrl rm / dpo / kto / kd / prm` from the command line on the tiny model (CPU, a few steps each): run
folders and metrics, exact resume, the reward model's statistics and their use by `relayrl rl`, serving the
trained reward model, LoRA, and the error contract (config error: exit 2; data error: exit 1 naming
file, line and key)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import preference_fixtures as pf
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from relayrl.cli import main as cli_main
from relayrl.training.logging import read_jsonl

VOLATILE = ("time", "perf/", "timing/")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return pf.small_data(tmp_path_factory.mktemp("prefdata"))


def _stable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


# ---------------------------------------------------------------------------------------------- each recipe
RECIPES = {
    # command: (data file, extra flags, the recipe's own metrics)
    "rm": ("pairs", [], ["acc", "chosen_reward", "rejected_reward", "margin"]),
    "dpo": (
        "pairs",
        [],
        ["acc", "chosen_reward", "rejected_reward", "margin", "chosen_logp", "rejected_logp", "nll"],
    ),
    "kto": ("unpaired", [], ["reward_desirable", "reward_undesirable", "kl"]),
    "kd": ("sft", ["--kd.teacher", "TEACHER"], ["kd", "ce"]),
    "prm": ("steps", ["--prm.placeholder", ";"], ["acc", "p_good"]),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", sorted(RECIPES))
def test_recipe_runs_from_the_cli(command, data, tiny_model_path, tmp_path, capsys):
    """3 steps of 4 rows with an eval at steps 2 and 3: exit 0, the end-of-run lines, one metrics row per
    step carrying the recipe's train/ and eval/ metrics, the recipe's section in config.yaml, and a final/
    folder that from_pretrained loads (a sequence-classification model with one label for rm, a causal LM
    otherwise) with weights the run changed."""
    kind, extra, metrics = RECIPES[command]
    extra = [str(tiny_model_path) if x == "TEACHER" else x for x in extra]
    out = tmp_path / "run"
    argv = pf.cli_args(tiny_model_path, data[kind], out, "--train.max_steps", "3", "--train.eval_every", "2")
    assert cli_main([command, *argv, *extra]) == 0
    stdout = capsys.readouterr().out
    assert f"{command} done: 3 steps" in stdout
    assert f"relayrl {command}: final model in {out / 'final'}" in stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 3]
    for name in ["loss", *metrics]:
        assert all(math.isfinite(r[f"train/{name}"]) for r in rows), name
        assert math.isfinite(rows[-1][f"eval/{name}"]), name
    assert command in yaml.safe_load((out / "config.yaml").read_text())
    loader = AutoModelForSequenceClassification if command == "rm" else AutoModelForCausalLM
    final = loader.from_pretrained(out / "final")
    if command == "rm":
        assert final.config.num_labels == 1 and final.score.weight.shape == (1, final.config.hidden_size)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_path).model.embed_tokens.weight
    assert not torch.equal(start, final.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------- resume
@pytest.mark.slow  # three DPO runs (interrupted, resumed, straight through)
@pytest.mark.timeout(180)
def test_dpo_resume_is_bit_identical(data, tiny_model_path, tmp_path):
    """A 4-step dpo run (checkpoint every 2 steps) against two interrupted ones: (a) the process died before
    its step-4 checkpoint was complete (step_4 and final/ removed, latest -> step_2, the metrics rows of
    steps 3-4 left behind) and the same command is rerun;
    (b) a run of --train.max_steps 2 is continued with --train.max_steps 4 (allowed: a resumable field; the
    constant schedule makes the lr the same). Both end with the same per-step metrics (every key but
    timings, compared exactly) and bit-identical final weights; the reference log-probs are recomputed from
    the reference model on resume, so they are the same too."""

    def argv(out: Path, steps: int) -> list[str]:
        return ["dpo", *pf.cli_args(tiny_model_path, data["pairs"], out, "--train.max_steps", str(steps),
                "--ckpt.save_every", "2", "--ckpt.keep_last", "0", "--train.eval_every", "1")]  # fmt: skip

    full = tmp_path / "full"
    assert cli_main(argv(full, 4)) == 0
    reference = _stable(read_jsonl(full / "metrics.jsonl"))
    weights = load_file(full / "final" / "model.safetensors")

    crashed = tmp_path / "crashed"
    shutil.copytree(full, crashed)
    shutil.rmtree(crashed / "checkpoints" / "step_4")
    shutil.rmtree(crashed / "final")
    (crashed / "checkpoints" / "latest").write_text("step_2\n")
    assert cli_main(argv(crashed, 4)) == 0

    extended = tmp_path / "extended"
    assert cli_main(argv(extended, 2)) == 0
    assert cli_main(argv(extended, 4)) == 0

    assert [r["step"] for r in reference] == [1, 2, 3, 4]
    assert reference[-1]["train/margin"] != 0.0  # the steps moved the policy away from the reference
    for name, run in (("crashed", crashed), ("extended", extended)):
        assert _stable(read_jsonl(run / "metrics.jsonl")) == reference, name
        again = load_file(run / "final" / "model.safetensors")
        assert again.keys() == weights.keys()
        for k, v in weights.items():
            assert torch.equal(v, again[k]), f"{name}: {k}"


# ---------------------------------------------------------------------------------------------- reward model
@pytest.fixture(scope="module")
def rm_run(data, tiny_model_path, tmp_path_factory):
    """One `relayrl rm` run of 3 steps: (argv without the command, run folder, stdout)."""
    out = tmp_path_factory.mktemp("rm") / "run"
    argv = pf.cli_args(tiny_model_path, data["pairs"], out, "--train.max_steps", "3")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert cli_main(["rm", *argv]) == 0
    return argv, out, stdout.getvalue()


def _pair_data(argv: list[str]) -> tuple[list, list]:
    """(train, eval) pairs as the rm command built them (same config, same held-out split)."""
    from relayrl.config.command_line import parse_cli
    from relayrl.config.recipes import RMConfig
    from relayrl.data.preference import build_pair_data
    from relayrl.models.loading import load_tokenizer

    cfg = parse_cli(RMConfig, argv)
    train, evals, _ = build_pair_data(cfg.data, load_tokenizer(cfg.model.name_or_path), log=lambda _: None)
    return train, evals


def _sides(pairs: list) -> list[list[int]]:
    """Token ids of the chosen sides, then of the rejected sides."""
    return [list(p.chosen.input_ids) for p in pairs] + [list(p.rejected.input_ids) for p in pairs]


def _trainer_scores(folder: Path, seqs: list[list[int]]) -> list[float]:
    """The rm recipe's own reward: the value head at each sequence's last token (forward.token_values +
    pairs.last_token, what rm_loss uses), on the saved model."""
    from relayrl.models.forward import token_values
    from relayrl.trainers.pairs import last_token

    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    ids = [torch.tensor(s) for s in seqs]
    with torch.no_grad():
        return last_token(token_values(model, ids, "padded"), ids).tolist()


def test_rm_statistics_match_a_recomputation(rm_run):
    """final/config.json holds reward_mean / reward_std: the mean and (population) std of the trained
    model's reward over both sides of every training pair, recomputed here from the saved model."""
    argv, out, stdout = rm_run
    config = json.loads((out / "final" / "config.json").read_text())
    train, _ = _pair_data(argv)
    scores = torch.tensor(_trainer_scores(out / "final", _sides(train)), dtype=torch.float64)
    assert len(scores) == 36  # 18 training pairs (24 rows, a quarter held out), two sides each
    assert config["reward_mean"] == pytest.approx(scores.mean().item(), abs=1e-5)
    assert config["reward_std"] == pytest.approx(scores.std(unbiased=False).item(), abs=1e-5)
    assert config["reward_std"] > 1e-3
    assert f"reward mean {config['reward_mean']:.4f}, std {config['reward_std']:.4f} over 36" in stdout


def test_served_rm_scores_equal_the_trainers_values(rm_run):
    """The trained RM scores every training sequence the same (1e-5) through the trainer's forward, through
    LocalRewardModel.from_pretrained (what `relayrl rl --reward.source rm:` and serve-rm load), and over
    HTTP from the serve-rm app (POST /get_reward with the decoded texts); and the rewards the trainer logged
    in its final eval (eval/chosen_reward, eval/rejected_reward: means over the held-out pairs, after the
    last step) are the means of LocalRewardModel's scores of those pairs."""
    import aiohttp

    from relayrl.agents.http import start_app
    from relayrl.agents.remote_rm import build_rm_app, model_scorer
    from relayrl.agents.rewards import LocalRewardModel

    argv, out, _ = rm_run
    train, evals = _pair_data(argv)
    seqs = _sides(train)
    expected = _trainer_scores(out / "final", seqs)
    rm = LocalRewardModel.from_pretrained(str(out / "final"), device="cpu", batch_size=5)
    assert rm.score_ids(seqs) == pytest.approx(expected, abs=1e-5)
    logged = read_jsonl(out / "metrics.jsonl")[-1]
    held_out = rm.score_ids(_sides(evals))
    n = len(evals)
    assert logged["step"] == 3 and logged["eval/count"] == n == 6
    assert logged["eval/chosen_reward"] == pytest.approx(sum(held_out[:n]) / n, abs=1e-5)
    assert logged["eval/rejected_reward"] == pytest.approx(sum(held_out[n:]) / n, abs=1e-5)
    texts = [rm.tokenizer.decode(s) for s in seqs]
    assert [rm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts] == seqs

    async def served() -> dict:
        runner, port = await start_app(build_rm_app(model_scorer(rm)))
        try:
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}/get_reward"
                async with session.post(url, json={"query": texts}) as response:
                    assert response.status == 200
                    return await response.json()
        finally:
            await runner.cleanup()

    body = asyncio.run(served())
    assert body["rewards"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.timeout(120)
def test_rl_normalises_rewards_with_the_rm_statistics(rm_run, tiny_model_path, tmp_path, capsys):
    """`relayrl rl --reward.source rm:<final> --reward.normalize true` says it uses the RM's own mean / std."""
    _, out, _ = rm_run
    config = json.loads((out / "final" / "config.json").read_text())
    argv = ["rl", "--model.name_or_path", str(tiny_model_path), "--task.name", "add2", "--task.train_rows", "16",
            "--task.eval_rows", "0", "--train.max_steps", "1", "--rollout.prompts_per_step", "2",
            "--rollout.n_samples", "2", "--rollout.max_new_tokens", "4", "--reward.source", f"rm:{out / 'final'}",
            "--reward.normalize", "true", "--logger.progress_bar", "false", "--train.device", "cpu",
            "--train.output_dir", str(tmp_path / "rl")]  # fmt: skip
    assert cli_main(argv) == 0
    stdout = capsys.readouterr().out
    assert (
        "relayrl rl: rewards normalised with the reward model's statistics "
        f"(mean {config['reward_mean']:.4f}, std {config['reward_std']:.4f})"
    ) in stdout


# ---------------------------------------------------------------------------------------------- LoRA
@pytest.mark.timeout(120)
def test_lora_dpo_saves_an_adapter(data, tiny_model_path, tmp_path):
    """--model.lora.rank 4: the reference is the base model (policy = reference at step 1: loss ln 2), the
    final/ folder is a peft adapter (no full weights) that loads onto the base and changes its outputs, and
    merge-lora turns it into a plain causal LM with the same outputs."""
    from peft import PeftModel

    from relayrl.models.merge import merge_lora

    out = tmp_path / "run"
    argv = pf.cli_args(
        tiny_model_path, data["pairs"], out, "--train.max_steps", "3", "--model.lora.rank", "4"
    )
    assert cli_main(["dpo", *argv]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["train/margin"] != 0.0
    final = out / "final"
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not (final / "config.json").exists() and not (final / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = base(ids).logits
        adapted = PeftModel.from_pretrained(base, final).eval()(ids).logits
    assert not torch.allclose(before, adapted)
    merged = AutoModelForCausalLM.from_pretrained(merge_lora(final, tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("command", "flags", "says"),
    [
        ("dpo", ["--dpo.label_smoothing", "0.1"], "expected 0 unless dpo.loss is cdpo (set --dpo.loss cdpo)"),
        ("dpo", ["--dpo.beta", "0"], "0.0 is invalid; expected a number > 0"),
        (
            "kd",
            [],
            "kd.teacher: '' is invalid; expected a teacher model folder or Hub id (--kd.teacher PATH)",
        ),
    ],
)
def test_config_errors_exit_2_with_one_line(command, flags, says, data, tiny_model_path, tmp_path, capsys):
    """A bad option stops the command before any work (no run folder) with exit 2 and one error line (plus,
    for errors found while parsing, the standard `--help` hint); no traceback."""
    out = tmp_path / "run"
    assert cli_main([command, *pf.cli_args(tiny_model_path, data["pairs"], out), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[0].startswith(f"relayrl {command}: error: ") and says in err[0], err
    assert err[1:] in ([], [f"Run `relayrl {command} --help` for the options."]), err
    assert not out.exists()


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("dpo", "dpo.beta", "0"),
        ("kto", "kto.beta", "0"),
        ("kd", "kd.coef", "2"),
        ("prm", "prm.reward_tokens", "+"),
    ],
)
def test_config_error_names_the_flag(command, flag, value, capsys):
    assert cli_main([command, f"--{flag}", value]) == 2
    assert capsys.readouterr().err.startswith(f"relayrl {command}: error: {flag}: ")


def test_identical_pair_is_a_data_error_naming_file_line_and_key(
    tiny_model_path, tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("RELAYRL_DEBUG", raising=False)
    bad = pf.write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"input": "1+1=", "chosen": "2", "rejected": "3"},
            {"input": "1+2=", "chosen": "3", "rejected": "3"},
        ],
    )
    assert cli_main(["dpo", *pf.cli_args(tiny_model_path, bad, tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith(
        f"relayrl dpo: error: {bad}, line 2: key 'chosen/rejected': chosen and rejected are identical"
    ), err
    assert "--data.skip_malformed true" in err[0]
    assert err[1:] == ["relayrl dpo: (set RELAYRL_DEBUG=1 for the traceback)"]


def test_help_lists_the_recipes(capsys):
    assert cli_main(["--help"]) == 0
    commands = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert {"rm", "prm", "dpo", "kto", "kd"} <= commands
