"""Config of `relayrl rl`: the component configs (model, data, optim, ckpt, logger) plus the RL parts.

    RLConfig
      model: ModelConfig        policy (actor) weights; the reference model is the same path, frozen
      data: DataConfig          prompt data (or `task` for a built-in task)
      optim: OptimConfig        policy optimizer / schedule
      train: RLTrainConfig      steps, seed, device, output dir (batching lives in rollout / algo)
      ckpt: CkptConfig          where / how often / how many checkpoints
      logger: LoggerConfig      JSONL / TensorBoard / W&B
      task: TaskConfig          built-in task as prompt source + reward + eval
      rollout: RolloutConfig    engine, n samples per prompt, sampling, prompts per step, agent executor
      algo: AlgoConfig          estimator, policy loss, KL, aggregation, off-policy correction, epochs, batching
      reward: RewardConfig      where rewards come from (task / reward_func file / remote RM / local RM / agent)
                                and how they are shaped
      filter: FilterConfig      dynamic filtering (DAPO dynamic sampling) with bounded refill
      critic: CriticConfig      the critic (only built for `gae`) and its optimizer (critic.optim)
      eval: EvalConfig          eval every k steps, pass@k, best-checkpoint metric
      dist: DistConfig          execution mode (local / ray) and placement (relayrl.config.dist)

Every algorithm choice is a *name* looked up in a registry of relayrl.algorithms (see docs/rl.md for the
table); the trainer never branches on the name. This module imports nothing from relayrl.algorithms:
parsing checks types and ranges only, and the one validation pass (`relayrl.trainers.rl.validate.validate_rl`)
checks the names against the registries, fills in the preset's choices and returns a `ResolvedRL`.

Presets: `algo.preset NAME` (relayrl.algorithms.ALGORITHM_PRESETS) picks advantage, policy loss, aggregation,
KL mode / estimator and clip range in one setting. Those fields default to "" / None ("not set"), so a value
set explicitly (flag or YAML) wins; `validate_rl` fills the rest from the preset or the built-in defaults
(relayrl.algorithms.presets.resolve_names) in the copy it returns. The user's RLConfig is never changed.

    ResolvedRL    an RLConfig that `validate_rl` returned: every algo name filled in and checked; what the
                  builders, the workers' specs and the run's config.yaml get
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, NewType

from relayrl.config.base import check_choices, check_finite, invalid
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
)
from relayrl.config.dist import DistConfig
from relayrl.config.rollout import RolloutConfig


@dataclass(kw_only=True, slots=True)
class RLTrainConfig:
    """The RL loop: steps, seed, device, run folder (per-step sizes and batching are in rollout.* / algo.*)."""

    seed: int = 42
    """Seed for weights init (value head), prompt order, sampling and dropout."""
    max_steps: int = 0
    """RL steps to run (each: rollout, experience, update, weight sync); 0 = one pass over the training
    prompts (ceil(prompts / rollout.prompts_per_step) steps)."""
    log_every: int = 1
    """Print a table of sampled completions every N steps (with logger.progress_bar), without template tokens
    and with a multi-turn episode's turns marked [assistant] / [env]; metrics and <run>/samples.jsonl (raw
    text) are written every step."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the policy (and reference / critic) run; auto = cuda when available, else cpu."""
    output_dir: str = ""
    """Run folder (config, metrics, samples, checkpoints, final model); empty = runs/rl."""
    async_train: bool = False
    """Overlap rollout with training (OpenRLHF's --async_train): while step k trains, the batch of step k+1
    (up to k+max_staleness) is generated. At each weight sync the engine pauses its in-flight requests, takes
    the new weights and continues (partial rollout); every token records the policy version that produced it.
    The off-policy correction (algo.off_policy) defaults to tis. Resume restarts the pipeline: the same
    prompts and seeds per step, samples not bitwise equal to an uninterrupted run (docs/rl.md)."""
    max_staleness: int = 1
    """Async training: a batch trained at step k was started no earlier than policy version k-1-max_staleness,
    so no token is more than max_staleness versions older than the weights it is trained on (older samples'
    groups are dropped and counted as async/dropped_stale); 0 = no overlap (each batch waits for the
    previous step's weights)."""
    gil_switch_s: float = 0.0
    """Async training: CPython's GIL switch interval in seconds (sys.setswitchinterval) while the rollout
    pipeline runs. Two Python threads (producer + engine driver) share the GIL with the trainer, which launches
    many small kernels, each needing the GIL; a shorter interval makes it wait less per launch behind a busy
    thread. 0: CPython's own (5 ms)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.gil_switch_s < 0:
            raise invalid("gil_switch_s", self.gil_switch_s, "a number of seconds >= 0 (0 = CPython's own)")
        if self.max_staleness < 0:
            raise invalid("max_staleness", self.max_staleness, "an int >= 0 (policy versions)")
        if self.log_every < 1:
            raise invalid("log_every", self.log_every, "an int >= 1")
        if self.max_steps < 0:
            raise invalid(
                "max_steps", self.max_steps, "an int >= 0 (RL steps; 0 = one pass over the prompts)"
            )


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    """The RL algorithm: every choice is a registry name (relayrl.algorithms). Empty names / None clip ranges
    mean "the preset's choice, else the built-in default"; the validation pass (`validate_rl`) fills them in."""

    preset: str = ""
    """Algorithm preset, one setting for a known recipe: ppo, reinforce++, reinforce++_baseline, rloo, grpo,
    dr_grpo, dapo, gspo, cispo (docs/rl.md lists what each sets). Empty: no preset. Any algo field set
    explicitly (flag or YAML) wins over the preset."""
    advantage: str = ""
    """Advantage estimator: gae, reinforce, reinforce_baseline, rloo, group_norm, dr_grpo. Empty: the preset's,
    else group_norm."""
    gamma: float = 1.0
    """Discount factor (gae / reinforce)."""
    lam: float = 0.95
    """GAE lambda."""
    policy_loss: str = ""
    """Policy loss: ppo (clip-higher when clip_eps_high > clip_eps_low), dual_clip, gspo, cispo. Empty: the
    preset's, else ppo."""
    clip_eps_low: float | None = None
    """Lower clip range of the ratio (1 - eps_low). None: the preset's, else the policy loss's own default
    (ppo 0.2, gspo 3e-4, cispo 1.0 = no lower bound)."""
    clip_eps_high: float | None = None
    """Upper clip range of the ratio (1 + eps_high); > eps_low for clip-higher. None: the preset's, else the
    policy loss's own default (ppo: = eps_low, gspo 4e-4, cispo 0.28)."""
    dual_clip_c: float = 0.0
    """Dual-clip constant c > 1 for negative advantages; 0 = the loss's default (off for ppo, 3 for dual_clip)."""
    aggregation: str = ""
    """Loss aggregation over the optimizer step: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm
    (Dr. GRPO's constant normaliser, set by `max_new_tokens`). Empty: the preset's, else token_mean."""
    kl_mode: str = ""
    """KL to the reference: none (no reference model), monitor (measured and logged only), reward (per-token
    penalty in the reward), loss (a loss term). Empty: the preset's, else none."""
    kl_estimator: str = ""
    """KL estimator: k1, k2, k3. Empty: the preset's (when its KL mode is used), else k1 for kl_mode=reward
    and k3 otherwise."""
    kl_coef: float = 0.0
    """Initial KL coefficient beta (0: the KL is measured, not applied)."""
    kl_controller: str = "fixed"
    """KL controller: fixed or adaptive."""
    kl_target: float = 0.1
    """Target KL of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon of the adaptive controller."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0: entropy is a metric only)."""
    aux_loss_coef: float = 0.0
    """Mixture-of-experts policies: weight of the router load-balancing loss added to the policy loss (as
    OpenRLHF's --aux_loss_coef; transformers' load_balancing_loss_func over fp32 router logits), logged as
    train/aux_loss. 0: off. Dense models ignore it."""
    off_policy: str = ""
    """Rollout-vs-trainer log-prob mismatch correction: none, tis, icepop, seq_mask_tis. Empty: tis with
    train.async_train (stale samples need it) or rollout.quantization fp8 (the engine's fp8 weights), else
    none."""
    off_policy_low: float | None = None
    """Lower bound of the IS weight. None: the method's own default (tis 0 = no lower bound, icepop 0.5,
    seq_mask_tis 0.5)."""
    off_policy_high: float | None = None
    """Upper bound of the IS weight (the cap of tis / seq_mask_tis). None: the method's own default (tis 2,
    icepop 5, seq_mask_tis 2)."""
    epochs: int = 1
    """Passes over each step's experience."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the experience is split into this many mini-batches)."""
    micro_batch_tokens: int = 0
    """Token budget of one training micro-batch (packed sequences); the loss is normalised over the
    mini-batch, so the split does not change the update. 0 (auto): 4096 on a CPU; on a CUDA device picked
    from the model's shape and the free memory at the first pass, 4096 to 65536 (relayrl/models/budget.py;
    logged). Lower it if the update runs out of memory."""
    infer_micro_batch_tokens: int = 0
    """Token budget of one no-gradient forward (old, reference and teacher log-probs, critic values). 0
    (auto): micro_batch_tokens on a CPU, 4 x its (resolved) value on a CUDA device (no activations are kept
    for a backward)."""
    value_clip: float = 0.2
    """Value clipping range of the critic loss (gae)."""

    def __post_init__(self) -> None:
        if self.aux_loss_coef < 0:
            raise invalid(
                "aux_loss_coef", self.aux_loss_coef, "a float >= 0 (0 = no router load-balancing loss)"
            )


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """A built-in task (relayrl/tasks) as the prompt source, reward and eval (instead of `data`)."""

    name: str = ""
    """Task name (add2, add3, guess, image_digit: read the digit in a picture, for vision-language models);
    empty = prompts from `data` and rewards from `reward.source`."""
    train_rows: int = 2000
    """Training prompts generated from the task."""
    eval_rows: int = 200
    """Held-out eval prompts generated from the task (disjoint from training)."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Where rewards come from and how they are shaped."""

    source: str = ""
    """Reward source: task:<name>, a reward_func .py file, http(s) URL(s) of remote RMs (comma-separated),
    rm:<path> (a local reward model), prm:<path> (a process reward model: per-step scores), or agent (the
    multi-turn agent's own rewards). Empty: the task's reward when `task.name` is set, the agent's own
    rewards for multi-turn agents."""
    prm_outcome: Literal["dense", "min", "last"] = "dense"
    """prm:<path> sources: dense (each step's score as a token reward at its last token), min or last (that
    step score as the sequence reward)."""
    prm_step_separator: str = "\n"
    """prm:<path> sources: a generated token whose text contains this ends a step (the last token always
    does); "" = only the PRM's placeholder token."""
    timeout_s: float = 60.0
    """Timeout of one reward call."""
    clip: float = 0.0
    """Clip rewards to [-clip, clip] (0 disables)."""
    overlong_buffer: int = 0
    """DAPO overlong penalty: linear penalty over the last `overlong_buffer` tokens before the limit."""
    overlong_penalty: float = 1.0
    """Largest overlong penalty."""
    truncation_penalty: float = 0.0
    """Subtracted from the reward of a response cut at the length limit."""
    normalize: bool = False
    """Running normalisation of rewards."""


@dataclass(kw_only=True, slots=True)
class DistillConfig:
    """On-policy distillation: a teacher scores every token the policy samples (relayrl.algorithms.distill)."""

    teacher: str = ""
    """Teacher model folder or hub id (the policy's tokenizer); empty = off. Each action token gets the dense
    reward -coef * (log pi(x_t) - log teacher(x_t)) (per-token reverse KL); the teacher runs as a role sharded
    like the reference (dist.ref_*)."""
    coef: float = 1.0
    """Weight of the reverse-KL reward, > 0."""
    outcome: bool = True
    """Keep the reward source's outcome reward beside it; false: the reverse KL alone (pure distillation)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef > 0):
            raise invalid("coef", self.coef, "a finite float > 0")


@dataclass(kw_only=True, slots=True)
class FilterConfig:
    """Dynamic filtering (DAPO dynamic sampling): drop uninformative groups and refill from new prompts."""

    enabled: bool = False
    """Drop groups whose scores have zero variance or whose mean is outside [min_mean, max_mean]."""
    min_mean: float = 0.0
    """Lowest accepted group mean score."""
    max_mean: float = 1.0
    """Highest accepted group mean score."""
    max_refills: int = 3
    """Extra rollout rounds per step to refill dropped groups (bounded; the count is logged)."""


@dataclass(kw_only=True, slots=True)
class CriticOptimConfig:
    """The critic's optimizer and schedule: a field left None takes the policy's (optim.*); the peak learning
    rate is critic.lr. Defaults: the policy's AdamW settings and schedule with the critic's lr."""

    weight_decay: float | None = None
    """AdamW decoupled weight decay; None: optim.weight_decay."""
    adam_betas: tuple[float, float] | None = None
    """AdamW (beta1, beta2), each in [0, 1); None: optim.adam_betas."""
    eps: float | None = None
    """AdamW epsilon; None: optim.eps."""
    max_grad_norm: float | None = None
    """Clip the critic's global gradient norm to this value (0 = no clipping); None: optim.max_grad_norm."""
    scheduler: Literal["cosine", "linear", "constant"] | None = None
    """Decay after warmup: cosine, linear or constant; None: optim.scheduler."""
    warmup_steps: int | None = None
    """Linear warmup steps (> 0 overrides warmup_ratio); None: optim.warmup_steps."""
    warmup_ratio: float | None = None
    """Warmup as a fraction of the critic's optimizer steps; None: optim.warmup_ratio."""
    min_lr_ratio: float | None = None
    """Final learning rate as a fraction of critic.lr, in [0, 1]; None: optim.min_lr_ratio."""

    def __post_init__(self) -> None:
        check_choices(self)
        OptimConfig(**self.overrides())  # the same range checks as the policy's section

    def overrides(self) -> dict[str, Any]:
        """{field: value} of the fields set (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


@dataclass(kw_only=True, slots=True)
class CriticConfig:
    """The critic (value model); built only for estimators that need values (gae)."""

    model_path: str = ""
    """Critic initial weights; empty uses the policy's path (value head freshly initialised)."""
    lr: float = 1e-4
    """Critic peak learning rate."""
    epochs: int = 1
    """Critic passes over each step's experience."""
    optim: CriticOptimConfig = field(default_factory=CriticOptimConfig)
    """The critic's optimizer and schedule (unset fields: the policy's optim.*)."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise invalid("lr", self.lr, "a float > 0")

    def optimizer(self, policy: OptimConfig) -> OptimConfig:
        """The critic's whole optimizer section: the policy's `policy`, with lr = critic.lr and every
        critic.optim field that is set."""
        return replace(policy, lr=self.lr, **self.optim.overrides())


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Evaluation on the eval set."""

    every: int = 0
    """Evaluate every `every` steps (and at the end); 0 disables."""
    n_samples: int = 1
    """Samples per eval prompt for pass@k (1: greedy pass@1 only)."""
    temperature: float = 0.0
    """Eval sampling temperature (0: greedy; with n_samples > 1 use > 0)."""
    max_prompts: int = 0
    """Evaluate on at most this many prompts (0: all)."""
    correct_threshold: float = 0.5
    """A sample counts as correct for pass@k when its score is above this."""


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """`relayrl rl`: RL post-training (PPO / REINFORCE++ / GRPO / RLOO / Dr.GRPO / GSPO / CISPO)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Policy optimizer."""
    train: RLTrainConfig = field(default_factory=RLTrainConfig)
    """Steps, seed, device, output folder."""
    ckpt: CkptConfig = field(default_factory=lambda: CkptConfig(best_metric="eval/pass@1", best_mode="max"))
    """Checkpoints."""
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    """Metrics logging."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Built-in task (prompts + reward + eval)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards."""
    filter: FilterConfig = field(default_factory=FilterConfig)
    """Dynamic filtering."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher (off unless distill.teacher is set)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Critic (gae only)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Execution mode."""
    ema: float = 0.0
    """Decay of an exponential moving average of the policy saved beside it (0 disables)."""

    def __post_init__(self) -> None:
        check_finite(self)
        self.dist.check_command("rl")


ResolvedRL = NewType("ResolvedRL", RLConfig)
"""An RLConfig returned by `relayrl.trainers.rl.validate.validate_rl`: the algo names filled in from the preset
and the built-in defaults (algo.off_policy too: tis under train.async_train, else none) and every check passed.
Only `validate_rl` makes one; what builds the run takes one, so nothing re-resolves or re-checks."""
