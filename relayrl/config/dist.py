"""The `dist` section of every command: execution mode, the Ray cluster, role sizes, colocation, separate
engines, FSDP2 sharding options and timeouts (docs/distributed.md).

    DistConfig
      mode, ray_address, num_cpus, gpus, timeout_s,         every command
      stall_timeout_s
      offload, reshard_after_forward, keep_gathered,         every model role of several ranks (FSDP2)
      sharded_load, replicate                                (replicate: whole models, no FSDP2)
      sp_size                                                sequence parallelism of every model role
      num_nodes, num_gpus_per_node                           the one-model commands' model (sft, rm, dpo, ...)
      policy_* / ref_* / critic_*, num_engines, engine_tp,   `relayrl rl` only (OpenRLHF's terms)
      colocate_*, engine_sleep, offload_optimizer_in_rollout

    ranks(role) -> int      ranks of a role in ray mode ("model" for a one-model command; policy / ref / critic
                            for rl); 1 in local mode
    check_command(kind)     a ConfigError for a field set that the command `kind` ("model" or "rl") never reads:
                            the one-model commands size their model with num_nodes x num_gpus_per_node, rl sizes
                            each role with its own pair (the commands' `__post_init__` call it, so a wrong flag
                            fails while parsing, as an unknown flag would)

The workers, the launcher and the shard helpers take this one type: there is no per-command copy and no
converter between them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from relayrl.config.base import ConfigError, check_choices, invalid

ROLE_SIZE_FIELDS = tuple(
    f"{role}_{what}" for role in ("policy", "ref", "critic") for what in ("num_nodes", "num_gpus_per_node")
)
"""The fields that size the model roles of `relayrl rl` (nodes x ranks per node)."""

MODEL_SIZE_FIELDS = ("num_nodes", "num_gpus_per_node")
"""The fields that size the trained model of a one-model command (sft, rm, prm, dpo, kto, kd)."""

RL_ONLY_FIELDS = (
    *ROLE_SIZE_FIELDS,
    "num_engines",
    "engine_tp",
    "colocate_policy_ref",
    "colocate_critic_reward",
    "colocate_all",
    "engine_sleep",
    "offload_optimizer_in_rollout",
)
"""The fields only `relayrl rl` reads (its roles, their colocation and the rollout engines)."""


@dataclass(kw_only=True, slots=True)
class DistConfig:
    """Execution and placement: every role in this process (local), or Ray actors with data-parallel,
    FSDP2-sharded roles (ray). Role sizes and colocation use OpenRLHF's terms (docs/distributed.md)."""

    mode: Literal["local", "ray"] = "local"
    """local (every role in this process, one rank each) or ray (each role a group of Ray actors)."""
    ray_address: str = ""
    """Ray cluster address (e.g. HEAD_IP:6379 after `ray start --head`); empty starts a local cluster."""
    num_cpus: int = 2
    """CPUs of the local Ray cluster started when no address is given."""
    gpus: Literal["auto", "yes", "no"] = "auto"
    """auto (use GPUs when the Ray cluster has them), yes, no. Without GPUs every rank is a CPU process
    (gloo) and the *num_gpus_per_node values count processes."""
    num_nodes: int = 1
    """One-model commands (sft, rm, prm, dpo, kto, kd): nodes of the trained model (relayrl rl: policy_num_nodes)."""
    num_gpus_per_node: int = 1
    """One-model commands: ranks of the trained model per node, one GPU each (FSDP2-sharded over nodes x
    this; relayrl rl: policy_num_gpus_per_node)."""
    policy_num_nodes: int = 1
    """relayrl rl: nodes of the policy (actor) role."""
    policy_num_gpus_per_node: int = 1
    """relayrl rl: ranks of the policy role per node (one GPU each): the policy is sharded over nodes x this."""
    ref_num_nodes: int = 1
    """relayrl rl: nodes of the reference role."""
    ref_num_gpus_per_node: int = 1
    """relayrl rl: ranks of the reference role per node."""
    critic_num_nodes: int = 1
    """relayrl rl: nodes of the critic role."""
    critic_num_gpus_per_node: int = 1
    """relayrl rl: ranks of the critic role per node."""
    num_engines: int = 0
    """relayrl rl: rollout engines as actors of their own, engine_tp GPUs each (OpenRLHF's
    --vllm_num_engines; ray mode): each holds a full copy of the policy (vllm: sharded over its tp workers) and
    generates a share of the prompts; the policy's rank 0 broadcasts new weights to them over NCCL (gloo on
    CPUs) after every step. 0: each policy rank runs its own engine on its GPU (colocated). Engine native, hf
    or vllm."""
    engine_tp: int = 1
    """relayrl rl: GPUs of each rollout engine (tensor parallelism inside the engine, OpenRLHF's
    --vllm_tensor_parallel_size). Separate engines (dist.num_engines > 0): rollout.engine vllm shards the model
    over the engine actor's GPUs. Colocated (dist.num_engines 0, rollout.engine native): each block of
    engine_tp consecutive policy ranks runs one tensor-parallel native engine, each rank holding 1/engine_tp of
    its weights, refreshed from the FSDP shards after every step (docs/rollout.md)."""
    colocate_policy_ref: bool = False
    """relayrl rl: reference ranks share the policy's GPUs (same sizes required), as OpenRLHF's
    --colocate_actor_ref."""
    colocate_critic_reward: bool = False
    """relayrl rl: the reward role shares the critic's first GPU, as OpenRLHF's --colocate_critic_reward
    (rule-based and remote rewards need no GPU: then it only places the reward actor beside the critic)."""
    colocate_all: bool = False
    """relayrl rl: every role on the policy's GPUs (reference and critic need the policy's sizes), as
    OpenRLHF's --colocate_all_models (add --dist.engine_sleep yes to free the KV cache during updates)."""
    offload: bool = False
    """FSDP2 CPU offload of the trained models' parameters, gradients and optimizer states (the optimizer
    step runs on the CPU): for models that do not fit the GPUs' memory otherwise."""
    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward (ZeRO-3); False keeps them until the backward
    (ZeRO-2-like: faster, more memory)."""
    keep_gathered: Literal["auto", "yes", "no"] = "auto"
    """Training steps of a trained role of several ranks (FSDP2): gather each layer's weights once per optimizer
    step, at the first micro-batch's forward, and keep them until the last micro-batch's backward (one
    all-gather per layer a step instead of two per micro-batch, and FSDP2's host work for each of them). Costs
    the whole model's weights in the compute dtype on every rank for the length of the step (bf16: 2 bytes a
    parameter, beside the 4 of the unsharded fp32 gradients that are reduced once per step). auto: yes when
    those weights take at most 1/16 of a GPU's memory (a 1.5B model on an 80 GB card) and dist.offload is off;
    no: gather and reshard per micro-batch as dist.reshard_after_forward says."""
    sharded_load: bool = True
    """Ray mode, a model role of several ranks: each rank builds the model empty and reads only its own FSDP2
    shards' rows from the checkpoint's safetensors files (no rank ever holds the whole model); false: every
    rank loads the whole model in host memory first, then shards it (the old path; also taken, with a log
    line, for LoRA, vision-language and .bin checkpoints)."""
    replicate: bool = False
    """Ray mode, a model role of several ranks: every rank holds the whole model (a plain module, data
    parallelism without sharding) instead of FSDP2 shards. A train step sums the gradients over the ranks with
    one bucketed all-reduce after its last micro-batch (no per-layer all-gathers, reduce-scatters or FSDP2
    hooks), and the policy's colocated engine generates from the rank's own weights, as on one GPU (no gather
    into a replica after each step). Costs the whole training state on every GPU (fp32 weights, gradients and
    AdamW states: 16 bytes a parameter, plus the bf16 compute copy): for models that fit one GPU with room for
    activations (about 1.5B parameters on an 80 GB card). Checkpoints are written in the one-rank format (HF
    folder + optimizer) by rank 0, with each rank's RNG in rng/rank_<r>.pt, and resume on any rank count,
    sharded or not. Not with dist.offload, sp_size > 1, engine_tp > 1 or num_engines > 0."""
    engine_sleep: Literal["auto", "yes", "no"] = "auto"
    """relayrl rl: the rollout engine frees its KV cache (and CUDA graphs) while the policy trains and
    re-allocates them before the next rollout, so training can use that memory: yes, no, auto (= no: waking
    re-allocates and re-captures, ~0.5 s per step measured on an H100 for a 0.5B model; turn it on when
    memory is short)."""
    offload_optimizer_in_rollout: bool = False
    """relayrl rl: move the policy's optimizer states to CPU memory during rollout (back before the update)."""
    sp_size: int = 1
    """Sequence parallelism (ray mode): each model role's ranks form groups of sp_size consecutive ranks that
    split every packed micro-batch's tokens (Ulysses: attention all-to-alls the heads), for samples too long
    for one GPU; data parallelism runs over the ranks / sp_size groups. Must divide every role's ranks and the
    model's attention heads; 1: off (docs/distributed.md "Long context")."""
    timeout_s: float = 600.0
    """Bound on every collective and on waiting for a role: a dead or stuck rank stops the run with an error
    naming the role, rank and host within this time."""
    stall_timeout_s: float = 1800.0
    """The stall watchdog: a role call (generation, log-probs, update, weight refresh) still running after
    this many seconds writes every thread's Python stack to <run folder>/stacks/<role>_rank<r>.txt and stops
    the run naming the stuck role and rank (generous by default for big models; 0 = off)."""

    def __post_init__(self) -> None:
        for name in (*MODEL_SIZE_FIELDS, *ROLE_SIZE_FIELDS, "num_cpus", "sp_size"):
            if getattr(self, name) < 1:
                raise invalid(name, getattr(self, name), "an int >= 1")
        if self.timeout_s <= 0:
            raise invalid("timeout_s", self.timeout_s, "a number of seconds > 0")
        if not (0 <= self.stall_timeout_s < float("inf")):
            raise invalid("stall_timeout_s", self.stall_timeout_s, "a number of seconds >= 0 (0 = off)")
        if self.num_engines < 0:
            raise invalid("num_engines", self.num_engines, "an int >= 0 (0: the engine is colocated)")
        if self.engine_tp < 1:
            raise invalid("engine_tp", self.engine_tp, "an int >= 1 (GPUs per separate engine)")
        if self.replicate:
            for name, bad, why in (
                ("offload", self.offload, "offload moves FSDP2 shards to the CPU"),
                ("sp_size", self.sp_size > 1, "sequence parallelism runs over FSDP2 shards"),
                ("engine_tp", self.engine_tp > 1, "a tensor-parallel engine is refreshed from FSDP2 shards"),
                (
                    "num_engines",
                    self.num_engines > 0,
                    "separate engines take the weights from a sharded policy",
                ),
            ):
                if bad:
                    raise ConfigError(
                        f"dist.replicate: not with dist.{name} {getattr(self, name)} ({why}); set "
                        f"--dist.replicate false, or leave dist.{name} at its default",
                        field="dist.replicate",
                    )
        if self.sp_size > 1 and self.mode != "ray":
            raise invalid(
                "sp_size", self.sp_size, "1 in local mode (sequence parallelism needs --dist.mode ray)"
            )
        check_choices(self)

    def ranks(self, role: str) -> int:
        """Ranks of `role` in ray mode: "model" (a one-model command's trained model), or rl's policy / ref /
        critic; 1 in local mode."""
        if self.mode != "ray":
            return 1
        prefix = "" if role == "model" else f"{role}_"
        return getattr(self, f"{prefix}num_nodes") * getattr(self, f"{prefix}num_gpus_per_node")

    def check_command(self, kind: Literal["model", "rl"]) -> None:
        """A ConfigError naming the first field set away from its default that command `kind` never reads:
        "model" (the one-model commands) reads no rl field, "rl" sizes each role and reads no num_nodes /
        num_gpus_per_node."""
        role = "model" if kind == "model" else "policy"
        if self.ranks(role) % self.sp_size:
            prefix = "" if kind == "model" else "policy_"
            raise ConfigError(
                f"dist.sp_size: {self.sp_size} does not divide the {role}'s {self.ranks(role)} ranks "
                f"(--dist.{prefix}num_nodes x --dist.{prefix}num_gpus_per_node): pick a divisor",
                field="dist.sp_size",
            )
        default = DistConfig()
        unread = RL_ONLY_FIELDS if kind == "model" else MODEL_SIZE_FIELDS
        for f in fields(self):
            if f.name in unread and getattr(self, f.name) != getattr(default, f.name):
                hint = (
                    "it applies to relayrl rl's roles; this command sizes its model with --dist.num_nodes / "
                    "--dist.num_gpus_per_node"
                    if kind == "model"
                    else "relayrl rl sizes each role: --dist.policy_num_nodes / --dist.policy_num_gpus_per_node "
                    "(ref_*, critic_* for the others)"
                )
                raise ConfigError(
                    f"dist.{f.name}: this command does not read it; {hint}", field=f"dist.{f.name}"
                )
