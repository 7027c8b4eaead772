"""`relayrl sft` end to end on a tiny jsonl with the tiny model: CLI, run folder, eval, resume, errors."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from relayrl.cli import main as cli_main
from relayrl.config.base import load_yaml
from relayrl.config.recipes import SFTConfig
from relayrl.trainers.sft import run_sft
from relayrl.training.logging import read_jsonl


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sftdata") / "train.jsonl"
    rows = [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(10, 17) for b in range(20, 24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # 28 rows
    return path


def _argv(model, data, out, *extra):
    return [
        "--model.name_or_path",
        str(model),
        "--data.datasets",
        str(data),
        "--data.eval_split_ratio",
        "0.15",
        "--train.batch_size",
        "8",
        "--train.micro_batch_size",
        "4",
        "--train.output_dir",
        str(out),
        "--optim.lr",
        "3e-3",
        "--optim.warmup_steps",
        "1",
        "--logger.progress_bar",
        "false",
        "--train.device",
        "cpu",  # these tests assume CPU numerics (fp32), also on a machine with a GPU
        *extra,
    ]


def test_cli_end_to_end(tmp_path, tiny_model_path, train_file, capsys):
    out = tmp_path / "run"
    rc = cli_main(
        [
            "sft",
            *_argv(
                tiny_model_path,
                train_file,
                out,
                "--train.max_steps",
                "6",
                "--train.eval_every",
                "3",
                "--train.packing",
                "true",
                "--ckpt.save_every",
                "2",
                "--ckpt.keep_last",
                "2",
            ),
        ]
    )
    assert rc == 0
    assert "sft done: 6 steps" in capsys.readouterr().out
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows if "eval/loss" in r] == [3, 6]
    # 28 rows, 15% held out -> 4 eval rows; each "1a+2b=" + "3c" + eos has 3 targets -> 12 eval tokens
    assert rows[-1]["eval/count"] == 12
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    cfg = load_yaml(SFTConfig, out / "config.yaml")
    assert cfg.train.max_steps == 6 and cfg.train.packing and cfg.mode == "response"
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_4", "step_6"]
    state = json.loads((ckpts / "step_6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["metric"] == rows[-1]["eval/loss"]
    assert AutoModelForCausalLM.from_pretrained(ckpts / "step_6" / "model") is not None


def test_run_sft_result_and_hf_folder(tmp_path, tiny_model_path, train_file):
    from relayrl.config.command_line import parse_cli

    cfg = parse_cli(
        SFTConfig,
        _argv(
            tiny_model_path,
            train_file,
            tmp_path / "r",
            "--train.max_steps",
            "2",
            "--logger.tensorboard",
            "true",
        ),
    )
    result = run_sft(cfg)
    assert result.run_dir == tmp_path / "r" and result.metrics["step"] == 2 and len(result.history) == 2
    assert result.checkpoint == tmp_path / "r" / "checkpoints" / "step_2"
    loaded = AutoModelForCausalLM.from_pretrained(result.checkpoint / "model")
    ids = torch.tensor([[5, 6, 7, 8]])
    result.model.eval()
    torch.testing.assert_close(loaded(ids).logits, result.model(ids).logits, atol=0, rtol=0)
    assert list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_after_crash_matches_uninterrupted(tmp_path, tiny_model_path, train_file):
    """Run 6 steps with a checkpoint every 3; then pretend the process died right after step 3 (drop
    step_6, point latest at step_3) and rerun the same command: steps 4-6 reproduce the same losses and
    the final weights are bitwise equal."""
    out = tmp_path / "run"
    argv = [
        "sft",
        *_argv(tiny_model_path, train_file, out, "--train.max_steps", "6", "--ckpt.save_every", "3"),
    ]
    assert cli_main(argv) == 0
    first = {r["step"]: r["train/loss"] for r in read_jsonl(out / "metrics.jsonl")}
    final = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_6" / "model").state_dict()
    import shutil

    shutil.rmtree(out / "checkpoints" / "step_6")
    (out / "checkpoints" / "latest").write_text("step_3\n")
    assert cli_main(argv) == 0
    # the metrics file keeps steps 1-3 and replaces the old 4-6 with the resumed run's: each step once
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["train/loss"] for r in rows] == [first[s] for s in range(1, 7)]
    again = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_6" / "model").state_dict()
    for k, v in final.items():
        assert torch.equal(v, again[k]), k


def test_raising_max_steps_says_how_the_lr_schedule_changes_and_does_it(
    tmp_path, tiny_model_path, train_file, capsys
):
    """2 cosine steps, then the same run continued to 4: one line names the new schedule and the lr of the
    first resumed step, and that is the lr step 3 actually ran at (steps 1-2 keep theirs)."""
    from relayrl.config.command_line import parse_cli
    from relayrl.training.optim import schedule_lr

    out = tmp_path / "run"
    extra = ("--optim.scheduler", "cosine", "--optim.min_lr_ratio", "0.1", "--train.max_steps")
    run_sft(parse_cli(SFTConfig, _argv(tiny_model_path, train_file, out, *extra, "2")))
    capsys.readouterr()
    cfg = parse_cli(SFTConfig, _argv(tiny_model_path, train_file, out, *extra, "4"))
    run_sft(cfg)
    said = [line for line in capsys.readouterr().out.splitlines() if "learning-rate schedule" in line]
    old, new = schedule_lr(cfg.optim, 2, 2), schedule_lr(cfg.optim, 2, 4)  # 0-based step 2 = step 3
    # lr 3e-3, warm-up 1: the 2-step decay is over at step 3 (lr x min_lr_ratio); over 4 steps step 3 is at
    # progress p = 1/3: 0.1 + 0.9 x (1 + cos(pi / 3)) / 2 = 0.775
    assert old == pytest.approx(3e-4) and new == pytest.approx(3e-3 * 0.775)
    assert said == [
        "relayrl sft: the learning-rate schedule is recomputed for 4 steps instead of 2 (cosine, stretched), "
        f"continuing after step 2: the lr at step 3 changes from {old:.4g} to {new:.4g}"
    ]
    lrs = [r["train/lr"] for r in read_jsonl(out / "metrics.jsonl")]
    assert lrs == [
        schedule_lr(cfg.optim, 0, 2),
        schedule_lr(cfg.optim, 1, 2),
        new,
        schedule_lr(cfg.optim, 3, 4),
    ]


def test_config_errors_fail_before_work(tmp_path, tiny_model_path, train_file, capsys):
    rc = cli_main(["sft", *_argv(tiny_model_path, train_file, tmp_path / "x", "--mode", "chat")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "mode" in err and "response" in err and "multiturn" in err
    assert not (tmp_path / "x").exists()
    assert cli_main(["sft", "--help"]) == 0
    assert "--train.packing" in capsys.readouterr().out


def test_batch_larger_than_data_is_a_clear_error(tmp_path, tiny_model_path, train_file):
    from relayrl.config.command_line import parse_cli

    cfg = parse_cli(SFTConfig, _argv(tiny_model_path, train_file, tmp_path / "r", "--train.batch_size", "64"))
    with pytest.raises(ValueError, match=r"train\.batch_size"):
        run_sft(cfg)


def test_wandb_missing_is_a_clear_error(tmp_path):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed")
    except ImportError:
        pass
    from relayrl.training.logging import MetricsLogger

    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, wandb=True)


def test_config_yaml_is_fully_resolved(tmp_path, tiny_model_path, train_file):
    assert (
        cli_main(["sft", *_argv(tiny_model_path, train_file, tmp_path / "r", "--train.max_steps", "1")]) == 0
    )
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert set(saved) == {
        "model",
        "data",
        "optim",
        "train",
        "ckpt",
        "logger",
        "mode",
        "aux_loss_coef",
        "dist",
    }
    assert saved["optim"]["lr"] == 3e-3 and saved["optim"]["scheduler"] == "cosine"


def test_same_update_whatever_the_micro_batching(tmp_path, tiny_model_path, train_file):
    """4 AdamW steps of 8 samples: one pass of 8, four padded passes of 2, or packed passes of <= 30 tokens
    give the same per-step losses and weights (only float summation order differs: ~1e-6 observed)."""
    from relayrl.config.command_line import parse_cli

    runs = {}
    for name, extra in [
        ("one_pass", ["--train.micro_batch_size", "8"]),
        ("four_passes", ["--train.micro_batch_size", "2"]),
        ("packed_budget", ["--train.max_tokens_per_micro_batch", "30", "--train.packing", "true"]),
    ]:
        argv = _argv(tiny_model_path, train_file, tmp_path / name, "--train.max_steps", "4", *extra)
        argv[argv.index("--data.eval_split_ratio") + 1] = "0"
        result = run_sft(parse_cli(SFTConfig, argv))
        runs[name] = ([h["train/loss"] for h in result.history], result.model.state_dict())
    ref_losses, ref_weights = runs["one_pass"]
    for name, (losses, weights) in runs.items():
        assert len(losses) == 4
        assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses, strict=True)), name
        for key, value in weights.items():
            torch.testing.assert_close(value, ref_weights[key], atol=1e-5, rtol=0, msg=f"{name}: {key}")


def test_lora_sft_checkpoints_adapter_resumes_and_merges(tmp_path, tiny_model_path, train_file):
    import shutil

    from relayrl.config.command_line import parse_cli
    from relayrl.models.merge import merge_lora

    argv = _argv(
        tiny_model_path,
        train_file,
        tmp_path / "run",
        "--train.max_steps",
        "4",
        "--ckpt.save_every",
        "2",
        "--model.lora.rank",
        "4",
    )
    first = run_sft(parse_cli(SFTConfig, argv))
    adapter = first.checkpoint / "model"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_4")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_2\n")
    second = run_sft(parse_cli(SFTConfig, argv))
    assert [h["train/loss"] for h in second.history] == [h["train/loss"] for h in first.history[2:]]
    merged = AutoModelForCausalLM.from_pretrained(
        merge_lora(second.checkpoint / "model", tmp_path / "merged")
    )
    ids = torch.tensor([[5, 6, 7, 8]])
    second.model.eval()
    torch.testing.assert_close(merged(ids).logits, second.model(ids).logits, atol=1e-5, rtol=1e-5)


def test_a_run_whose_weights_became_non_finite_exports_nothing(tmp_path, tiny_model_path, train_file):
    # --optim.lr inf trained to NaN and wrote a final/ of 100% non-finite weights with exit 0. The config now
    # refuses inf (tests/config); a run that diverges anyway (here: the value forced past the check) stops
    # with an error when it would save, and writes neither a checkpoint nor final/
    from relayrl.config.command_line import parse_cli
    from relayrl.training.checkpoint import NonFiniteWeights

    out = tmp_path / "run"
    cfg = parse_cli(SFTConfig, _argv(tiny_model_path, train_file, out, "--train.max_steps", "1"))
    cfg.optim.lr = float("inf")
    with pytest.raises(NonFiniteWeights, match=r"refusing to write a checkpoint to .* weight values are NaN"):
        run_sft(cfg)
    assert not (out / "final").exists()
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith("step_")]
