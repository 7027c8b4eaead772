"""Config of the rollout (`rollout.*` of `relayrl rl`, and of the commands that generate): the engine, its
weights and its settings, sampling, the batch of prompts per step and the agent executor.

    RolloutConfig               fields below (every one is a --rollout.* flag)
    VLLM_ARGS_FROM_CONFIG       vllm.EngineArgs that rollout.vllm_args may not set, and what decides each

Parsing checks types, ranges and the combinations one section can judge alone (exact / fp8 / routing replay
need the native engine); what needs other sections (dist.engine_tp, algo) is checked by the RL validation
pass (relayrl.trainers.rl.validate). Re-exported by relayrl.config.rl, where RLConfig nests it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from relayrl.config.base import invalid


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """How trajectories are sampled."""

    engine: str = "native"
    """Rollout engine: native (built in, beside the policy on its device, on the policy's weights: see
    engine_copy), hf (transformers.generate) or vllm (optional package, in-process, weights streamed from the
    trainer after every step). Vision-language models: hf or vllm (docs/vlm.md)."""
    engine_device: str = ""
    """Device of the engine and its weight copy (e.g. cuda:1: generation on a second GPU while the policy trains
    on the first; with train.async_train they overlap). Empty: the policy's device."""
    engine_copy: Literal["auto", "yes", "no"] = "auto"
    """Native engine beside a policy that is not sharded (one rank, or dist.replicate): yes gives the engine its
    own copy of the weights in the inference dtype, with q/k/v and gate/up laid out as one GEMM each
    (relayrl/rollout/native_fused.py), copied in place from the policy after every update (a device copy, ~1 ms
    at 0.5B); no runs the engine on the policy's parameters in place (no extra memory, but parameters that
    train are never re-laid out, so each projection is its own GEMM). auto: yes on a GPU when the copy takes
    <= 5% of the card's memory (up to ~3B parameters on an H200, ~2B on an 80 GB card) and the engine is native
    without exact mode, fp8 or LoRA, and neither dist.engine_sleep yes nor dist.offload_optimizer_in_rollout
    asks to save memory around the update; else no. docs/rl.md "The engine's weights" has the measurement."""
    exact: bool = False
    """Exact on-policy mode (native engine only): the engine and the trainer's log-prob forward run one
    batch-invariant forward (relayrl/rollout/exact.py), so the engine's sampled-token log-probs equal the
    trainer's bit for bit (mismatch exactly 0, first-step ratio exactly 1). Costs speed: see docs/rl.md."""
    quantization: Literal["none", "fp8"] = "none"
    """Native engine weights: none (the policy's dtype, bf16 on a GPU) or fp8 (e4m3 projections, per-channel
    scales, re-quantised on the device after every update; embedding, LM head and norms stay bf16; training
    stays bf16: relayrl/rollout/fp8.py). fp8 needs a GPU with compute capability >= 8.9 (H100 / H200; emulated
    on a CPU) and turns the TIS correction on by default (algo.off_policy), since the engine then samples
    from a slightly different policy than the trainer's; the mismatch/* and train/logprob_diff metrics show
    by how much. Not with exact, LoRA or dist.engine_tp > 1."""
    fused_kernels: bool = True
    """Native engine: decode through fused Triton kernels (residual add + RMSNorm, SiLU x up, rotary + K/V
    cache write, attention over each sample's own length; relayrl/rollout/kernels.py), used on a CUDA device
    when triton imports; false: the plain torch ops (to compare, or if a kernel misbehaves)."""
    routing_replay: bool = False
    """Mixture-of-experts policies (Qwen3-MoE, Mixtral; native engine only): the engine records the experts
    every token was routed to in every MoE layer and the trainer's forwards (old log-probs and the update)
    reuse them instead of routing again, so a rounding difference can no longer send a token to another
    expert on one side only (relayrl/models/moe.py; when to use it and its cost: docs/rl.md)."""
    vllm_args: str = ""
    """vllm engine: more vllm.EngineArgs as a JSON object, over relayrl's own (e.g. '{"enforce_eager": true}',
    '{"max_num_batched_tokens": 8192}'); the arguments relayrl derives from other settings are refused."""
    vllm_gpu_util: float = 0.0
    """vllm engine: share of each GPU's memory vLLM takes (weights + KV cache; vLLM's gpu_memory_utilization),
    in (0, 1). 0: relayrl rl takes 0.35 for an engine colocated with the trainer (the rest stays for training;
    e.g. 0.6 when the trainer is small, or with --dist.engine_sleep yes) and 0.85 for a separate engine
    (dist.num_engines: its GPUs hold no trainer); relayrl generate leaves vLLM's own default (0.9)."""
    vllm_any_version: bool = False
    """vllm engine: start with an installed vLLM outside the release line relayrl supports (at your own risk:
    the adapter relies on vLLM internals that change between releases); false refuses, naming both versions."""
    engine_slots: int = 0
    """Native engine: sequences decoded together (rows of its preallocated KV cache). More slots batch more
    samples per decode step (faster on a GPU) for KV memory of layers x slots x kv_heads x max_len x head_dim
    x 2 values. 0: one slot per sample of this engine's share of a step (prompts_per_step x n_samples split
    over the engines, 1/8 slack: relayrl.workers.builders.engine_slots); requests beyond the slots queue."""
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
        if self.routing_replay and self.engine != "native":
            raise invalid(
                "routing_replay",
                self.routing_replay,
                f"false with engine {self.engine!r} (it needs 'native')",
            )
        if self.exact and self.engine != "native":
            raise invalid(
                "exact", self.exact, f"false with engine {self.engine!r} (exact mode needs 'native')"
            )
        if self.quantization == "fp8" and (self.engine != "native" or self.exact):
            why = (
                "exact mode compares with the trainer's own weights"
                if self.exact
                else f"engine {self.engine!r}"
            )
            raise invalid("quantization", self.quantization, f"none with {why} (fp8 needs native, exact off)")
        if not 0.0 <= self.vllm_gpu_util < 1.0:
            raise invalid(
                "vllm_gpu_util", self.vllm_gpu_util, "a fraction of the GPU's memory in (0, 1), or 0"
            )
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
