"""With ckpt.keep_best, every RL eval step is also a save step, so the best checkpoint is ranked even when
ckpt.save_every and eval.every never coincide (here 5 and 2: before, no checkpoint ever carried a metric)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from relayrl.config.presets import tiny_cpu_config
from relayrl.trainers.rl.loop import RLTrainer


def test_keep_best_ranks_every_eval(tiny_model_path, tmp_path):
    # the digit reward: a random tiny model scores 0 on add2 in every group, a run with nothing to learn
    # (which ends with exit code 1 and no final model)
    digits = str(Path(__file__).parents[1] / "data" / "digit_reward.py")
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=4, reward=digits)
    cfg = replace(
        cfg,
        task=replace(cfg.task, eval_rows=8),
        eval=replace(cfg.eval, every=2),
        ckpt=replace(cfg.ckpt, save_every=5, keep_last=1, keep_best=True),
    )
    trainer = RLTrainer(cfg)
    saves: list[tuple[int, float | None]] = []
    save = trainer.ckpt.save

    def spy(step, **kw):
        saves.append((step, kw.get("metric")))
        return save(step, **kw)

    trainer.ckpt.save = spy
    result = trainer.fit()
    assert result.exit_code == 0
    root = tmp_path / "run" / "checkpoints"
    metrics = {
        p.name: json.loads((p / "trainer_state.json").read_text())["metric"]
        for p in root.iterdir()
        if p.name.startswith("step_")
    }
    evals = {int(h["train/step"]): h["eval/pass@1"] for h in result.history if "eval/pass@1" in h}
    assert sorted(evals) == [2, 4]
    assert saves == [(2, evals[2]), (4, evals[4])]  # each eval step saved and ranked (save_every 5: none)
    # steps 2 and 4 were saved with their eval metric; rotation keeps the newest and the best
    assert metrics.get("step_4") == evals[4]
    best = max(evals, key=lambda s: (evals[s], s))
    assert f"step_{best}" in metrics and metrics[f"step_{best}"] == evals[best]
