"""The roles of `relayrl rl`: launcher, policy (with its engine), reference, critic, reward, engine actors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relayrl.algorithms.registry import (
    needs_critic,
    needs_reference,
)
from relayrl.config.rl import ResolvedRL, RLConfig
from relayrl.distributed.launch import Launcher, RoleHandle, build_launcher
from relayrl.distributed.weights.broadcast import connect_engines, sync_weights
from relayrl.workers.engine import EngineSpec, EngineWorker


# ------------------------------------------------------------------------------------------------ roles
@dataclass(kw_only=True)
class Roles:
    """The role workers of a run (handles: in-process or Ray actors)."""

    launcher: Any
    policy: RoleHandle
    reward: RoleHandle
    reference: RoleHandle | None = None
    critic: RoleHandle | None = None
    engines: RoleHandle | None = None
    """Separate engine actors (dist.num_engines > 0), else None: the policy's ranks generate."""

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy's new weights to whoever generates, as `version`; the policy's sync metrics."""
        return sync_weights(self.launcher, self.policy, self.engines, version)

    @property
    def generator(self) -> RoleHandle:
        """The role that generates: the engines when separate, else the policy (its colocated engines)."""
        return self.engines if self.engines is not None else self.policy

    def close(self) -> None:
        try:
            if self.engines is not None:
                self.engines.call("close")
            self.policy.call("close")
        finally:
            self.launcher.shutdown()


def build_roles(cfg: ResolvedRL, total_steps: int) -> Roles:
    """Start the workers (policy + colocated engine, reward, and reference / critic when needed), each with
    the component configs it reads."""
    from relayrl.workers.critic import CriticSpec, CriticWorker
    from relayrl.workers.policy import PolicySpec, PolicyWorker
    from relayrl.workers.reference import ReferenceSpec, ReferenceWorker
    from relayrl.workers.reward import RewardWorker, reward_spec

    algo = cfg.algo
    want_ref = needs_reference(algo.kl_mode)
    want_critic = needs_critic(algo.advantage)
    run = {"seed": cfg.train.seed, "device": cfg.train.device}
    d_engines = cfg.dist.num_engines if cfg.dist.mode == "ray" else 0
    policy_spec = PolicySpec(
        model=cfg.model,
        optim=cfg.optim,
        algo=algo,
        rollout=cfg.rollout,
        eval=cfg.eval,
        total_steps=total_steps,
        ema=cfg.ema,
        task_name=cfg.task.name,
        step_timeout=cfg.reward.timeout_s,
        dist=cfg.dist,
        async_train=cfg.train.async_train,
        separate_engines=d_engines > 0,
        **run,
    )
    d = cfg.dist
    sizes = {"policy": d.ranks("policy"), "reward": 1}
    if want_ref:
        sizes["reference"] = d.ranks("ref")
    if want_critic:
        sizes["critic"] = d.ranks("critic")
    if d_engines:
        sizes["engine"] = d_engines
    launcher = build_launcher(d, sizes)
    if cfg.train.async_train:  # rollout, update and eval of the policy (score and eval of the reward) overlap
        launcher.concurrency.update(policy=3, reward=2, engine=3)
    try:
        policy = launcher.spawn("policy", PolicyWorker, policy_spec)
        reward = launcher.spawn("reward", RewardWorker, reward_spec(cfg))
        reference = None
        if want_ref:
            ref_spec = ReferenceSpec(
                model=cfg.model,
                micro_batch_tokens=algo.micro_batch_tokens,
                temperature=cfg.rollout.temperature,
                dist=cfg.dist,
                **run,
            )
            reference = launcher.spawn("reference", ReferenceWorker, ref_spec)
        critic = None
        if want_critic:
            critic_spec = CriticSpec(
                model=cfg.model,
                optim=cfg.critic.optimizer(cfg.optim),
                model_path=cfg.critic.model_path,
                epochs=cfg.critic.epochs,
                mini_batches=algo.mini_batches,
                micro_batch_tokens=algo.micro_batch_tokens,
                value_clip=algo.value_clip,
                total_steps=total_steps,
                dist=cfg.dist,
                **run,
            )
            critic = launcher.spawn("critic", CriticWorker, critic_spec)
        engines = spawn_engines(cfg, launcher, policy, d_engines, run) if d_engines else None
        policy.call("info")  # surfaces a worker's construction error here, in both modes
    except BaseException:
        launcher.shutdown()
        raise
    return Roles(
        launcher=launcher, policy=policy, reward=reward, reference=reference, critic=critic, engines=engines
    )


def spawn_engines(
    cfg: RLConfig, launcher: Launcher, policy: RoleHandle, n: int, run: dict[str, Any]
) -> RoleHandle:
    """The separate engine role (n EngineWorker actors), connected to the policy and given its weights."""
    spec = EngineSpec(
        model=cfg.model,
        rollout=cfg.rollout,
        eval=cfg.eval,
        task_name=cfg.task.name,
        step_timeout=cfg.reward.timeout_s,
        tp=cfg.dist.engine_tp,
        **run,
    )
    engines = launcher.spawn("engine", EngineWorker, spec)
    connect_engines(policy, engines, launcher, n, cfg.dist.timeout_s, cfg.dist.engine_tp)
    return engines


def build_kl_controller(cfg: RLConfig) -> Any:
    """The KL coefficient holder (fixed or adaptive)."""
    from relayrl.algorithms.kl import KL_CONTROLLERS

    a = cfg.algo
    return KL_CONTROLLERS[a.kl_controller](a.kl_coef, target=a.kl_target, horizon=a.kl_horizon)
