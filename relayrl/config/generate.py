"""Configs of the generation apps: `relayrl generate` and `relayrl iterative-dpo` (which generates, scores and
pairs, then runs DPO, each round).

    GenerateConfig(model, data, task, rollout, reward, output, select, threshold, max_per_prompt,
                   condition_template, seed, device)                           relayrl.apps.generate
    IterativeDPOConfig(model, data, task, rollout, reward, dpo: DPOSection, optim, train, ckpt, logger,
                       dist, rounds, seed)                                     relayrl.apps.iterative_dpo

Both reuse the RL sections rollout / reward / task (relayrl.config.rl) and the component sections; the
iterative recipe's DPO section is `relayrl dpo`'s own (relayrl.config.recipes.DPOSection).
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Literal

from relayrl.config.base import check_choices, check_finite, invalid
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from relayrl.config.dist import DistConfig
from relayrl.config.recipes import DPOSection
from relayrl.config.rl import RewardConfig, RolloutConfig, TaskConfig

DEFAULT_CONDITION = "<rm_score>: {reward:.1f} {input}"
"""Conditional-SFT prompt: OpenRLHF's "{input} <rm_score>: {reward} " turned into a prefix, so the prompt keeps
its own ending and the prompt/response boundary tokenizes as it did when sampling (with the condition
appended, a BPE tokenizer would merge the trailing space into the response's first word, and the SFT mask
builder refuses such rows)."""

SelectMode = Literal["all", "best_of_n", "rejection", "pairs", "conditional"]


@dataclass(kw_only=True, slots=True)
class GenerateConfig:
    """`relayrl generate`: n samples per prompt, optional reward, a selection rule, one JSONL file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model that generates (a local folder or Hub id; LoRA settings are not applied)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data (the training sources: data.datasets, mixing, max_samples; eval settings are unused)."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """A built-in task as the prompt source (its train_rows prompts) and default reward, instead of data."""
    rollout: RolloutConfig = field(
        default_factory=lambda: RolloutConfig(n_samples=4, max_new_tokens=512, max_len=2048)
    )
    """Engine and sampling (engine, engine_slots, n_samples, temperature, top_p, top_k, max_new_tokens,
    max_len). With engine_slots 0 the native engine decodes prompts_per_step x n_samples sequences at once."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward source (reward.source, reward.timeout_s); rewards are written raw (no shaping)."""
    output: str = ""
    """The JSONL file to write (required); replaced atomically when the run completes."""
    select: SelectMode = "all"
    """Which rows to write: all (every sample), best_of_n (the best per prompt), rejection (reward >=
    threshold), pairs (best vs worst per prompt, DPO), conditional (every sample, its reward in the prompt).
    Every mode but all needs a reward."""
    threshold: float = 0.5
    """rejection: keep samples whose reward is >= this."""
    max_per_prompt: int = 0
    """rejection: keep at most this many (the best) samples per prompt; 0 = every sample that passes."""
    condition_template: str = DEFAULT_CONDITION
    """conditional: the prompt written for each sample, a Python format string with {input} (the prompt, or
    for a chat the last user message) and {reward} (a float; a format spec such as {reward:.1f} is allowed)."""
    seed: int = 42
    """Sampling seed: the same seed, model, prompts and settings write the same file."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto = cuda when available, else cpu."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_per_prompt < 0:
            raise invalid("max_per_prompt", self.max_per_prompt, "an int >= 0 (0 = no limit)")
        check_condition_template(self.condition_template)


def check_condition_template(template: str) -> None:
    """`invalid(...)` unless `template` is a format string using exactly the fields {input} and {reward}."""
    want = "a format string with {input} and {reward} (e.g. '<rm_score>: {reward:.1f} {input}')"
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        template.format(input="x", reward=1.0)
    except (ValueError, KeyError, IndexError) as e:
        raise invalid("condition_template", template, f"{want}; it does not format ({e})") from None
    if names != {"input", "reward"}:
        raise invalid("condition_template", template, f"{want}; it has fields {sorted(names)}")


@dataclass(kw_only=True, slots=True)
class IterativeDPOConfig:
    """Iterative DPO: generate, score, pair and DPO, for several rounds."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The starting model (LoRA settings apply to each round's DPO)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data (as `relayrl generate`), unless task.name is set."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """A built-in task as the prompt source and reward."""
    rollout: RolloutConfig = field(
        default_factory=lambda: RolloutConfig(n_samples=4, max_new_tokens=512, max_len=2048)
    )
    """Sampling of each round (n_samples per prompt, temperature, max_new_tokens, engine)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward source that ranks each prompt's samples."""
    dpo: DPOSection = field(default_factory=DPOSection)
    """DPO options of each round (the reference is always the round's starting model)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer of each round's DPO."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Each round's DPO loop (batch size, epochs / max_steps per round); output_dir is the whole run's folder."""
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    """Checkpoints of each round's DPO."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics sinks of each round's DPO."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Data parallelism of each round's DPO."""
    rounds: int = 3
    """Rounds of generate -> score -> pair -> DPO."""
    seed: int = 42
    """Sampling seed (round k samples with seed + k)."""

    def __post_init__(self) -> None:
        check_finite(self)
        if self.rounds < 1:
            raise invalid("rounds", self.rounds, "an int >= 1")
        if self.dpo.ref_model:
            raise invalid(
                "dpo.ref_model", self.dpo.ref_model, "empty: each round's reference is its start model"
            )
        self.dist.check_command("model")
