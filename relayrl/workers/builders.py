"""Construction of what the role workers own, in one place: models, the training step, the objective, the
engine and the executor. Workers call these with the component configs they read (never a whole RLConfig);
the controller never does.

    setup_process(seed)                              seeds (relayrl.training.rng) for a worker process
    inference_dtype(model_cfg, device)               dtype of frozen copies (engine, reference): bf16 on a GPU
                                                     unless model.dtype is fp32; fp32 on a CPU
    build_trainable(model_cfg, device, sharded=)     causal LM with fp32 master weights (+ LoRA); sharded:
                                                     built empty, each rank reads its own shards
                                                     (relayrl.distributed.sharded_load)
    build_frozen(model_cfg, device, sharded=)        frozen causal LM in the inference dtype (reference)
    build_policy_objective(algo, max_new_tokens)     PolicyObjective from the resolved AlgoConfig
    exact_on_policy(algo)                            True when the update needs no separate old-log-prob pass
    build_engine_for(rollout, eval, model, tok)      RolloutEngine over `model` (the engine copy or the policy)
                                                     through the one factory (relayrl.rollout.build); an engine
                                                     that loads its own weights (vllm): over the policy's folder
    build_executor(rollout, engine, tok, ...)        AgentExecutorBase: single / multi-turn / user file

The objective's pieces are looked up by name in the algorithm registries; there is no branching on names.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from relayrl.agents.base import AgentExecutorBase
from relayrl.agents.executors import SingleTurnExecutor
from relayrl.agents.loader import load_agent_from_file
from relayrl.algorithms.objective import PolicyObjective
from relayrl.config.components import ModelConfig
from relayrl.config.dist import DistConfig
from relayrl.config.rl import AlgoConfig, EvalConfig, RolloutConfig
from relayrl.distributed.group import world
from relayrl.distributed.sharded_load import load_for_shards
from relayrl.models.empty import empty_causal_lm
from relayrl.models.loading import load_causal_lm, load_tokenizer
from relayrl.rollout.base import EngineSettings, RolloutEngine
from relayrl.rollout.build import build_engine, engine_capabilities
from relayrl.tasks import get_task
from relayrl.training.rng import seed_everything


def setup_process(seed: int) -> None:
    """Seed python / numpy / torch for a worker process (local or Ray actor)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    seed_everything(seed)


def inference_dtype(model: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype of frozen copies (the engine's weights, the reference model): fp32 on a CPU; on a GPU
    model.dtype (auto = bf16)."""
    if device.type != "cuda":
        return torch.float32
    return {"fp32": torch.float32, "fp16": torch.float16}.get(model.dtype, torch.bfloat16)


def build_trainable(
    model: ModelConfig, device: torch.device, *, sharded: bool = False
) -> tuple[torch.nn.Module, Any]:
    """(causal LM, tokenizer): the trained weights are fp32 masters (mixed precision computes in bf16).
    `sharded`: one rank of a sharded role: built empty when the checkpoint allows, filled by shard_model
    (relayrl.distributed.sharded_load), else loaded whole on the CPU."""
    tokenizer = load_tokenizer(
        model.tokenizer_name_or_path or model.name_or_path, trust_remote_code=model.trust_remote_code
    )
    cfg = replace(model, dtype="fp32")
    if sharded:
        cpu = torch.device("cpu")
        m = load_for_shards(
            lambda: empty_causal_lm(cfg), lambda: load_causal_lm(cfg, device=cpu, lora=True), what="policy"
        )
        return m, tokenizer
    return load_causal_lm(cfg, device=device, lora=True), tokenizer


def build_frozen(
    model: ModelConfig, device: torch.device, like: torch.device | None = None, *, sharded: bool = False
) -> torch.nn.Module:
    """A frozen causal LM on `device` in the inference dtype of device `like` (default `device`), without
    adapters (the reference policy). `sharded`: one rank of a sharded role: built empty when the checkpoint
    allows (filled by shard_model), else loaded whole on the CPU (`device` is then the CPU)."""
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
        inference_dtype(model, like or device)
    ]
    cfg = replace(model, dtype=dtype, gradient_checkpointing=False)
    if sharded:
        m = load_for_shards(
            lambda: empty_causal_lm(cfg, lora=False),
            lambda: load_causal_lm(cfg, device=device, lora=False),
            what="frozen model",
        )
    else:
        m = load_causal_lm(cfg, device=device, lora=False)
    m.eval()
    m.requires_grad_(False)
    return m


def build_policy_objective(algo: AlgoConfig, max_new_tokens: int) -> PolicyObjective:
    """The policy objective of the resolved algorithm config (relayrl.trainers.rl.validate.validate_rl). Clip
    ranges the user and the preset left unset go to the loss as None, so each loss applies its own default."""
    a = algo
    return PolicyObjective(
        policy_loss=a.policy_loss,
        eps_low=a.clip_eps_low,
        eps_high=a.clip_eps_high,
        dual_clip=a.dual_clip_c or None,
        aggregation=a.aggregation,
        norm_const=float(max_new_tokens),
        kl_loss_estimator=a.kl_estimator if a.kl_mode == "loss" else None,
        entropy_coef=a.entropy_coef,
        off_policy=a.off_policy,
        off_policy_low=a.off_policy_low,
        off_policy_high=a.off_policy_high,
    )


def exact_on_policy(algo: AlgoConfig) -> bool:
    """One epoch and one mini-batch: the weights being updated are the weights before the update (one
    optimizer step per RL step), so pi_old = pi_theta at the update and the old-log-prob forward is skipped:
    the detached current log-probs stand in (ratio 1, as PPO's first epoch), and an off-policy correction
    (tis, icepop, ...) weighs with exp(detached current - rollout), the same pi_old / pi_rollout the pass would
    give. A KL in the reward still needs the trainer's log-probs before the update, so it keeps the forward.
    `algo`: resolved (validate_rl)."""
    return algo.epochs == 1 and algo.mini_batches == 1 and algo.kl_mode != "reward"


ENGINE_COPY_SHARE = 0.05
"""rollout.engine_copy auto: the engine's own copy at most this share of the GPU's memory."""


def engine_copy(
    rollout: RolloutConfig,
    model: ModelConfig,
    params: int,
    dtype: torch.dtype,
    device: torch.device,
    dist: DistConfig | None = None,
) -> bool:
    """Whether the colocated engine of a policy that is not sharded holds its own copy of the weights
    (rollout.engine_copy; auto: a native engine on a GPU, not exact, fp8 or LoRA, whose copy of `params`
    parameters in `dtype` takes <= ENGINE_COPY_SHARE of the device's memory, unless `dist` asks to save memory
    around the update: dist.engine_sleep yes or dist.offload_optimizer_in_rollout, which a copy held through
    the update would undo). A copy gets fused projections (relayrl/rollout/native_fused.py), which the
    policy's own parameters, training, never get."""
    if rollout.engine_copy != "auto":
        return rollout.engine_copy == "yes"
    plain = rollout.engine == "native" and not rollout.exact and rollout.quantization == "none"
    saving = dist is not None and (dist.engine_sleep == "yes" or dist.offload_optimizer_in_rollout)
    if not plain or saving or model.lora.rank > 0 or device.type != "cuda":
        return False
    copy_bytes = params * torch.empty((), dtype=dtype).element_size()
    return copy_bytes <= ENGINE_COPY_SHARE * torch.cuda.get_device_properties(device).total_memory


def engine_slots(rollout: RolloutConfig, engines: int) -> int:
    """KV slots of one of `engines` engines that share each step's prompts (the ranks of a colocated policy,
    or the separate engine actors; a tensor-parallel engine counts once): rollout.engine_slots when set, else
    the samples of this engine's share of a step's prompts, ceil(prompts_per_step / engines) x n_samples, plus
    1/8 of the share's prompts as slack (shares are balanced by prompt + max_new_tokens tokens, not by count:
    relayrl.workers.engine.generate_share), at most every prompt of the step. Requests beyond the slots wait
    in the engine's queue (the native engine admits a request when n slots are free), so fewer slots cost
    speed, never samples. One slot per sample of the whole step on each of N ranks was N times the KV cache
    (and CUDA-graph batch sizes) each engine can use."""
    if rollout.engine_slots:
        return rollout.engine_slots
    share = -(-rollout.prompts_per_step // max(1, engines))
    return min(rollout.prompts_per_step, share + -(-share // 8)) * rollout.n_samples


def build_engine_for(
    rollout: RolloutConfig,
    evaluation: EvalConfig,
    model: torch.nn.Module | None,
    tokenizer: Any,
    *,
    source: ModelConfig | None = None,
    tp: int = 0,
    group: Any = None,
) -> RolloutEngine:
    """The rollout engine of a policy rank or an engine actor, through the one factory (relayrl/rollout/
    build.py), over `model` (the policy's engine copy, or the policy itself when they share). An engine that
    loads its own weights (vllm) loads `source.name_or_path` instead (`model` is unused; the policy streams its
    weights after every step: LocalWeights(stream=True)) in the inference dtype, beside the trainer on its GPU;
    `tp` > 0: a separate engine actor's engine over `tp` GPUs, taking broadcast weights in its workers. Slots:
    `engine_slots` (at least the eval samples of a prompt). `group`: a TP group: `model` is this rank's shard
    of a tensor-parallel native engine (rollout/native_tp.py)."""
    caps = engine_capabilities(rollout.engine)
    tp_size = torch.distributed.get_world_size(group) if group is not None else 1
    slots = engine_slots(rollout, max(1, world() // tp_size))
    settings = EngineSettings(
        max_seq_len=rollout.max_len,
        max_seqs=max(slots, evaluation.n_samples),
        # multi-turn episodes send each turn as the whole conversation: the prefix cache prefills only the new
        # tokens (None: the engine's default for the device); single-turn rollouts (n samples of fresh prompts)
        # never hit it, so they skip its bookkeeping
        prefix_cache=None if rollout.agent != "single" else False,
        placement="separate" if tp else "colocated",
        tp=tp,
        exact=rollout.exact,
        fused_kernels=rollout.fused_kernels,
        record_routes=rollout.routing_replay,
    )
    if not caps.own_weights:  # fp8: a native engine keyword (the RL config refuses it for other engines)
        fp8 = {"quantization": "fp8"} if rollout.quantization == "fp8" else {}
        return build_engine(rollout.engine, model, tokenizer, settings, group=group, **fp8)
    if source is None or not source.name_or_path:
        raise ValueError(
            f"rollout.engine {rollout.engine} loads the policy from its folder: build_engine_for needs source= "
            "the policy's ModelConfig (model.name_or_path)"
        )
    if rollout.engine_device and torch.device(rollout.engine_device) not in (
        torch.device("cuda"),
        torch.device("cuda", 0),
    ):
        raise ValueError(
            f"rollout.engine_device={rollout.engine_device!r}: the in-process {rollout.engine} engine always runs "
            "on the process's first visible GPU (cuda:0; under Ray the worker's own GPU); leave engine_device empty"
        )
    settings.dtype = str(inference_dtype(source, torch.device("cuda"))).removeprefix("torch.")
    settings.trust_remote_code = source.trust_remote_code
    settings.engine_args = rollout.vllm_engine_args()
    settings.gpu_util, settings.any_version = rollout.vllm_gpu_util, rollout.vllm_any_version
    return build_engine(rollout.engine, source.name_or_path, tokenizer, settings)


def build_generation(
    rollout: RolloutConfig,
    evaluation: EvalConfig,
    model: torch.nn.Module | None,
    tokenizer: Any,
    *,
    source: ModelConfig,
    task_name: str,
    step_timeout: float,
    tp: int = 0,
    group: Any = None,
) -> tuple[RolloutEngine, AgentExecutorBase]:
    """(engine, agent executor over it): what generates for a policy rank (colocated) or an engine actor;
    `build_engine_for` and `build_executor`."""
    engine = build_engine_for(rollout, evaluation, model, tokenizer, source=source, tp=tp, group=group)
    executor = build_executor(rollout, engine, tokenizer, task_name=task_name, step_timeout=step_timeout)
    return engine, executor


def build_executor(
    rollout: RolloutConfig,
    engine: RolloutEngine,
    tokenizer: Any,
    *,
    task_name: str = "",
    step_timeout: float = 60.0,
) -> AgentExecutorBase:
    """single -> SingleTurnExecutor; multi -> the multi-turn task's executor (`rollout.agent_file` naming a
    built-in task, default `task_name`) or a MultiTurnExecutor over a user file's AgentInstance; a path
    ending in .py -> the user's AgentExecutor / AgentInstance."""
    r = rollout
    if r.agent == "single":
        return SingleTurnExecutor(engine, tokenizer, max_total_len=r.max_len)
    source = (r.agent_file or task_name) if r.agent == "multi" else r.agent
    if source.endswith(".py"):
        return load_agent_from_file(
            source,
            engine,
            tokenizer,
            max_total_len=r.max_len,
            max_turns=r.max_turns,
            step_timeout=step_timeout,
        )
    task = get_task(source) if source else None
    executor = getattr(task, "executor", None)
    if executor is None:
        raise ValueError(
            f"rollout.agent=multi needs a multi-turn agent: rollout.agent_file={source!r} is neither a .py file "
            "defining AgentInstance / AgentExecutor nor a multi-turn task (e.g. guess)"
        )
    return executor(engine, tokenizer, max_total_len=r.max_len, step_timeout=step_timeout)
