"""Numerics regression (STYLE rule 13): a tiny deterministic SFT run must reproduce its stored per-step losses.

Regenerate (only when a change is MEANT to alter the numerics, and say so in the change note):
    RELAYRL_REGEN=1 .venv/bin/pytest -q tests/trainers/test_sft_regression.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from relayrl.config.components import TrainConfig
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.trainers.sft import make_sft_collate, next_token_loss
from relayrl.training.loop import LoopSettings, Trainer
from relayrl.training.optim import build_optimizer, build_scheduler
from relayrl.training.sampler import ResumableSampler
from relayrl.training.step import TrainStep

REFERENCE = Path(__file__).parent / "data" / "sft_reference_losses.json"


class Sample:
    def __init__(self, ids, mask):
        self.input_ids, self.loss_mask = ids, mask


def _run() -> list[float]:
    tok = build_tiny_tokenizer()
    samples = []
    for a in range(10, 22):
        for b in (31, 47):
            prompt = tok(f"{a}+{b}=")["input_ids"]
            answer = tok(str(a + b))["input_ids"] + [tok.eos_token_id]
            samples.append(Sample(prompt + answer, [False] * len(prompt) + [True] * len(answer)))
    torch.manual_seed(0)
    model = build_tiny_model(tok, TinyModelSpec(seed=0))
    opt = build_optimizer(model, lr=3e-3, weight_decay=0.01)
    sched = build_scheduler(opt, total_steps=8, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    engine = TrainStep(model=model, loss_fn=next_token_loss, optimizer=opt, scheduler=sched, device="cpu")
    trainer = Trainer(
        train_step=engine,
        sampler=ResumableSampler(len(samples), 8, seed=0),
        collate=make_sft_collate(
            samples, TrainConfig(batch_size=8, micro_batch_size=4, packing=True), "padded"
        ),
        settings=LoopSettings(total_steps=8, save_final=False),
    )
    return [h["train/loss"] for h in trainer.fit().history]


def test_sft_losses_match_reference():
    losses = _run()
    if os.environ.get("RELAYRL_REGEN"):
        REFERENCE.parent.mkdir(parents=True, exist_ok=True)
        REFERENCE.write_text(json.dumps({"losses": losses}, indent=1) + "\n")
    ref = json.loads(REFERENCE.read_text())["losses"]
    assert len(losses) == len(ref) == 8
    # fp32 CPU; different BLAS builds may differ in the last bits, amplified a little by Adam over 8 steps
    for step, (got, want) in enumerate(zip(losses, ref, strict=True), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: {got} != reference {want}"
    assert losses[-1] < losses[0]
