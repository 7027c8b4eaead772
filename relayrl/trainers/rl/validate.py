"""The one validation pass of `relayrl rl`'s config: `validate_rl(cfg) -> ResolvedRL`.

    validate_rl(cfg: RLConfig) -> ResolvedRL
        1. names: algo.preset, then (after resolving) every algo.* registry name, rollout.engine /
           failure_policy / agent, against the registries (relayrl.algorithms, torch-free); checked once, here
        2. resolve: a copy whose unset algo names are filled from the preset and the built-in defaults
           (relayrl.algorithms.presets.resolve_names; algo.off_policy: tis under train.async_train or
           rollout.quantization fp8, else none)
        3. values: what a component's own `__post_init__` cannot see (fields of several sections together)
        4. warnings: one ConfigWarning per group of fields that are set but have no effect

The user's config is never changed; callers build the run from the returned ResolvedRL (the roles, the
workers' specs, the experience maker) and save it as the run's config.yaml. Validating a resolved config
again gives the same config and the same warnings.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable
from dataclasses import fields, replace

from relayrl.algorithms.presets import AlgoNames, algo_choices, resolve_names
from relayrl.algorithms.registry import (
    ADVANTAGES,
    AGENTS,
    FAILURE_POLICIES,
    KL_MODES,
    OFF_POLICY,
    applies_kl,
    keeps_groups,
    needs_critic,
    needs_groups,
    needs_reference,
)
from relayrl.config.base import ConfigError, ConfigWarning
from relayrl.config.dist import ROLE_SIZE_FIELDS
from relayrl.config.rl import AlgoConfig, CriticOptimConfig, ResolvedRL, RLConfig
from relayrl.rollout import ENGINES
from relayrl.rollout.build import engine_capabilities

_NAMES = tuple(f.name for f in fields(AlgoNames))
"""The algo.* fields a preset controls (resolved by `resolve_algo`)."""


def _choice(field: str, value: str, choices: Collection[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{field}: {value!r} is not known; choose one of {', '.join(choices)}", field=field)


def validate_rl(cfg: RLConfig) -> ResolvedRL:
    """Check `cfg` and return it resolved (a copy; `cfg` is not changed): raise ConfigError naming the field,
    the bad value and the valid choices, and warn (ConfigWarning, one line each) about values that are
    accepted but have no effect. What a name requires (critic, groups, reference model, whole groups, weight
    bounds) is read from its registry entry (relayrl.algorithms.registry)."""
    if cfg.algo.preset:  # before resolving: the preset's names fill the others
        _choice("algo.preset", cfg.algo.preset, algo_choices()["preset"])
    fp8 = cfg.rollout.quantization == "fp8"
    resolved = replace(cfg, algo=resolve_algo(cfg.algo, async_train=cfg.train.async_train, fp8_rollout=fp8))
    _check_names(resolved)
    _check_values(resolved)
    _warn_ineffective(resolved, cfg.algo)
    return ResolvedRL(resolved)


def resolve_algo(a: AlgoConfig, *, async_train: bool = False, fp8_rollout: bool = False) -> AlgoConfig:
    """A copy of `a` with every preset-controlled name filled in (`resolve_names`; `a.preset` must be "" or a
    known preset). Idempotent."""
    names = AlgoNames(**{k: getattr(a, k) for k in _NAMES})
    names = resolve_names(names, async_train=async_train, fp8_rollout=fp8_rollout)
    return replace(a, **{k: getattr(names, k) for k in _NAMES})


def _check_names(cfg: RLConfig) -> None:
    a, r = cfg.algo, cfg.rollout
    for name, choices in algo_choices().items():
        if name != "preset":
            _choice(f"algo.{name}", getattr(a, name), choices)
    _choice("rollout.engine", r.engine, ENGINES)
    _choice("rollout.failure_policy", r.failure_policy, FAILURE_POLICIES)
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
    tp, d, caps = cfg.dist.engine_tp, cfg.dist, engine_capabilities(cfg.rollout.engine)
    if tp > 1 and d.num_engines == 0:  # colocated: blocks of tp policy ranks run one TP native engine
        ranks = d.ranks("policy")
        why = (
            f"needs rollout.engine native (got {cfg.rollout.engine!r})"
            if not caps.tensor_parallel or caps.own_weights
            else f"must divide the policy's {ranks} ranks (dist.mode ray, policy_num_nodes x policy_num_gpus_per_node)"
            if d.mode != "ray" or ranks % tp
            else "does not take LoRA (the TP shards hold plain weights); merge first or use 1"
            if cfg.model.lora.rank > 0
            else "cannot overlap rollout and training (train.async_train): the shards' ranks train meanwhile"
            if cfg.train.async_train
            else ""
        )
        if why:
            raise ConfigError(f"dist.engine_tp={tp} (colocated) {why}", field="dist.engine_tp")
    elif tp > 1 and not caps.tensor_parallel:
        raise ConfigError(
            f"dist.engine_tp={tp} with separate engines (dist.num_engines={d.num_engines}) needs an engine with "
            f"tensor parallelism, rollout.engine vllm or native (got {cfg.rollout.engine!r})",
            field="dist.engine_tp",
        )
    _check_exact(cfg)
    _check_fp8(cfg)


def _check_fp8(cfg: RLConfig) -> None:
    """rollout.quantization fp8: plain projections on one engine per policy rank (relayrl/rollout/fp8.py)."""
    blocker = (
        "LoRA (the adapters' projections are not plain Linears; merge the adapter first)"
        if cfg.model.lora.rank > 0
        else f"dist.engine_tp={cfg.dist.engine_tp} (tensor-parallel shards are not quantised yet)"
        if cfg.dist.engine_tp > 1
        else ""
    )
    if cfg.rollout.quantization == "fp8" and blocker:
        raise ConfigError(
            f"rollout.quantization fp8 does not take {blocker}; use --rollout.quantization none",
            field="rollout.quantization",
        )


def _check_exact(cfg: RLConfig) -> None:
    """rollout.exact: unsharded policies (one rank, or dist.replicate) with plain projections
    (relayrl/rollout/exact.py)."""
    d = cfg.dist
    blocker = (
        "LoRA (merge the adapter first)"
        if cfg.model.lora.rank > 0
        else f"{d.ranks('policy')} policy ranks (FSDP shards; --dist.replicate true keeps the whole policy on each)"
        if d.mode == "ray" and d.ranks("policy") > 1 and not d.replicate
        else f"dist.sp_size={d.sp_size}"
        if d.sp_size > 1
        else f"dist.engine_tp={d.engine_tp}"
        if d.engine_tp > 1
        else ""
    )
    if cfg.rollout.exact and blocker:
        raise ConfigError(
            f"rollout.exact runs one unsharded policy with plain projections; it does not take {blocker}",
            field="rollout.exact",
        )


def _check_values(cfg: RLConfig) -> None:
    """Values that depend on several fields (each section's `__post_init__` checks its own ranges)."""
    _check_groups(cfg)
    _check_sizes(cfg)
    a = cfg.algo
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


def _check_groups(cfg: RLConfig) -> None:
    """Group estimators and dynamic filtering compare whole groups of >= 2 samples."""
    a, r = cfg.algo, cfg.rollout
    if not (needs_groups(a.advantage) or cfg.filter.enabled):
        return
    if r.n_samples < 2:
        raise ConfigError(
            f"rollout.n_samples: {r.n_samples} is invalid; {a.advantage!r} / dynamic filtering compare the "
            "samples of a prompt, so use >= 2 (or a critic-free single-sample estimator: reinforce)",
            field="rollout.n_samples",
        )
    if r.temperature == 0 and needs_groups(a.advantage):
        warnings.warn(
            f"rollout.temperature 0 (greedy) with {r.n_samples} samples per prompt: the samples of a prompt are "
            f"identical, so {a.advantage!r} gets equal rewards and advantage 0 in every group (nothing to "
            "learn; the run stops with an error if no step had a non-zero advantage); sample with "
            "--rollout.temperature > 0",
            ConfigWarning,
            stacklevel=3,
        )
    if not keeps_groups(r.failure_policy):
        keeping = [n for n, e in FAILURE_POLICIES.items() if e.keeps_groups]
        raise ConfigError(
            f"rollout.failure_policy: {r.failure_policy!r} leaves groups of unequal size, which group "
            f"estimators and dynamic filtering cannot use; choose one of {', '.join(keeping)}",
            field="rollout.failure_policy",
        )


def _check_sizes(cfg: RLConfig) -> None:
    """Sizes of a step: prompts, samples, lengths, engine slots, epochs and batching."""
    a, r = cfg.algo, cfg.rollout
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
    for name in ("epochs", "mini_batches"):
        if getattr(a, name) < 1:
            raise ConfigError(
                f"algo.{name}: {getattr(a, name)} is invalid; expected an int >= 1", field=f"algo.{name}"
            )
    for name in ("micro_batch_tokens", "infer_micro_batch_tokens"):
        if getattr(a, name) < 0:
            raise ConfigError(
                f"algo.{name}: {getattr(a, name)} is invalid; expected 0 (auto) or an int >= 1",
                field=f"algo.{name}",
            )


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
    built = [("ref", needs_reference(a.kl_mode)), ("critic", needs_critic(a.advantage))]
    for role in (r for r, needed in built if needed and d.ranks(r) % d.sp_size):
        raise ConfigError(
            f"dist.sp_size: {d.sp_size} does not divide the {role} role's {d.ranks(role)} ranks (every model "
            f"role runs sequence-parallel); set --dist.{role}_num_gpus_per_node to a multiple of it",
            field="dist.sp_size",
        )
    for role, flag in pairs:
        if d.ranks(role) != d.ranks("policy"):
            raise ConfigError(
                f"dist.{flag}: the {role} role ({d.ranks(role)} ranks) must have the policy's size "
                f"({d.ranks('policy')} ranks) to share its GPUs; set --dist.{role}_num_nodes / "
                f"--dist.{role}_num_gpus_per_node to the policy's values",
                field=f"dist.{flag}",
            )


def _changed(obj: object, names: Iterable[str], prefix: str) -> list[str]:
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


Ineffective = tuple[list[str], bool, str]
"""(fields set away from their default, whether they have no effect, why): one possible ConfigWarning."""


def _warn_ineffective(cfg: RLConfig, raw: AlgoConfig) -> None:
    """One ConfigWarning per group of fields that were set but are not read under the rest of the config.
    `raw` is the algo config before `resolve_algo` (to tell an explicit kl_estimator from a filled-in one)."""
    for names, ineffective, why in [*_algo_groups(cfg, raw), *_run_groups(cfg)]:
        if names and ineffective:
            verb = "has" if len(names) == 1 else "have"
            warnings.warn(f"{', '.join(names)} {verb} no effect: {why}", ConfigWarning, stacklevel=3)


def _algo_groups(cfg: RLConfig, raw: AlgoConfig) -> list[Ineffective]:
    """The critic, KL and off-policy settings that the chosen algorithm does not read."""
    a, kl_fields = cfg.algo, ("kl_controller", "kl_target", "kl_horizon")
    return [
        (
            _changed(cfg.critic, ("model_path", "lr", "epochs"), "critic")
            + _changed(cfg.critic.optim, [f.name for f in fields(CriticOptimConfig)], "critic.optim")
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
    ]


def _run_groups(cfg: RLConfig) -> list[Ineffective]:
    """Filter, eval, reward shaping, placement, async and engine settings that the rest does not read."""
    a, d = cfg.algo, cfg.dist
    return [
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
            _changed(d, _PLACEMENT, "dist"),
            d.mode == "local",
            "dist.mode=local runs every role in this process on one rank (placement applies with dist.mode=ray)",
        ),
        (
            _changed(d, ("critic_num_nodes", "critic_num_gpus_per_node", "colocate_critic_reward"), "dist"),
            d.mode == "ray" and not needs_critic(a.advantage),
            f"algo.advantage={a.advantage!r} trains no critic",
        ),
        (
            _changed(d, ("ref_num_nodes", "ref_num_gpus_per_node", "colocate_policy_ref"), "dist"),
            d.mode == "ray" and not needs_reference(a.kl_mode),
            f"algo.kl_mode={a.kl_mode!r} needs no reference model",
        ),
        (
            _changed(cfg.train, ("gil_switch_s",), "train"),
            not cfg.train.async_train,
            "only the async rollout pipeline sets it (train.async_train=false)",
        ),
        (
            _changed(cfg.rollout, ("vllm_gpu_util", "vllm_any_version"), "rollout"),
            cfg.rollout.engine != "vllm",
            f"rollout.engine={cfg.rollout.engine!r} is not vllm",
        ),
    ]
