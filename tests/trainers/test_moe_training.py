"""Mixture-of-experts models in training (CPU, fp32): SFT and RL learn with a tiny Qwen3-MoE / Mixtral, the
router aux loss is in the loss and the metrics, routing replay runs through the RL loop."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.config.base import ConfigError
from relayrl.config.command_line import parse_cli
from relayrl.config.presets import tiny_cpu_config
from relayrl.config.recipes import SFTConfig
from relayrl.config.rl import AlgoConfig, RolloutConfig
from relayrl.data.batches import SFTBatch
from relayrl.models.moe import install_moe
from relayrl.models.tiny import TinyModelSpec, save_tiny
from relayrl.trainers.rl.loop import run_rl
from relayrl.trainers.sft import next_token_loss, run_sft
from tests.helpers.moe_models import lively_moe

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    spec = TinyModelSpec(hidden=64, layers=2, moe="qwen3", experts=4, top_k=2)
    return save_tiny(tmp_path_factory.mktemp("moe") / "model", spec)


def test_aux_loss_changes_the_router_gradient_only_through_the_router():
    """aux_loss_coef > 0: the loss grows by coef * aux * count, the router weights get another gradient; the
    last layer's expert weights' gradients are unchanged (the aux loss reads router probabilities, which
    depend on the layers before, not on the last layer's experts)."""
    model = lively_moe("mixtral")
    install_moe(model)
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(4, 100, (n,), generator=gen) for n in (9, 6, 12)]
    batch = SFTBatch(input_ids=ids, targets=[torch.ones(len(s), dtype=torch.bool) for s in ids])
    grads, outs = [], []
    for coef in (0.0, 0.5):
        model.zero_grad()
        out = next_token_loss(model, batch, aux_loss_coef=coef)
        out.loss_sum.backward()
        outs.append(out)
        last = model.model.layers[-1].mlp  # nothing of the aux loss reads its experts' outputs
        grads.append((last.gate.weight.grad.clone(), last.experts.down_proj.grad.clone()))
    assert "aux_loss" not in outs[0].metrics and "aux_loss" in outs[1].metrics
    aux = float(outs[1].metrics["aux_loss"]) / float(outs[1].count)
    assert 0.9 < aux < 4.0  # E * sum f_e P_e: 1 when balanced
    assert float((outs[1].loss_sum - outs[0].loss_sum).detach()) == pytest.approx(
        0.5 * aux * float(outs[1].count), rel=1e-5
    )
    assert not torch.allclose(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=0, rtol=0)


def test_sft_learns_and_logs_the_aux_loss(tmp_path, moe_path):
    path = tmp_path / "train.jsonl"
    rows = [{"input": f"{a}+{b}=", "output": str(a + b)} for a in range(10, 17) for b in range(20, 24)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model.name_or_path", str(moe_path), "--data.datasets", str(path), "--train.batch_size", "8",
            "--train.micro_batch_size", "4", "--train.output_dir", str(tmp_path / "r"), "--optim.lr", "3e-3",
            "--optim.warmup_steps", "0", "--logger.progress_bar", "false", "--train.device", "cpu",
            "--train.max_steps", "8", "--aux_loss_coef", "0.01"]  # fmt: skip
    result = run_sft(parse_cli(SFTConfig, argv))
    losses = [h["train/loss"] for h in result.history]
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(h["train/aux_loss"] > 0 for h in result.history)


def test_aux_loss_coef_must_be_non_negative():
    with pytest.raises(ConfigError, match="aux_loss_coef"):
        AlgoConfig(aux_loss_coef=-1.0)
    with pytest.raises(ConfigError, match="routing_replay"):
        RolloutConfig(engine="hf", routing_replay=True)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_rl_with_routing_replay_learns(tmp_path, moe_path):
    """GRPO with routing replay and the aux loss raises the digit reward (tests/trainers/data/digit_reward.py,
    as test_convergence.py); the engine-vs-trainer mismatch stays at fp32 rounding."""
    cfg = tiny_cpu_config(
        str(moe_path), str(tmp_path / "run"), steps=12, reward=str(DATA / "digit_reward.py")
    )
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, routing_replay=True),
        algo=replace(cfg.algo, aux_loss_coef=0.01, off_policy="tis"),
    )
    result = run_rl(cfg)
    assert result.exit_code == 0, result.message
    rewards = [h["rollout/reward_mean"] for h in result.history]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:2]) / 2 + 0.1, rewards
    assert all(h["train/aux_loss"] > 0 for h in result.history)
    assert all(
        h["mismatch/logprob_absdiff_max"] < 1e-3
        for h in result.history
        if "mismatch/logprob_absdiff_max" in h
    )
