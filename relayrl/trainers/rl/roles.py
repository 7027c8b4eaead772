"""The roles of `relayrl rl` and the controller-side state builders.

    roles = build_roles(cfg, total_steps, concurrency=rollouts.concurrency)
        roles.policy     RoleHandle[PolicyWorker]     trains; generates too unless engines are separate
        roles.reward     RoleHandle[RewardWorker]     scores trajectories (in this process for task: / reward_func
                                                      file / agent sources in every mode; an actor for rm, prm
                                                      and remote ones on Ray: relayrl.workers.reward)
        roles.reference  RoleHandle[ReferenceWorker]  when the KL mode needs reference log-probs, else None
        roles.teacher    RoleHandle[ReferenceWorker]  on-policy distillation's teacher (distill.teacher), else None
        roles.critic     RoleHandle[CriticWorker]     when the advantage estimator needs values, else None
        roles.engines    RoleHandle[EngineWorker]     dist.num_engines > 0 (ray), else None
        roles.generator  the engines, else the policy (RoleHandle[Generates])
    roles.rows(batch_or_experience)    what the workers read: the record itself (local), or its rows in Ray's object
                                       store, each put once per step; each rank fetches only its share
    roles.transfer_metrics()           Ray: the driver's seconds and objects put in the row store since the last call
    roles.sync_weights(version); roles.close()
    kl_ctl = build_kl_controller(cfg.algo); norm = build_reward_norm(cfg.reward)

Each role gets the component configs it reads (relayrl/workers/*Spec); the launcher
(relayrl.distributed.launch) runs them in this process or as Ray actor groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from relayrl.agents.rewards.spec import parse_reward_spec
from relayrl.algorithms.kl import KL_CONTROLLERS, KLController
from relayrl.algorithms.registry import needs_critic, needs_reference
from relayrl.algorithms.shaping import FixedRewardNorm, RunningRewardNorm
from relayrl.config.components import ModelConfig
from relayrl.config.rl import AlgoConfig, ResolvedRL, RewardConfig, RLConfig
from relayrl.distributed.launch import build_launcher
from relayrl.distributed.launch.base import Launcher, RoleHandle
from relayrl.distributed.launch.local import LocalRole
from relayrl.distributed.launch.rows import RowStore
from relayrl.distributed.weights.broadcast import connect_engines, sync_weights
from relayrl.models.value_head import reward_stats
from relayrl.rollout.build import engine_capabilities
from relayrl.training.setup import freeze_heap, thaw_heap
from relayrl.workers.base import Rows
from relayrl.workers.critic import CriticSpec, CriticWorker
from relayrl.workers.engine import EngineSpec, EngineWorker
from relayrl.workers.policy import PolicySpec, PolicyWorker
from relayrl.workers.proxies import Generates
from relayrl.workers.reference import ReferenceSpec, ReferenceWorker
from relayrl.workers.reward import RewardSpec, RewardWorker, reward_spec, runs_in_process

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------ roles
@dataclass(kw_only=True)
class Roles:
    """The role workers of a run (handles: in-process or Ray actors)."""

    launcher: Launcher
    policy: RoleHandle[PolicyWorker]
    reward: RoleHandle[RewardWorker]
    reference: RoleHandle[ReferenceWorker] | None = None
    teacher: RoleHandle[ReferenceWorker] | None = None
    """distill.teacher's frozen model (a reference worker over the teacher, sharded like the reference)."""
    critic: RoleHandle[CriticWorker] | None = None
    engines: RoleHandle[EngineWorker] | None = None
    """Separate engine actors (dist.num_engines > 0), else None: the policy's ranks generate."""
    store: RowStore = field(default_factory=RowStore)
    """Ray mode: the step's records, put in blocks of rows (relayrl.distributed.launch.rows)."""

    def rows(self, record: T) -> Rows[T]:
        """What a worker reads of a SequenceBatch / Experience: the record itself in local mode; on Ray, its
        rows in the object store (each serialised once per step, however many roles and ranks read it;
        each rank fetches only the rows it reads)."""
        if self.launcher.mode != "ray":
            return record  # type: ignore[return-value]  (SequenceBatch and Experience are Rows of themselves)
        return self.store.put(record)

    def transfer_metrics(self) -> dict[str, float]:
        """Ray mode: the row store's puts since the last call (RowStore.take_metrics: timing/rows_put,
        perf/rows_put_objects); local mode: none."""
        return self.store.take_metrics() if self.launcher.mode == "ray" else {}

    def sync_weights(self, version: int) -> dict[str, float]:
        """The policy's new weights to whoever generates, as `version`; the policy's sync metrics."""
        return sync_weights(self.policy, self.engines, version)

    @property
    def generator(self) -> RoleHandle[Generates]:
        """The role that generates: the engines when separate, else the policy (its colocated engines)."""
        return self.engines if self.engines is not None else self.policy

    def close(self) -> None:
        try:
            if self.engines is not None:
                self.engines.call(EngineWorker.close)
            self.policy.call(PolicyWorker.close)
        finally:
            self.launcher.shutdown()
            thaw_heap()  # build_roles froze the heap: the run's workers become collectable again


def _sizes(cfg: RLConfig, algo: AlgoConfig, engines: int, reward_actor: bool) -> dict[str, int]:
    """role -> ranks: policy always; reward when it is an actor; reference / critic when the algorithm needs
    them."""
    d = cfg.dist
    sizes = {"policy": d.ranks("policy")} | ({"reward": 1} if reward_actor else {})
    if needs_reference(algo.kl_mode):
        sizes["reference"] = d.ranks("ref")
    if needs_critic(algo.advantage):
        sizes["critic"] = d.ranks("critic")
    if cfg.distill.teacher:
        sizes["teacher"] = d.ranks("ref")
    if engines:
        sizes["engine"] = engines
    return sizes


def native_tp_actors(cfg: ResolvedRL) -> bool:
    """Separate engines that are tensor-parallel native engines: each engine is dist.engine_tp actors of one
    GPU (its shards, relayrl/rollout/native_tp.py), not one actor with engine_tp GPUs (vllm's workers)."""
    return cfg.dist.engine_tp > 1 and not engine_capabilities(cfg.rollout.engine).own_weights


QUERY_READERS = ("file", "remote")
"""Reward source kinds that read the decode of all token ids (agents.rewards.base.queries_of)."""


def decode_queries(cfg: RLConfig) -> bool:
    """Whether the generating ranks decode each trajectory's ids (`Trajectory.query_text`): on Ray, for a
    reward source that reads them, so the driver does not decode every rank's samples in turn (2,048 x ~130
    tokens: 0.021 s of the driver's 0.037 s reward on a CPU core; each rank decodes its 512 in ~0.005 s).
    The ranks' tokenizer is the reward source's (both load the policy's, workers.reward.reward_spec)."""
    return cfg.dist.mode == "ray" and parse_reward_spec(reward_spec(cfg).source).kind in QUERY_READERS


def _policy_spec(cfg: ResolvedRL, total_steps: int, overlaps: bool, separate: bool, run: dict) -> PolicySpec:
    """What the policy ranks read: the model, optimizer, algorithm, rollout, eval, EMA and dist settings."""
    return PolicySpec(
        model=cfg.model,
        optim=cfg.optim,
        algo=cfg.algo,
        rollout=cfg.rollout,
        eval=cfg.eval,
        total_steps=total_steps,
        ema=cfg.ema,
        task_name=cfg.task.name,
        step_timeout=cfg.reward.timeout_s,
        decode_queries=decode_queries(cfg),
        dist=cfg.dist,
        async_train=overlaps,
        separate_engines=separate,
        **run,
    )


def _frozen_spec(cfg: ResolvedRL, model: ModelConfig, run: dict) -> ReferenceSpec:
    """A frozen model's ranks (the reference, or the distillation teacher's `model`): log-probs under the
    sampling temperature, in the algorithm's micro-batch budgets."""
    return ReferenceSpec(
        model=model,
        micro_batch_tokens=cfg.algo.micro_batch_tokens,
        infer_micro_batch_tokens=cfg.algo.infer_micro_batch_tokens,
        temperature=cfg.rollout.temperature,
        dist=cfg.dist,
        **run,
    )


def _critic_spec(cfg: ResolvedRL, total_steps: int, run: dict) -> CriticSpec:
    """The critic's ranks: its optimizer (critic.* over optim.*), epochs, mini-batches, budgets, value clip."""
    algo = cfg.algo
    return CriticSpec(
        model=cfg.model,
        optim=cfg.critic.optimizer(cfg.optim),
        model_path=cfg.critic.model_path,
        epochs=cfg.critic.epochs,
        mini_batches=algo.mini_batches,
        micro_batch_tokens=algo.micro_batch_tokens,
        infer_micro_batch_tokens=algo.infer_micro_batch_tokens,
        value_clip=algo.value_clip,
        total_steps=total_steps,
        dist=cfg.dist,
        **run,
    )


def build_roles(
    cfg: ResolvedRL,
    total_steps: int,
    *,
    concurrency: dict[str, int] | None = None,
    overlaps: bool = False,
    run_dir: Path | None = None,
) -> Roles:
    """Start the workers (policy + colocated engine, reward, and reference / teacher / critic when needed),
    each with the component configs it reads (the `_*_spec` helpers above). `concurrency` / `overlaps`: the
    rollout strategy's (relayrl.trainers.rl.async_rollout): calls one rank runs at once, and whether rollout
    overlaps updates. `run_dir`: where the stall watchdog writes stacks (<run_dir>/stacks)."""
    run = {"seed": cfg.train.seed, "device": cfg.train.device}
    d_engines = cfg.dist.num_engines if cfg.dist.mode == "ray" else 0
    rs = reward_spec(cfg)
    sizes = _sizes(cfg, cfg.algo, d_engines, reward_actor=not runs_in_process(rs))
    placed = cfg.dist
    if d_engines and native_tp_actors(cfg):  # one shard actor (one GPU) per TP rank of each engine
        sizes["engine"] = d_engines * cfg.dist.engine_tp
        placed = replace(cfg.dist, engine_tp=1)
    launcher = build_launcher(placed, sizes, run_dir)
    launcher.concurrency.update(concurrency or {})
    try:
        policy = launcher.spawn(
            "policy", PolicyWorker, _policy_spec(cfg, total_steps, overlaps, d_engines > 0, run)
        )
        reward = spawn_reward(launcher, rs)
        reference = teacher = critic = None
        if "reference" in sizes:
            reference = launcher.spawn("reference", ReferenceWorker, _frozen_spec(cfg, cfg.model, run))
        if "teacher" in sizes:
            teacher_model = replace(cfg.model, name_or_path=cfg.distill.teacher, tokenizer_name_or_path=None)
            teacher = launcher.spawn("teacher", ReferenceWorker, _frozen_spec(cfg, teacher_model, run))
        if "critic" in sizes:
            critic = launcher.spawn("critic", CriticWorker, _critic_spec(cfg, total_steps, run))
        engines = spawn_engines(cfg, launcher, policy, d_engines, run) if d_engines else None
        policy.call(PolicyWorker.info)  # surfaces a worker's construction error here, in both modes
    except BaseException:
        launcher.shutdown()
        raise
    freeze_heap()  # what this process built so far (local mode: every role too) lives the whole run
    return Roles(
        launcher=launcher,
        policy=policy,
        reward=reward,
        reference=reference,
        teacher=teacher,
        critic=critic,
        engines=engines,
    )


def spawn_reward(launcher: Launcher, rs: RewardSpec) -> RoleHandle[RewardWorker]:
    """The reward role: a worker in this process for in-process sources (task:, reward_func files, agent:
    no actor round trip pickling every trajectory, relayrl.workers.reward), else the launcher's (a Ray actor
    for rm / prm / remote sources)."""
    if launcher.mode == "ray" and runs_in_process(rs):
        return LocalRole("reward", RewardWorker(rs))
    return launcher.spawn("reward", RewardWorker, rs)


def spawn_engines(
    cfg: RLConfig, launcher: Launcher, policy: RoleHandle[PolicyWorker], n: int, run: dict[str, Any]
) -> RoleHandle[EngineWorker]:
    """The separate engine role (n EngineWorker actors), connected to the policy and given its weights."""
    spec = EngineSpec(
        model=cfg.model,
        rollout=cfg.rollout,
        eval=cfg.eval,
        task_name=cfg.task.name,
        step_timeout=cfg.reward.timeout_s,
        decode_queries=decode_queries(cfg),
        tp=cfg.dist.engine_tp,
        **run,
    )
    engines = launcher.spawn("engine", EngineWorker, spec)
    connect_engines(policy, engines, launcher, n, cfg.dist.timeout_s, cfg.dist.engine_tp)
    return engines


# ------------------------------------------------------------------------------------------------ state
def build_kl_controller(algo: AlgoConfig) -> KLController:
    """The KL coefficient holder (fixed or adaptive)."""
    return KL_CONTROLLERS[algo.kl_controller](algo.kl_coef, target=algo.kl_target, horizon=algo.kl_horizon)


def build_reward_norm(reward: RewardConfig) -> FixedRewardNorm | RunningRewardNorm | None:
    """reward.normalize: a reward model's own statistics (rm:PATH whose config.json has reward_mean /
    reward_std, written by `relayrl rm`), else running statistics."""
    if not reward.normalize:
        return None
    source = reward.source
    stats = reward_stats(source[len("rm:") :]) if source.startswith("rm:") else None
    if stats is not None:
        print(
            f"relayrl rl: rewards normalised with the reward model's statistics (mean {stats[0]:.4f}, std {stats[1]:.4f})"
        )
        return FixedRewardNorm(*stats)
    return RunningRewardNorm()
