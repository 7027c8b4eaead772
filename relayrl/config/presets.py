"""Config presets: Python functions that change a few fields of a command's defaults.

tiny_cpu_config(model_path, output_dir, steps=, reward=) -> RLConfig   smoke tests and CPU benchmarks
"""

from __future__ import annotations

from relayrl.config.components import CkptConfig, LoggerConfig, ModelConfig, OptimConfig
from relayrl.config.rl import AlgoConfig, RewardConfig, RLConfig, RLTrainConfig, RolloutConfig, TaskConfig


def tiny_cpu_config(model_path: str, output_dir: str, *, steps: int = 4, reward: str = "") -> RLConfig:
    """A preset for smoke tests and CPU benchmarks: the add2 prompts, 8 prompts x 4 samples, 6 new tokens,
    GRPO, no checkpoints in between, no console output. Change fields with dataclasses.replace."""
    return RLConfig(
        model=ModelConfig(name_or_path=model_path),
        optim=OptimConfig(lr=3e-3, scheduler="constant", warmup_steps=0),
        train=RLTrainConfig(max_steps=steps, output_dir=output_dir, seed=0, device="cpu"),
        ckpt=CkptConfig(resume="none", save_every=0, best_metric="eval/pass@1", best_mode="max"),
        logger=LoggerConfig(progress_bar=False),
        task=TaskConfig(name="add2", train_rows=256, eval_rows=0),
        reward=RewardConfig(source=reward),
        rollout=RolloutConfig(prompts_per_step=8, n_samples=4, max_new_tokens=6, max_len=64),
        algo=AlgoConfig(),  # group_norm + ppo; names left unset so `algo.preset` can still pick them
    )
