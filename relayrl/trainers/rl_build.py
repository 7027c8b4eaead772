"""Setup of `relayrl rl` (everything before the first step), kept out of the loop module:

    validate_rl_config(cfg)                      resolves `cfg.algo` (preset + defaults, in place), then checks
                                                 every registry name and cross-field rule, before any work
    build_prompts(cfg, run_dir, tokenizer)       -> Prompts(train, eval, stats)  (task rows or data files)
    build_roles(cfg, total_steps)                -> Roles(launcher, policy, reference?, critic?, reward)
    build_kl_controller(cfg)                     -> FixedKLController | AdaptiveKLController

A built-in task (`task.name`) writes its rows as JSONL into <run>/data/ and goes through the same data
loader as users' files (relayrl.data.build_prompt_data), so templating is identical to SFT's.
Roles: the reference is built only when a KL term is on (`algo.kl_mode` != none), the critic only for
estimators that need values (`gae`); the rollout engine lives inside the policy worker (colocated).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from relayrl.agents.base import PromptSample
from relayrl.config.base import ConfigError
from relayrl.config.rl import KL_MODES, RLConfig, resolve_algo
from relayrl.distributed.launch import LAUNCHERS, RoleHandle, build_launcher

NEEDS_CRITIC = frozenset({"gae"})
FAILURE_POLICIES = ("drop_group", "drop_sample", "zero_reward", "raise")
AGENTS = ("single", "multi")


def _choice(field: str, value: str, choices: Any) -> None:
    if value not in choices:
        raise ConfigError(
            f"{field}: {value!r} is not known; choose one of {', '.join(sorted(choices))}", field=field
        )


def validate_rl_config(cfg: RLConfig) -> None:
    """Resolve `cfg.algo` in place (`resolve_algo`: the preset's and built-in defaults fill the unset names, so
    the workers, the experience maker and the saved config.yaml all see the final values); then raise
    ConfigError naming the field, the bad value and the valid choices."""
    from relayrl.algorithms.advantages import ADVANTAGES, GROUP_ESTIMATORS
    from relayrl.algorithms.aggregation import AGGREGATIONS
    from relayrl.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS
    from relayrl.algorithms.policy_losses import POLICY_LOSSES
    from relayrl.rollout import ENGINES
    from relayrl.workers.builders import off_policy_registry

    cfg.algo = resolve_algo(cfg.algo)
    a, r = cfg.algo, cfg.rollout
    _choice("algo.advantage", a.advantage, ADVANTAGES)
    _choice("algo.policy_loss", a.policy_loss, POLICY_LOSSES)
    _choice("algo.aggregation", a.aggregation, AGGREGATIONS)
    _choice("algo.kl_mode", a.kl_mode, KL_MODES)
    _choice("algo.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    _choice("algo.kl_controller", a.kl_controller, KL_CONTROLLERS)
    _choice("algo.off_policy", a.off_policy, off_policy_registry())
    _choice("rollout.engine", r.engine, ENGINES)
    _choice("rollout.failure_policy", r.failure_policy, FAILURE_POLICIES)
    _choice("dist.mode", cfg.dist.mode, LAUNCHERS)
    if r.agent not in AGENTS and not r.agent.endswith(".py"):
        raise ConfigError(
            f"rollout.agent: {r.agent!r}; choose single, multi, or a path to a .py file",
            field="rollout.agent",
        )
    if not cfg.model.name_or_path:
        raise ConfigError(
            "model.name_or_path is required: a local model folder or Hub id", field="model.name_or_path"
        )
    if a.advantage in GROUP_ESTIMATORS or cfg.filter.enabled:
        if r.n_samples < 2:
            raise ConfigError(
                f"rollout.n_samples: {r.n_samples} is invalid; {a.advantage!r} / dynamic filtering compare the "
                "samples of a prompt, so use >= 2 (or a critic-free single-sample estimator: reinforce)",
                field="rollout.n_samples",
            )
        if r.failure_policy == "drop_sample":
            raise ConfigError(
                "rollout.failure_policy: 'drop_sample' leaves groups of unequal size, which group estimators "
                "cannot use; choose drop_group or zero_reward",
                field="rollout.failure_policy",
            )
    for name in ("prompts_per_step", "n_samples", "max_new_tokens", "max_len"):
        if getattr(r, name) < 1:
            raise ConfigError(
                f"rollout.{name}: {getattr(r, name)} is invalid; expected an int >= 1",
                field=f"rollout.{name}",
            )
    if r.engine_slots < 0:
        raise ConfigError(
            f"rollout.engine_slots: {r.engine_slots} is invalid; expected 0 (auto) or an int >= 1",
            field="rollout.engine_slots",
        )
    for name in ("epochs", "mini_batches", "micro_batch_tokens"):
        if getattr(a, name) < 1:
            raise ConfigError(
                f"algo.{name}: {getattr(a, name)} is invalid; expected an int >= 1", field=f"algo.{name}"
            )
    if cfg.train.max_steps < 1:
        raise ConfigError(
            "train.max_steps: RL needs the number of steps; set --train.max_steps N (>= 1)",
            field="train.max_steps",
        )
    if cfg.eval.n_samples > 1 and cfg.eval.temperature == 0:
        raise ConfigError(
            "eval.n_samples > 1 needs eval.temperature > 0 (greedy samples are identical)",
            field="eval.temperature",
        )
    if not 0.0 <= cfg.ema < 1.0:
        raise ConfigError(f"ema: {cfg.ema} is invalid; expected a decay in [0, 1) (0 = off)", field="ema")


# ------------------------------------------------------------------------------------------------ prompts
@dataclass(kw_only=True, slots=True)
class Prompts:
    """The prompt sets of a run."""

    train: list[PromptSample]
    """Training prompts (index = position in this list)."""
    eval: list[PromptSample]
    """Held-out eval prompts (may be empty)."""
    stats: list[Any]
    """Per-source load statistics (printed)."""


def write_task_rows(cfg: RLConfig, run_dir: Path) -> tuple[str, str]:
    """Write the task's train / eval rows as JSONL under <run>/data/; returns the two paths."""
    from relayrl.tasks import get_task

    task = get_task(cfg.task.name)
    folder = run_dir / "data"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", cfg.task.train_rows), ("test", cfg.task.eval_rows)):
        rows = task.make_rows(split, n, cfg.data.seed) if n > 0 else []
        path = folder / f"{cfg.task.name}_{split}.jsonl"
        path.write_text("".join(json.dumps({**row, "datasource": cfg.task.name}) + "\n" for row in rows))
        paths.append(str(path))
    return paths[0], paths[1]


def build_prompts(cfg: RLConfig, run_dir: Path, tokenizer: Any) -> Prompts:
    """Prompts from the task (written to JSONL) or from `data`; an empty training set is a clear error."""
    from relayrl.data.build import build_prompt_data

    data = cfg.data
    if cfg.task.name:
        train_path, eval_path = write_task_rows(cfg, run_dir)
        data = replace(
            data,
            datasets=[train_path],
            dataset_probs=[],
            eval_dataset=eval_path if cfg.task.eval_rows > 0 else None,
            datasource_key="datasource",
        )
    if not data.datasets:
        raise ConfigError(
            "no prompts: set --data.datasets FILE... or --task.name (e.g. add2)", field="data.datasets"
        )
    train, evals, stats = build_prompt_data(data, tokenizer)
    if not train:
        raise ValueError(
            f"the training prompt set is empty after loading {data.datasets} (see the data summary above: rows "
            "dropped as too long or malformed are counted there); add data or raise data.max_len"
        )
    if cfg.eval.max_prompts:
        evals = evals[: cfg.eval.max_prompts]
    return Prompts(train=list(train), eval=list(evals), stats=list(stats))


# ------------------------------------------------------------------------------------------------ roles
@dataclass(kw_only=True)
class Roles:
    """The role workers of a run (handles: in-process or Ray actors)."""

    launcher: Any
    policy: RoleHandle
    reward: RoleHandle
    reference: RoleHandle | None = None
    critic: RoleHandle | None = None

    def close(self) -> None:
        try:
            self.policy.call("close")
        finally:
            self.launcher.shutdown()


def build_roles(cfg: RLConfig, total_steps: int) -> Roles:
    """Start the workers (policy + colocated engine, reward, and reference / critic when needed)."""
    from relayrl.workers.critic import CriticWorker
    from relayrl.workers.policy import PolicyWorker
    from relayrl.workers.reference import ReferenceWorker
    from relayrl.workers.reward import RewardWorker

    cfg = replace(cfg, algo=resolve_algo(cfg.algo))  # a no-op after validate_rl_config
    want_ref = cfg.algo.kl_mode != "none"
    want_critic = cfg.algo.advantage in NEEDS_CRITIC
    launcher = build_launcher(cfg.dist, num_roles=2 + int(want_ref) + int(want_critic))
    try:
        policy = launcher.spawn("policy", PolicyWorker, cfg, total_steps)
        reward = launcher.spawn("reward", RewardWorker, cfg)
        reference = launcher.spawn("reference", ReferenceWorker, cfg) if want_ref else None
        critic = launcher.spawn("critic", CriticWorker, cfg, total_steps) if want_critic else None
        policy.call("info")  # surfaces a worker's construction error here, in both modes
    except BaseException:
        launcher.shutdown()
        raise
    return Roles(launcher=launcher, policy=policy, reward=reward, reference=reference, critic=critic)


def build_kl_controller(cfg: RLConfig) -> Any:
    """The KL coefficient holder (fixed or adaptive)."""
    from relayrl.algorithms.kl import KL_CONTROLLERS

    a = cfg.algo
    return KL_CONTROLLERS[a.kl_controller](a.kl_coef, target=a.kl_target, horizon=a.kl_horizon)
