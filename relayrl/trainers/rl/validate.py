"""One validation pass of `relayrl rl`'s config."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

from relayrl.algorithms.registry import (
    ADVANTAGES,
    AGENTS,
    AGGREGATIONS,
    FAILURE_POLICIES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_MODES,
    OFF_POLICY,
    POLICY_LOSSES,
    applies_kl,
    keeps_groups,
    needs_critic,
    needs_groups,
    needs_reference,
)
from relayrl.config.base import ConfigError, ConfigWarning
from relayrl.config.rl import ROLE_SIZE_FIELDS, AlgoConfig, RLConfig, resolve_algo
from relayrl.distributed.launch import LAUNCHERS


def _choice(field: str, value: str, choices: Any) -> None:
    if value not in choices:
        raise ConfigError(f"{field}: {value!r} is not known; choose one of {', '.join(choices)}", field=field)


def validate_rl_config(cfg: RLConfig) -> None:
    """Resolve `cfg.algo` in place (`resolve_algo`: the preset's and built-in defaults fill the unset names, so
    the workers, the experience maker and the saved config.yaml all see the final values); then raise
    ConfigError naming the field, the bad value and the valid choices, and warn (ConfigWarning, one line
    each) about values that are accepted but have no effect. What a name requires (critic, groups, reference
    model, whole groups, weight bounds) is read from its registry entry (relayrl.algorithms.registry)."""
    raw = cfg.algo
    if not cfg.algo.off_policy:  # async samples are stale: correct with TIS unless the user chose otherwise
        cfg.algo = replace(cfg.algo, off_policy="tis" if cfg.train.async_train else "none")
    cfg.algo = resolve_algo(cfg.algo)
    _check_names(cfg)
    _check_values(cfg)
    _warn_ineffective(cfg, raw)


def _check_names(cfg: RLConfig) -> None:
    from relayrl.rollout import ENGINES

    a, r = cfg.algo, cfg.rollout
    _choice("algo.advantage", a.advantage, ADVANTAGES)
    _choice("algo.policy_loss", a.policy_loss, POLICY_LOSSES)
    _choice("algo.aggregation", a.aggregation, AGGREGATIONS)
    _choice("algo.kl_mode", a.kl_mode, KL_MODES)
    _choice("algo.kl_estimator", a.kl_estimator, KL_ESTIMATORS)
    _choice("algo.kl_controller", a.kl_controller, KL_CONTROLLERS)
    _choice("algo.off_policy", a.off_policy, OFF_POLICY)
    _choice("rollout.engine", r.engine, ENGINES)
    _choice("rollout.failure_policy", r.failure_policy, FAILURE_POLICIES)
    _choice("dist.mode", cfg.dist.mode, LAUNCHERS)
    if r.agent not in AGENTS and not r.agent.endswith(".py"):
        raise ConfigError(
            f"rollout.agent: {r.agent!r}; choose {', '.join(AGENTS)}, or a path to a .py file",
            field="rollout.agent",
        )
    if not cfg.model.name_or_path:
        raise ConfigError(
            "model.name_or_path is required: a local model folder or Hub id", field="model.name_or_path"
        )


def _check_engines(cfg: RLConfig) -> None:
    """Separate engines (dist.num_engines) and tensor parallelism inside them (dist.engine_tp)."""
    if cfg.dist.num_engines:
        why = (
            "needs dist.mode ray (in local mode put the engine on another GPU with rollout.engine_device)"
            if cfg.dist.mode != "ray"
            else "does not take LoRA yet (the engines hold plain weights); merge first or use 0"
            if cfg.model.lora.rank > 0
            else ""
        )
        if why:
            raise ConfigError(f"dist.num_engines={cfg.dist.num_engines} {why}", field="dist.num_engines")
    if cfg.dist.engine_tp > 1 and (cfg.dist.num_engines == 0 or cfg.rollout.engine != "vllm"):
        raise ConfigError(
            f"dist.engine_tp={cfg.dist.engine_tp}: tensor parallelism inside an engine needs separate engines "
            f"(dist.num_engines > 0, got {cfg.dist.num_engines}) and rollout.engine vllm (got "
            f"{cfg.rollout.engine!r}); the colocated and native engines run on one GPU",
            field="dist.engine_tp",
        )


def _check_values(cfg: RLConfig) -> None:
    a, r = cfg.algo, cfg.rollout
    if needs_groups(a.advantage) or cfg.filter.enabled:
        if r.n_samples < 2:
            raise ConfigError(
                f"rollout.n_samples: {r.n_samples} is invalid; {a.advantage!r} / dynamic filtering compare the "
                "samples of a prompt, so use >= 2 (or a critic-free single-sample estimator: reinforce)",
                field="rollout.n_samples",
            )
        if not keeps_groups(r.failure_policy):
            keeping = [n for n, e in FAILURE_POLICIES.items() if e.keeps_groups]
            raise ConfigError(
                f"rollout.failure_policy: {r.failure_policy!r} leaves groups of unequal size, which group "
                f"estimators and dynamic filtering cannot use; choose one of {', '.join(keeping)}",
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
    if a.kl_coef > 0 and not applies_kl(a.kl_mode):
        using = [n for n, e in KL_MODES.items() if e.applies_kl]
        raise ConfigError(
            f"algo.kl_coef: {a.kl_coef} has no effect with algo.kl_mode={a.kl_mode!r} (the KL is not in the "
            f"objective); set --algo.kl_mode to {' or '.join(using)}, or kl_coef 0",
            field="algo.kl_coef",
        )
    if cfg.eval.n_samples > 1 and cfg.eval.temperature == 0:
        raise ConfigError(
            "eval.n_samples > 1 needs eval.temperature > 0 (greedy samples are identical)",
            field="eval.temperature",
        )
    if not 0.0 <= cfg.ema < 1.0:
        raise ConfigError(f"ema: {cfg.ema} is invalid; expected a decay in [0, 1) (0 = off)", field="ema")
    if cfg.ema > 0 and cfg.dist.ranks("policy") > 1:
        raise ConfigError(
            f"ema: an EMA of a policy sharded over {cfg.dist.ranks('policy')} ranks is not supported yet; set ema 0 "
            "or run the policy on one rank",
            field="ema",
        )
    _check_engines(cfg)
    if cfg.train.async_train:
        for flag, on in (
            ("engine_sleep", cfg.dist.engine_sleep == "yes"),
            ("offload_optimizer_in_rollout", cfg.dist.offload_optimizer_in_rollout),
        ):
            if on:
                raise ConfigError(
                    f"dist.{flag} frees or moves memory between rollout and update, which overlap under "
                    "train.async_train; turn one of them off",
                    field=f"dist.{flag}",
                )
    _validate_placement(cfg)


_PLACEMENT = (
    *ROLE_SIZE_FIELDS,
    "colocate_policy_ref",
    "colocate_critic_reward",
    "colocate_all",
    "offload",
    "offload_optimizer_in_rollout",
)


def _validate_placement(cfg: RLConfig) -> None:
    """Colocated roles need the policy's sizes (they share its GPUs one to one)."""
    d, a = cfg.dist, cfg.algo
    if d.mode != "ray":
        return
    pairs = []
    if (d.colocate_policy_ref or d.colocate_all) and needs_reference(a.kl_mode):
        pairs.append(("ref", "colocate_all" if d.colocate_all else "colocate_policy_ref"))
    if d.colocate_all and needs_critic(a.advantage):
        pairs.append(("critic", "colocate_all"))
    for role, flag in pairs:
        if d.ranks(role) != d.ranks("policy"):
            raise ConfigError(
                f"dist.{flag}: the {role} role ({d.ranks(role)} ranks) must have the policy's size "
                f"({d.ranks('policy')} ranks) to share its GPUs; set --dist.{role}_num_nodes / "
                f"--dist.{role}_num_gpus_per_node to the policy's values",
                field=f"dist.{flag}",
            )


def _changed(obj: Any, names: Any, prefix: str) -> list[str]:
    """`prefix.name` of each field of dataclass `obj` among `names` whose value differs from its default."""
    default = type(obj)()
    return [f"{prefix}.{n}" for n in names if getattr(obj, n) != getattr(default, n)]


def _explicit_kl_estimator(raw: AlgoConfig) -> bool:
    """The user chose a KL estimator other than the one `resolve_algo` fills in (so validating twice, after
    the first call resolved it, does not warn about a value nobody set)."""
    return (
        bool(raw.kl_estimator)
        and raw.kl_estimator != resolve_algo(replace(raw, kl_estimator="")).kl_estimator
    )


def _warn_ineffective(cfg: RLConfig, raw: AlgoConfig) -> None:
    """One ConfigWarning per group of fields that were set but are not read under the rest of the config.
    `raw` is the algo config before `resolve_algo` (to tell an explicit kl_estimator from a filled-in one)."""
    a, kl_fields = cfg.algo, ("kl_controller", "kl_target", "kl_horizon")
    checks = [
        (
            _changed(cfg.critic, ("model_path", "lr", "epochs"), "critic")
            + _changed(a, ("value_clip",), "algo"),
            not needs_critic(a.advantage),
            f"algo.advantage={a.advantage!r} trains no critic (estimators with one: "
            f"{', '.join(n for n in ADVANTAGES if needs_critic(n))})",
        ),
        (
            ["algo.kl_estimator"] if _explicit_kl_estimator(raw) else [],
            not needs_reference(a.kl_mode),
            f"algo.kl_mode={a.kl_mode!r} computes no KL",
        ),
        (
            _changed(a, kl_fields, "algo"),
            not applies_kl(a.kl_mode),
            f"algo.kl_mode={a.kl_mode!r} keeps the KL out of the objective, so no coefficient is used",
        ),
        (
            _changed(a, ("kl_target", "kl_horizon"), "algo"),
            applies_kl(a.kl_mode) and a.kl_controller == "fixed",
            "only the adaptive KL controller reads them (algo.kl_controller=fixed)",
        ),
        (
            _changed(a, ("off_policy_low", "off_policy_high"), "algo"),
            not OFF_POLICY.entry(a.off_policy).uses_bounds,
            f"algo.off_policy={a.off_policy!r} uses no weight bounds",
        ),
        (
            _changed(cfg.filter, ("min_mean", "max_mean", "max_refills"), "filter"),
            not cfg.filter.enabled,
            "dynamic filtering is off (filter.enabled=false)",
        ),
        (
            _changed(cfg.eval, ("n_samples", "temperature", "max_prompts", "correct_threshold"), "eval"),
            cfg.eval.every == 0,
            "evaluation is off (eval.every=0)",
        ),
        (
            _changed(cfg.reward, ("overlong_penalty",), "reward"),
            cfg.reward.overlong_buffer == 0,
            "the overlong penalty is off (reward.overlong_buffer=0)",
        ),
        (
            _changed(cfg.dist, _PLACEMENT, "dist"),
            cfg.dist.mode == "local",
            "dist.mode=local runs every role in this process on one rank (placement applies with dist.mode=ray)",
        ),
        (
            _changed(
                cfg.dist, ("critic_num_nodes", "critic_num_gpus_per_node", "colocate_critic_reward"), "dist"
            ),
            cfg.dist.mode == "ray" and not needs_critic(a.advantage),
            f"algo.advantage={a.advantage!r} trains no critic",
        ),
        (
            _changed(cfg.dist, ("ref_num_nodes", "ref_num_gpus_per_node", "colocate_policy_ref"), "dist"),
            cfg.dist.mode == "ray" and not needs_reference(a.kl_mode),
            f"algo.kl_mode={a.kl_mode!r} needs no reference model",
        ),
    ]
    for fields, ineffective, why in checks:
        if fields and ineffective:
            verb = "has" if len(fields) == 1 else "have"
            warnings.warn(f"{', '.join(fields)} {verb} no effect: {why}", ConfigWarning, stacklevel=3)
