"""`relayrl demo` end to end at toy size: SFT -> eval -> RL -> eval, summary.json, plot and HF checkpoint.

The real demo's accuracy gain is measured by `make demo` (numbers in docs/rl.md); this test checks the
plumbing in seconds: every output exists, the accuracies are the RL trainer's eval numbers, and the final
folder loads with `from_pretrained`.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoModelForCausalLM

from relayrl.apps.demo import main
from relayrl.tasks.arith import Addition
from relayrl.tasks.registry import TASKS


class DigitCredit(Addition):
    """add2 with a reward a random tiny model can earn: 1 when the answer holds a digit. At toy size the demo's
    SFT leaves exact match at 0 in every group, and a run without any non-zero advantage stops as "nothing to
    learn" (exit 1); this reward gives the groups variance, so the plumbing runs to the end."""

    def reward(self, response: str, label: Any) -> float:
        return 1.0 if any(c.isdigit() for c in response) else 0.0


@pytest.mark.timeout(120)
def test_demo_writes_summary_plot_and_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(TASKS, "add2", lambda: DigitCredit(digits=2, name="add2"))
    out = tmp_path / "demo"
    argv = [
        "--output_dir",
        str(out),
        "--hidden",
        "32",
        "--layers",
        "1",
        "--sft_rows",
        "64",
        "--sft_steps",
        "4",
    ]
    argv += ["--rl_steps", "2", "--eval_rows", "16", "--rl_rows", "64", "--rl_filter", "false"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    for key in ("accuracy_sft", "accuracy_rl", "rl_steps", "seconds", "cpu_seconds"):
        assert key in summary, key
    # process CPU time (what docs/rl.md quotes on a shared machine): each phase's share of the whole
    assert summary["cpu_seconds_sft"] > 0 and summary["cpu_seconds_rl"] > 0
    # each figure is rounded to 0.1 s: the two phases' sum may exceed the rounded whole by up to 0.15 s
    assert summary["cpu_seconds_sft"] + summary["cpu_seconds_rl"] <= summary["cpu_seconds"] + 0.15
    assert summary["threads"] == 1
    assert summary["rl_steps"] == 2 and summary["eval_prompts"] == 16
    assert 0.0 <= summary["accuracy_sft"] <= 1.0 and 0.0 <= summary["accuracy_rl"] <= 1.0
    assert f"after SFT {summary['accuracy_sft']:.3f} -> after RL {summary['accuracy_rl']:.3f}" in printed
    assert f"({summary['cpu_seconds']:.0f}s of CPU time after start-up, 1 thread(s))" in printed
    metrics = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["step"] == 0 and metrics[0]["eval/pass@1"] == summary["accuracy_sft"]
    assert metrics[-1]["eval/pass@1"] == summary["accuracy_rl"]
    assert (out / "curves.png").stat().st_size > 10_000
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.hidden_size == 32
    # the eval prompts are held out: none of them is an SFT or RL training prompt
    rows = {
        name: (out / "data" / f"add2_{name}.jsonl").read_text().splitlines() for name in ("sft", "rl", "eval")
    }
    inputs = {name: {json.loads(r)["input"] for r in v} for name, v in rows.items()}
    assert not inputs["eval"] & (inputs["sft"] | inputs["rl"])


@pytest.mark.timeout(60)
def test_demo_stops_with_the_exit_code_of_an_interrupted_sft_phase(tmp_path, monkeypatch, capsys):
    """An SFT chunk that returns exit code 143 (SIGTERM: checkpoint written) ends the demo with 143; it does
    not go on to the next chunk or to RL."""
    import relayrl.apps.demo as demo

    calls = []

    class Stopped:
        exit_code = 143

    def stopped_phase(cfg, base, data_file, run_dir, steps):
        calls.append(steps)
        return Stopped()

    monkeypatch.setattr(demo, "run_sft_phase", stopped_phase)
    out = tmp_path / "demo"
    argv = [
        "--output_dir",
        str(out),
        "--hidden",
        "32",
        "--layers",
        "1",
        "--sft_rows",
        "64",
        "--sft_steps",
        "8",
    ]
    argv += ["--sft_chunk", "4"]
    assert main(argv) == 143
    assert calls == [4]
    assert "SFT phase stopped (exit code 143)" in capsys.readouterr().err
    assert not (out / "rl").exists() and not (out / "summary.json").exists()


def test_demo_runs_on_the_configured_cpu_threads(tmp_path, monkeypatch):
    """`--threads N` is what the demo hands torch.set_num_threads before building anything (the default, 1, is
    the measured-faster setting on 2 cores: docs/rl.md "The demo"); 0 threads is refused, naming the field."""
    import relayrl.apps.demo as demo
    from relayrl.config.apps import DemoConfig
    from relayrl.config.base import ConfigError

    calls = []

    class Built(Exception):
        pass

    def stop_at_build(cfg, folder):
        raise Built

    monkeypatch.setattr(demo.torch, "set_num_threads", calls.append)
    monkeypatch.setattr(demo, "build_base_model", stop_at_build)
    with pytest.raises(Built):
        demo.run_demo(DemoConfig(output_dir=str(tmp_path / "a")))
    with pytest.raises(Built):
        demo.run_demo(DemoConfig(output_dir=str(tmp_path / "b"), threads=2))
    assert calls == [1, 2]
    with pytest.raises(ConfigError, match="threads"):
        DemoConfig(threads=0)


def test_demo_rl_settings_reach_the_rl_run(tmp_path):
    """rl_prompts sets the prompts per step; rl_kl_monitor false (the default) builds no reference model (kl_mode
    none), true measures the KL to the SFT model without training on it (monitor); 0 prompts is refused."""
    from relayrl.apps.demo import rl_config
    from relayrl.config.apps import DemoConfig
    from relayrl.config.base import ConfigError

    data = {name: tmp_path / f"{name}.jsonl" for name in ("rl", "eval")}
    default = rl_config(DemoConfig(), tmp_path / "model", data, tmp_path / "rl", 10)
    assert default.rollout.prompts_per_step == 32 and default.algo.kl_mode == "none"
    other = rl_config(
        DemoConfig(rl_prompts=8, rl_kl_monitor=True), tmp_path / "model", data, tmp_path / "rl", 10
    )
    assert other.rollout.prompts_per_step == 8 and other.algo.kl_mode == "monitor"
    assert other.algo.kl_coef == 0.0  # monitored, not in the loss
    with pytest.raises(ConfigError, match="rl_prompts"):
        DemoConfig(rl_prompts=0)
