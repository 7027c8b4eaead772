"""Algorithm presets: one setting (`algorithm: grpo`) picks the registry entries that make an algorithm.

`ALGORITHM_PRESETS[name] -> AlgorithmPreset`; a trainer reads the names and looks them up in `ADVANTAGES`,
`POLICY_LOSSES`, `AGGREGATIONS`, `KL_MODES`, `KL_ESTIMATORS` (relayrl.algorithms.registry, whose entries say
what each needs: the critic column below is `needs_critic(advantage)`). Imports no torch.

    resolve_names(AlgoNames(...), async_train=, fp8_rollout=) -> AlgoNames     every unset choice filled in
    algo_choices() -> {algo field: valid names}                  what the validation pass checks names against

`relayrl rl --algo.preset NAME` applies one (`resolve_names`, called once by relayrl.trainers.rl.validate):
the preset only supplies defaults, every field set explicitly in the trainer config wins. eps None: the policy
loss's own default clip range.

| preset               | advantage          | policy loss | aggregation             | KL                  | critic |
|----------------------|--------------------|-------------|-------------------------|---------------------|--------|
| ppo                  | gae                | ppo         | token_mean              | reward, k1          | yes    |
| reinforce++          | reinforce          | ppo         | token_mean              | reward, k1          | no     |
| reinforce++_baseline | reinforce_baseline | ppo         | token_mean              | loss, k2            | no     |
| rloo                 | rloo               | ppo         | token_mean              | reward, k1          | no     |
| grpo                 | group_norm         | ppo         | seq_mean_token_mean     | loss, k3            | no     |
| dr_grpo              | dr_grpo            | ppo         | seq_mean_token_sum_norm | none                | no     |
| dapo                 | group_norm         | ppo (0.2, 0.28) | token_mean          | none                | no     |
| gspo                 | group_norm         | gspo        | seq_mean_token_mean     | none                | no     |
| cispo                | group_norm         | cispo       | token_mean              | none                | no     |

KL "reward": per-token estimate in the reward (AdvantageInputs.kl); "loss": `kl_loss` added to the policy
loss (k2 as a loss has the gradient of the true KL, k3 is GRPO's choice); "none": no reference model needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from relayrl.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_MODES,
    OFF_POLICY,
    POLICY_LOSSES,
    needs_critic,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmPreset:
    """Registry names that make up one algorithm."""

    advantage: str
    """Key of ADVANTAGES."""
    policy_loss: str = "ppo"
    """Key of POLICY_LOSSES."""
    aggregation: str = "token_mean"
    """Key of AGGREGATIONS."""
    kl_mode: str = "none"
    """Key of KL_MODES: where the KL enters (none / monitor / reward / loss)."""
    kl_estimator: str = "k1"
    """Key of KL_ESTIMATORS."""
    eps_low: float | None = None
    """Policy-loss clip eps_low (None: the loss's default)."""
    eps_high: float | None = None
    """Policy-loss clip eps_high (None: the loss's default)."""

    @property
    def needs_critic(self) -> bool:
        """True when the advantage needs a value model (read from its registry entry)."""
        return needs_critic(self.advantage)


ALGORITHM_PRESETS: dict[str, AlgorithmPreset] = {
    "ppo": AlgorithmPreset(advantage="gae", kl_mode="reward"),
    "reinforce++": AlgorithmPreset(advantage="reinforce", kl_mode="reward"),
    "reinforce++_baseline": AlgorithmPreset(
        advantage="reinforce_baseline", kl_mode="loss", kl_estimator="k2"
    ),
    "rloo": AlgorithmPreset(advantage="rloo", kl_mode="reward"),
    "grpo": AlgorithmPreset(
        advantage="group_norm", aggregation="seq_mean_token_mean", kl_mode="loss", kl_estimator="k3"
    ),
    "dr_grpo": AlgorithmPreset(advantage="dr_grpo", aggregation="seq_mean_token_sum_norm"),
    "dapo": AlgorithmPreset(advantage="group_norm", eps_low=0.2, eps_high=0.28),
    "gspo": AlgorithmPreset(advantage="group_norm", policy_loss="gspo", aggregation="seq_mean_token_mean"),
    "cispo": AlgorithmPreset(advantage="group_norm", policy_loss="cispo"),
}


BUILTIN_ALGO = {
    "advantage": "group_norm",
    "policy_loss": "ppo",
    "aggregation": "token_mean",
    "kl_mode": "none",
}
"""What an empty preset-controlled name means when no preset is chosen."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgoNames:
    """The algorithm choices a preset controls (the `algo.*` fields of the same names). Before
    `resolve_names`: "" / None = not set by the user; after: every name filled in (clip ranges may stay None =
    the policy loss's own default)."""

    preset: str = ""
    """Key of ALGORITHM_PRESETS, or "" for none."""
    advantage: str = ""
    """Key of ADVANTAGES."""
    policy_loss: str = ""
    """Key of POLICY_LOSSES."""
    aggregation: str = ""
    """Key of AGGREGATIONS."""
    kl_mode: str = ""
    """Key of KL_MODES."""
    kl_estimator: str = ""
    """Key of KL_ESTIMATORS."""
    off_policy: str = ""
    """Key of OFF_POLICY."""
    clip_eps_low: float | None = None
    """Lower clip range of the policy loss (None: the loss's default)."""
    clip_eps_high: float | None = None
    """Upper clip range of the policy loss (None: the loss's default)."""


def resolve_names(n: AlgoNames, *, async_train: bool = False, fp8_rollout: bool = False) -> AlgoNames:
    """A copy of `n` with every name filled in: the field's own value when set, else the preset's
    (`n.preset`, which must be "" or a key of ALGORITHM_PRESETS), else the built-in default (BUILTIN_ALGO; KL
    estimator: the preset's when its KL mode is the one used, else k1 for kl_mode=reward and k3 otherwise;
    off-policy correction: tis when `async_train` (stale samples need it) or `fp8_rollout` (the engine samples
    with fp8 weights), else none). Clip ranges stay None
    when neither the user nor the preset sets them: each policy loss then uses its own default. Idempotent."""
    p = ALGORITHM_PRESETS[n.preset] if n.preset else None
    names = {k: getattr(n, k) or (str(getattr(p, k)) if p else v) for k, v in BUILTIN_ALGO.items()}
    if n.kl_estimator:
        estimator = n.kl_estimator
    elif p is not None and p.kl_mode != "none" and names["kl_mode"] == str(p.kl_mode):
        estimator = p.kl_estimator
    else:
        estimator = "k1" if names["kl_mode"] == "reward" else "k3"
    return replace(
        n,
        **names,
        off_policy=n.off_policy or ("tis" if async_train or fp8_rollout else "none"),
        kl_estimator=estimator,
        clip_eps_low=n.clip_eps_low if n.clip_eps_low is not None else (p.eps_low if p else None),
        clip_eps_high=n.clip_eps_high if n.clip_eps_high is not None else (p.eps_high if p else None),
    )


def algo_choices() -> dict[str, tuple[str, ...]]:
    """{`algo.*` field: its valid names}, read from the registries (new entries count; nothing imported)."""
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
