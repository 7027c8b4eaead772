"""The recipe's plan at each scale (model shape, data sizes, when SFT stops, budgets) and the RL config it runs.

    SCALES[name] -> Scale             tiny (CPU test), medium (CPU check), full (one H100 / H200 per run)
    scale_of(args) -> Scale           the named scale with the command line's overrides
    Scale.sft_stop(steps, s, val_em)  why SFT ends now ("steps" / "target" / "time"), or None
    rl_config(scale, work, algo, ...) relayrl's RLConfig of one RL run from WORK/sft/final

When SFT stops (the RL start point). RL needs headroom: a model that is right on ~half of the problems, so
most groups of 8 samples hold right and wrong answers. The full scale's learning curve is steep there (on an
H100: 1.2% held-out exact match after 429 steps on 1000 demonstrations, 74.6% after 1063 steps on 2000), so
a fixed step count would land anywhere from ~0 to ~0.75 under a different seed or GPU nondeterminism, and a
wall-time budget moves with the card's speed. The full scale therefore stops SFT at the first check (every
`sft_check_every` steps from `sft_min_steps` on) where greedy exact match on a VALIDATION set (its own
problems, disjoint from the held-out ones and from the demonstrations and RL prompts) reaches `sft_target_em`,
with `sft_seconds` as a cap; the step count it stopped at is recorded (sft.json), and `--sft-steps N` replays
a fixed count (no checks) for an exact re-run of the procedure.

The RL config (the same for each algorithm but what the preset picks): no KL (`algo.kl_mode none`, so no
reference model is built and, with one epoch and one mini-batch, the old-log-prob forward is skipped: the
experience pass runs no forward at all for GRPO / REINFORCE++, the critic's values only for PPO), every
sample of a step in one micro-batch (`algo.micro_batch_tokens`: 512 samples x <= 112 tokens; the default 4096
cut a step into ~14 forward/backward launch sequences for a model that fills a fraction of the GPU), and for
PPO GAE with lambda 1 (returns minus values: the critic starts at V = 0 from a zero value head, and with
lambda 0.95 an early token's advantage would be ~0.95^50 of the reward until the critic has learned).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import recipe_task as task

from relayrl.config.components import CkptConfig, DataConfig, LoggerConfig, ModelConfig, OptimConfig
from relayrl.config.rl import AlgoConfig, CriticConfig, RewardConfig, RLConfig, RLTrainConfig, RolloutConfig
from relayrl.models.tiny import TinyModelSpec

ALGOS = ("grpo", "ppo", "reinforce++")
"""The RL runs, by relayrl preset name (docs/rl.md "Choosing the algorithm")."""


@dataclass(kw_only=True, frozen=True)
class Scale:
    """Model shape, data sizes, the SFT stop rule and the time budgets of one scale of the recipe."""

    model: TinyModelSpec
    sft_rows: int
    """Demonstrations SFT sees (a fixed set, repeated over epochs): the limit RL's fresh prompts lift."""
    rl_rows: int
    """Fresh RL prompts (more than a run draws: every RL prompt is new)."""
    heldout_rows: int
    sft_seconds: float
    """Wall time of SFT before its checkpoint is exported; with `sft_steps` or `sft_target_em`, the cap."""
    rl_seconds: float
    """Wall time of each RL run, and of the more-SFT control after the checkpoint."""
    eval_seconds: float
    """Held-out evaluation every this many seconds of a run."""
    sft_lr: float
    sft_batch: int
    rl: dict[str, Any]
    """recipe_task.RL_SETTINGS, with this scale's overrides."""
    critic_lr: float
    new_tokens: int = task.MAX_NEW_TOKENS
    """New tokens per completion, in RL and in evaluation (the tiny scale cuts it: nothing is learned there)."""
    digits: tuple[int, int] = (task.MIN_DIGITS, task.MAX_DIGITS)
    """Operand lengths (the task's; the CPU check's are shorter, to fit 2 CPU cores)."""
    sft_steps: int = 0
    """SFT optimizer steps before the checkpoint (0: not a step count; `sft_target_em` or the time decides)."""
    sft_target_em: float = 0.0
    """Stop SFT at the first check where validation exact match is >= this (0: no checks)."""
    val_rows: int = 0
    """Validation problems of the SFT stop rule (disjoint from every other set; 0: none)."""
    sft_min_steps: int = 0
    """First SFT step that checks validation exact match (before it the model is not yet right)."""
    sft_check_every: int = 25
    """SFT steps between two validation checks."""
    micro_batch_tokens: int = 32768
    """algo.micro_batch_tokens of every RL run (and the critic's): a whole step in one micro-batch."""
    ppo_lam: float = 1.0
    """GAE lambda of the PPO run (module doc)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.sft_target_em <= 1.0:
            raise ValueError(f"sft_target_em {self.sft_target_em}: an exact match in [0, 1] (0: no checks)")
        if self.sft_steps < 0 or self.sft_min_steps < 0 or self.sft_check_every < 1:
            raise ValueError("sft_steps / sft_min_steps take ints >= 0, sft_check_every an int >= 1")
        if self.sft_target_em and not self.val_rows:
            raise ValueError("sft_target_em needs validation problems (val_rows > 0)")

    def checks_at(self, steps: int) -> bool:
        """Whether SFT measures validation exact match after `steps` optimizer steps (never with sft_steps)."""
        return (
            self.sft_target_em > 0
            and not self.sft_steps
            and steps >= self.sft_min_steps
            and (steps - self.sft_min_steps) % self.sft_check_every == 0
        )

    def sft_stop(self, steps: int, seconds: float, val_em: float | None) -> str | None:
        """Why SFT ends after `steps` optimizer steps and `seconds` of wall time with validation exact match
        `val_em` (None: not measured at this step): "steps" (sft_steps reached), "target" (val_em reached
        sft_target_em), "time" (sft_seconds, the cap), or None to go on."""
        if self.sft_steps:  # a fixed count: no target
            return "steps" if steps >= self.sft_steps else ("time" if seconds >= self.sft_seconds else None)
        if val_em is not None and self.sft_target_em and val_em >= self.sft_target_em:
            return "target"
        return "time" if seconds >= self.sft_seconds else None


SCALES: dict[str, Scale] = {
    # the CPU test: the same code path in seconds (nothing is expected to be learned)
    "tiny": Scale(
        model=TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, max_positions=160),
        sft_rows=64,
        rl_rows=256,
        heldout_rows=4,
        val_rows=4,
        sft_seconds=2.0,
        rl_seconds=2.0,
        eval_seconds=1.0,
        sft_lr=1e-3,
        sft_batch=16,
        rl={**task.RL_SETTINGS, "group_size": 4, "prompts_per_step": 4, "learning_rate": 1e-4},
        critic_lr=1e-4,
        new_tokens=12,
    ),
    # the CPU check that RL lifts held-out accuracy over SFT (a ~1M model, minutes on 2 cores)
    "medium": Scale(
        model=TinyModelSpec(hidden=96, layers=3, heads=4, kv_heads=2, max_positions=160),
        sft_rows=400,
        rl_rows=20000,
        heldout_rows=100,
        val_rows=100,
        sft_seconds=300.0,
        rl_seconds=300.0,
        eval_seconds=60.0,
        sft_lr=2e-3,
        sft_batch=32,
        rl={**task.RL_SETTINGS, "prompts_per_step": 16, "learning_rate": 2e-4},
        critic_lr=1e-3,
        new_tokens=40,
        digits=(2, 3),
    ),
    # one H100 / H200 per run: a ~100M Qwen2 shape (12 layers, hidden 768, MLP 3072, 12 heads, 4 KV heads).
    # SFT stops at 0.45 validation exact match (module doc), checked every 25 steps from step 400, 150 s cap
    "full": Scale(
        model=TinyModelSpec(
            hidden=768, layers=12, heads=12, kv_heads=4, intermediate=3072, max_positions=160
        ),
        sft_rows=2000,
        rl_rows=60000,
        heldout_rows=500,
        val_rows=256,
        sft_seconds=150.0,
        sft_target_em=0.45,
        sft_min_steps=400,
        sft_check_every=25,
        rl_seconds=300.0,
        eval_seconds=30.0,
        sft_lr=3e-4,
        sft_batch=128,
        rl=dict(task.RL_SETTINGS),
        critic_lr=1e-4,
    ),
}


def scale_of(args: argparse.Namespace) -> Scale:
    """The named scale with the command line's overrides (0 / a negative value: the scale's own; a target
    exact match or a step count given on the command line replaces the other rule)."""
    s = SCALES[args.scale]
    over: dict[str, Any] = {
        k: float(v)
        for k, v in (
            ("sft_seconds", args.sft_seconds),
            ("rl_seconds", args.rl_seconds),
            ("eval_seconds", args.eval_seconds),
        )
        if v
    }
    if args.sft_rows:
        over["sft_rows"] = args.sft_rows
    if args.sft_steps:
        over.update(sft_steps=args.sft_steps, sft_target_em=0.0)
    elif args.sft_target_em:
        over.update(sft_target_em=args.sft_target_em, sft_steps=0, val_rows=s.val_rows or 100)
    return dataclasses.replace(s, **over) if over else s


def rl_config(scale: Scale, work: Path, algo: str, seed: int, device: str, run: str = "") -> RLConfig:
    """relayrl rl from WORK/sft/final on the fresh prompts, reward = recipe_task.score (its reward_func);
    the algorithm's preset with the recipe's changes (module doc). Run folder WORK/rl/<run or algo>."""
    s = scale.rl
    gae: dict[str, Any] = {"lam": scale.ppo_lam} if algo == "ppo" else {}
    return RLConfig(
        model=ModelConfig(name_or_path=str(work / "sft" / "final")),
        data=DataConfig(
            datasets=[str(work / "data" / "train_prompts.jsonl")],
            input_key="prompt",
            label_key="answer",
            seed=seed,
        ),
        optim=OptimConfig(
            lr=s["learning_rate"], warmup_steps=0, warmup_ratio=0.0, scheduler="constant", weight_decay=0.0
        ),
        train=RLTrainConfig(
            seed=seed,
            max_steps=10**6,
            device=device,  # pyright: ignore[reportArgumentType]  (main's --device: auto, cpu or cuda)
            output_dir=str(work / "rl" / (run or algo)),
        ),
        ckpt=CkptConfig(save_every=0, keep_last=1, resume="none", overwrite=True),
        logger=LoggerConfig(progress_bar=False),
        reward=RewardConfig(source=str(Path(task.__file__).resolve())),
        rollout=RolloutConfig(
            prompts_per_step=s["prompts_per_step"],
            n_samples=s["group_size"],
            temperature=s["temperature"],
            max_new_tokens=min(s["max_new_tokens"], scale.new_tokens),
            max_len=160,
        ),
        algo=AlgoConfig(
            preset=algo, kl_mode="none", kl_coef=0.0, micro_batch_tokens=scale.micro_batch_tokens, **gae
        ),
        critic=CriticConfig(lr=scale.critic_lr) if algo == "ppo" else CriticConfig(),  # PPO's: GAE
    )
