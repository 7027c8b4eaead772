"""Ray placement of the roles (OpenRLHF's model): which placement group each role sits in and what each
bundle asks for.

Each role with a model is a group of `num_nodes x num_gpus_per_node` rank actors, one per placement-group
bundle ({GPU: 1, CPU: c}, PACK strategy, so a group fills a node before the next; a separate vllm engine's
bundle has dist.engine_tp GPUs, for its tensor-parallel workers; a TP native engine is engine_tp actors of one
GPU, placed with engine_tp 1, trainers/rl/roles.py). Colocated roles share a placement group: their
rank i actors sit on the same bundle, each asking for a fraction of its GPU (1 / roles sharing it); a bundle
asks for the CPUs of the actors it hosts. The rule-based / remote reward role is one actor without a GPU.

    where = plan_pools(dist_cfg, {"policy": 2, "reference": 2, "reward": 1})  # role -> pool (placement group)
    bundle_gpus = rank_gpus(dist_cfg, "engine")                               # GPUs of one rank
    cpus = cpu_share(actors)                                                  # CPUs per actor
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from relayrl.config.dist import DistConfig


@dataclass(slots=True)
class Pool:
    """A placement group shared by the roles colocated on it."""

    bundles: int
    roles: list[str] = field(default_factory=list)
    pg: Any = None


MODEL_FREE = ("reward",)
"""Roles without a model (rule-based / remote rewards): one CPU actor, no GPU. Every other role (policy,
reference, critic, an SFT / RM model, ...) holds a model: one GPU per rank (`rank_gpus`: dist.engine_tp for a
separate engine)."""


def rank_gpus(cfg: DistConfig, role: str) -> int:
    """GPUs of one rank of `role`: dist.engine_tp for a separate engine (its tensor-parallel workers), else 1."""
    return cfg.engine_tp if role == "engine" else 1


def plan_pools(cfg: DistConfig, roles: dict[str, int]) -> dict[str, str]:
    """role -> name of the placement group it sits in (see module doc); checks colocated sizes."""
    where: dict[str, str] = {}
    for role in roles:
        if role == "reward":
            where[role] = "reward"
            if cfg.colocate_critic_reward and "critic" in roles:
                where[role] = "critic"
            if cfg.colocate_all:
                where[role] = "policy"
        elif (role == "reference" and (cfg.colocate_policy_ref or cfg.colocate_all)) or (
            role == "critic" and cfg.colocate_all
        ):
            where[role] = "policy"
        else:
            where[role] = role
    for role, pool in where.items():
        if role not in MODEL_FREE and pool != role and roles[role] != roles[pool]:
            raise ValueError(
                f"dist: {role} is colocated with {pool} but has {roles[role]} ranks against {roles[pool]}: "
                f"colocated roles need the same nodes x gpus_per_node"
            )
    return where


def cpu_share(actors: int) -> float:
    """CPUs per actor such that the actors pack onto the nodes (a fraction when CPUs are scarce, whole CPUs
    otherwise, which each rank's thread count follows: ray.rank_threads)."""
    import ray

    cpus = [float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")]
    cpus = [c for c in cpus if c > 0] or [1.0]
    share = min(cpus) / math.ceil(actors / len(cpus))
    return share if share < 1 else float(int(share))
