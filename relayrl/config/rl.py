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
      critic: CriticConfig      the critic (only built for `gae`)
      eval: EvalConfig          eval every k steps, pass@k, best-checkpoint metric
      dist: DistConfig          execution mode (local / ray)

Every algorithm choice is a *name* looked up in a registry of relayrl.algorithms (see docs/rl.md for the
table); the trainer never branches on the name. The names and what each needs (critic, groups, reference
model) come from relayrl.algorithms.registry, which imports no torch, so parsing this config never loads
torch. Unknown names fail while parsing (`AlgoConfig.__post_init__` -> `check_algo_names`), naming the field,
the bad value and the valid choices; `validate_rl_config` checks the rest before any work starts.

Presets: `algo.preset NAME` (relayrl.algorithms.ALGORITHM_PRESETS) picks advantage, policy loss, aggregation,
KL mode / estimator and clip range in one setting. Those fields default to "" / None ("not set"), so a value
set explicitly (flag or YAML) wins; `resolve_algo(algo) -> AlgoConfig` fills the rest from the preset or the
built-in defaults (rl_build.validate_rl_config applies it before the run's config.yaml is written).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Literal

from relayrl.algorithms.presets import ALGORITHM_PRESETS
from relayrl.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_MODES,
    OFF_POLICY,
    POLICY_LOSSES,
)
from relayrl.config.base import check_choices, invalid
from relayrl.config.components import (
    CkptConfig,
    DataConfig,
    DataParallelConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
)


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

    def __post_init__(self) -> None:
        check_choices(self)
        if self.max_staleness < 0:
            raise invalid("max_staleness", self.max_staleness, "an int >= 0 (policy versions)")
        if self.log_every < 1:
            raise invalid("log_every", self.log_every, "an int >= 1")
        if self.max_steps < 0:
            raise invalid(
                "max_steps", self.max_steps, "an int >= 0 (RL steps; 0 = one pass over the prompts)"
            )


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """How trajectories are sampled."""

    engine: str = "native"
    """Rollout engine: native (built in, reads the policy's weights in place), hf (transformers.generate) or
    vllm (optional package, in-process, weights streamed from the trainer after every step)."""
    engine_device: str = ""
    """Device of the engine and its weight copy (e.g. cuda:1: generation on a second GPU while the policy trains
    on the first; with train.async_train they overlap). Empty: the policy's device."""
    vllm_args: str = ""
    """vllm engine: more vllm.EngineArgs as a JSON object, over relayrl's own (e.g. '{"enforce_eager": true}',
    '{"max_num_batched_tokens": 8192}'); the arguments relayrl derives from other settings are refused."""
    engine_slots: int = 0
    """Native engine: sequences decoded together (rows of its preallocated KV cache). More slots batch more
    samples per decode step (faster on a GPU) for KV memory of layers x slots x kv_heads x max_len x head_dim
    x 2 values. 0: one slot per sample of a step (prompts_per_step x n_samples)."""
    prompts_per_step: int = 8
    """Prompts sampled per RL step (the rollout batch); each gets `n_samples` completions."""
    n_samples: int = 4
    """Samples per prompt (the group size of group estimators)."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are of the temperature-scaled distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 disables; with truncation use an off-policy correction)."""
    top_k: int = 0
    """Top-k sampling (0 disables)."""
    max_new_tokens: int = 32
    """Most tokens generated per turn."""
    max_len: int = 256
    """Total length limit (prompt + every turn); longer prompts are dropped and counted."""
    agent: str = "single"
    """Agent executor: single (one completion per sample), multi (drives `agent_file`'s AgentInstance), or a
    path to a Python file defining an AgentExecutor."""
    agent_file: str = ""
    """Python file with the user's AgentInstance (multi-turn agents) or a built-in multi-turn task name."""
    max_turns: int = 8
    """Most turns of a multi-turn agent."""
    failure_policy: str = "drop_group"
    """What failed samples do: drop_group (default), drop_sample, zero_reward (counted), raise."""

    def __post_init__(self) -> None:
        self.vllm_engine_args()

    def vllm_engine_args(self) -> dict:
        """`vllm_args` parsed (empty: {}); a ConfigError when it is not a JSON object or sets an argument that
        relayrl derives from its own config (VLLM_ARGS_FROM_CONFIG: the weight group's rank layout and the
        lengths depend on them)."""
        if not self.vllm_args:
            return {}
        try:
            args = json.loads(self.vllm_args)
        except json.JSONDecodeError as exc:
            raise invalid("vllm_args", self.vllm_args, f"a JSON object of vllm.EngineArgs ({exc})") from exc
        if not isinstance(args, dict):
            raise invalid("vllm_args", self.vllm_args, "a JSON object of vllm.EngineArgs")
        for key, source in VLLM_ARGS_FROM_CONFIG.items():
            if key in args:
                raise invalid("vllm_args", self.vllm_args, f"no {key!r}: relayrl sets it from {source}")
        return args


VLLM_ARGS_FROM_CONFIG = {
    "model": "model.name_or_path",
    "max_model_len": "rollout.max_len",
    "tensor_parallel_size": "dist.engine_tp",
    "pipeline_parallel_size": "dist.engine_tp (tensor parallelism only)",
    "data_parallel_size": "dist.num_engines",
    "distributed_executor_backend": "dist.num_engines / dist.engine_tp",
    "skip_tokenizer_init": "the engine protocol (token ids in and out)",
}
"""vllm.EngineArgs that `rollout.vllm_args` may not set, and the setting that decides each."""


BUILTIN_ALGO = {
    "advantage": "group_norm",
    "policy_loss": "ppo",
    "aggregation": "token_mean",
    "kl_mode": "none",
}
"""What an empty preset-controlled name means when no preset is chosen."""


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    """The RL algorithm: every choice is a registry name (relayrl.algorithms). Empty names / None clip ranges
    mean "the preset's choice, else the built-in default"; `resolve_algo` fills them in."""

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
    off_policy: str = ""
    """Rollout-vs-trainer log-prob mismatch correction: none, tis, icepop, seq_mask_tis. Empty: tis with
    train.async_train (stale samples need it), else none."""
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
    micro_batch_tokens: int = 4096
    """Token budget of one micro-batch (packed sequences); the loss is normalised over the mini-batch."""
    value_clip: float = 0.2
    """Value clipping range of the critic loss (gae)."""

    def __post_init__(self) -> None:
        check_algo_names(self)


def algo_choices() -> dict[str, tuple[str, ...]]:
    """{AlgoConfig field: its valid registry names} (read from the registries, so new entries count; no
    implementation is imported)."""
    return {
        "preset": tuple(ALGORITHM_PRESETS),
        "advantage": tuple(ADVANTAGES),
        "policy_loss": tuple(POLICY_LOSSES),
        "aggregation": tuple(AGGREGATIONS),
        "kl_mode": tuple(KL_MODES),
        "kl_estimator": tuple(KL_ESTIMATORS),
        "kl_controller": tuple(KL_CONTROLLERS),
        "off_policy": tuple(OFF_POLICY),
    }


def check_algo_names(a: AlgoConfig) -> None:
    """`invalid(...)` naming the field, the bad name and the valid choices, for any unknown registry name
    (runs in `AlgoConfig.__post_init__`, so a bad flag or YAML value fails while parsing)."""
    may_be_empty = ("preset", *BUILTIN_ALGO, "kl_estimator", "off_policy")
    for name, choices in algo_choices().items():
        value = getattr(a, name)
        if value not in choices and not (value == "" and name in may_be_empty):
            raise invalid(name, value, "one of: " + ", ".join(choices))


def resolve_algo(a: AlgoConfig) -> AlgoConfig:
    """A copy of `a` with every preset-controlled name filled in: the field's own value when set, else the
    preset's (`algo.preset`), else the built-in default (BUILTIN_ALGO; KL estimator k1 for kl_mode=reward,
    k3 otherwise). Clip ranges stay None when neither the user nor the preset sets them: each policy loss
    then uses its own default. Idempotent."""
    p = ALGORITHM_PRESETS.get(a.preset) if a.preset else None
    names = {k: getattr(a, k) or (str(getattr(p, k)) if p else v) for k, v in BUILTIN_ALGO.items()}
    if a.kl_estimator:
        estimator = a.kl_estimator
    elif p is not None and p.kl_mode != "none" and names["kl_mode"] == str(p.kl_mode):
        estimator = p.kl_estimator
    else:
        estimator = "k1" if names["kl_mode"] == "reward" else "k3"
    return replace(
        a,
        **names,
        off_policy=a.off_policy or "none",
        kl_estimator=estimator,
        clip_eps_low=a.clip_eps_low if a.clip_eps_low is not None else (p.eps_low if p else None),
        clip_eps_high=a.clip_eps_high if a.clip_eps_high is not None else (p.eps_high if p else None),
    )


@dataclass(kw_only=True, slots=True)
class TaskConfig:
    """A built-in task (relayrl/tasks) as the prompt source, reward and eval (instead of `data`)."""

    name: str = ""
    """Task name (add2, add3, guess, ...); empty = prompts from `data` and rewards from `reward.source`."""
    train_rows: int = 2000
    """Training prompts generated from the task."""
    eval_rows: int = 200
    """Held-out eval prompts generated from the task (disjoint from training)."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """Where rewards come from and how they are shaped."""

    source: str = ""
    """Reward source: task:<name>, a reward_func .py file, http(s) URL(s) of remote RMs (comma-separated),
    rm:<path> (a local reward model), or agent (the multi-turn agent's own rewards). Empty: the task's
    reward when `task.name` is set, the agent's own rewards for multi-turn agents."""
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
class CriticConfig:
    """The critic (value model); built only for estimators that need values (gae)."""

    model_path: str = ""
    """Critic initial weights; empty uses the policy's path (value head freshly initialised)."""
    lr: float = 1e-4
    """Critic learning rate."""
    epochs: int = 1
    """Critic passes over each step's experience."""


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


ROLE_SIZE_FIELDS = tuple(
    f"{role}_{what}" for role in ("policy", "ref", "critic") for what in ("num_nodes", "num_gpus_per_node")
)
"""The DistConfig fields that size the model roles (nodes x ranks per node)."""


@dataclass(kw_only=True, slots=True)
class DistConfig:
    """Execution and placement: every role in this process (local), or Ray actors with data-parallel,
    FSDP2-sharded roles (ray). Role sizes and colocation use OpenRLHF's terms (docs/distributed.md)."""

    mode: str = "local"
    """local (every role in this process, one rank each) or ray (each role a group of Ray actors)."""
    ray_address: str = ""
    """Ray cluster address (e.g. HEAD_IP:6379 after `ray start --head`); empty starts a local cluster."""
    num_cpus: int = 2
    """CPUs of the local Ray cluster started when no address is given."""
    gpus: Literal["auto", "yes", "no"] = "auto"
    """auto (use GPUs when the Ray cluster has them), yes, no. Without GPUs every rank is a CPU process
    (gloo) and the *_num_gpus_per_node values count processes."""
    policy_num_nodes: int = 1
    """Nodes of the policy (actor) role."""
    policy_num_gpus_per_node: int = 1
    """Ranks of the policy role per node (one GPU each): the policy is sharded over nodes x this."""
    ref_num_nodes: int = 1
    """Nodes of the reference role."""
    ref_num_gpus_per_node: int = 1
    """Ranks of the reference role per node."""
    critic_num_nodes: int = 1
    """Nodes of the critic role."""
    critic_num_gpus_per_node: int = 1
    """Ranks of the critic role per node."""
    num_engines: int = 0
    """Rollout engines as actors of their own, engine_tp GPUs each (OpenRLHF's --vllm_num_engines; ray mode):
    each holds a full copy of the policy (vllm: sharded over its tp workers) and generates a share of the
    prompts; the policy's rank 0 broadcasts new weights to them over NCCL (gloo on CPUs) after every step.
    0: each policy rank runs its own engine on its GPU (colocated). Engine native, hf or vllm."""
    engine_tp: int = 1
    """GPUs of each separate engine (tensor parallelism inside the engine, OpenRLHF's
    --vllm_tensor_parallel_size): > 1 needs dist.num_engines > 0 and rollout.engine vllm (vLLM shards the
    model over the engine actor's GPUs; each of its workers receives the broadcast weights)."""
    colocate_policy_ref: bool = False
    """Reference ranks share the policy's GPUs (same sizes required), as OpenRLHF's --colocate_actor_ref."""
    colocate_critic_reward: bool = False
    """The reward role shares the critic's first GPU, as OpenRLHF's --colocate_critic_reward (rule-based and
    remote rewards need no GPU: then it only places the reward actor beside the critic)."""
    colocate_all: bool = False
    """Every role on the policy's GPUs (reference and critic need the policy's sizes), as OpenRLHF's
    --colocate_all_models (add --dist.engine_sleep yes to free the KV cache during updates)."""
    offload: bool = False
    """FSDP2 CPU offload of the trained roles' parameters, gradients and optimizer states (the optimizer
    step runs on the CPU): for models that do not fit the GPUs' memory otherwise."""
    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward (ZeRO-3); False keeps them until the backward
    (ZeRO-2-like: faster, more memory)."""
    engine_sleep: Literal["auto", "yes", "no"] = "auto"
    """The rollout engine frees its KV cache (and CUDA graphs) while the policy trains and re-allocates them
    before the next rollout, so training can use that memory: yes, no, auto (= no: waking re-allocates and
    re-captures, ~0.5 s per step measured on an H100 for a 0.5B model; turn it on when memory is short)."""
    offload_optimizer_in_rollout: bool = False
    """Move the policy's optimizer states to CPU memory during rollout (back before the update)."""
    timeout_s: float = 600.0
    """Bound on every collective and on waiting for a role: a dead or stuck rank stops the run with an error
    naming the role, rank and host within this time."""

    def __post_init__(self) -> None:
        for name in ROLE_SIZE_FIELDS:
            if getattr(self, name) < 1:
                raise invalid(name, getattr(self, name), "an int >= 1")
        if self.timeout_s <= 0:
            raise invalid("timeout_s", self.timeout_s, "a number of seconds > 0")
        if self.num_engines < 0:
            raise invalid("num_engines", self.num_engines, "an int >= 0 (0: the engine is colocated)")
        if self.engine_tp < 1:
            raise invalid("engine_tp", self.engine_tp, "an int >= 1 (GPUs per separate engine)")
        check_choices(self)

    @classmethod
    def for_one_model(cls, d: DataParallelConfig) -> DistConfig:
        """The placement of a one-model recipe (SFT; RM / DPO / KTO next): its model is the "policy"-sized role."""
        return cls(
            mode=d.mode,
            ray_address=d.ray_address,
            num_cpus=d.num_cpus,
            gpus=d.gpus,
            policy_num_nodes=d.num_nodes,
            policy_num_gpus_per_node=d.num_gpus_per_node,
            offload=d.offload,
            reshard_after_forward=d.reshard_after_forward,
            timeout_s=d.timeout_s,
        )

    def ranks(self, role: str) -> int:
        """Ranks of `role` (policy / ref / critic) in ray mode; 1 in local mode."""
        if self.mode != "ray":
            return 1
        return getattr(self, f"{role}_num_nodes") * getattr(self, f"{role}_num_gpus_per_node")


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
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Critic (gae only)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    dist: DistConfig = field(default_factory=DistConfig)
    """Execution mode."""
    ema: float = 0.0
    """Decay of an exponential moving average of the policy saved beside it (0 disables)."""


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
