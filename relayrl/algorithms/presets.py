"""Algorithm presets: one setting (`algorithm: grpo`) picks the registry entries that make an algorithm.

`ALGORITHM_PRESETS[name] -> AlgorithmPreset`; a trainer reads the names and looks them up in
`ADVANTAGES`, `POLICY_LOSSES`, `AGGREGATIONS`, `KL_ESTIMATORS`. `relayrl rl --algo.preset NAME` applies one
(relayrl.config.rl.resolve_algo): the preset only supplies defaults, every field set explicitly in the
trainer config wins. eps None: the policy loss's own default clip range.

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

from dataclasses import dataclass
from enum import StrEnum


class KLMode(StrEnum):
    """Where the KL to the reference model enters."""

    NONE = "none"
    """No KL term (no reference model needed)."""
    REWARD = "reward"
    """Per-token penalty in the reward: R_t = -kl_coef * kl_t + ..."""
    LOSS = "loss"
    """A loss term kl_coef * kl_t aggregated like the policy loss."""


@dataclass(frozen=True, kw_only=True, slots=True)
class AlgorithmPreset:
    """Registry names that make up one algorithm."""

    advantage: str
    """Key of ADVANTAGES."""
    policy_loss: str = "ppo"
    """Key of POLICY_LOSSES."""
    aggregation: str = "token_mean"
    """Key of AGGREGATIONS."""
    kl_mode: KLMode = KLMode.NONE
    """Where the KL enters (none / reward / loss)."""
    kl_estimator: str = "k1"
    """Key of KL_ESTIMATORS."""
    eps_low: float | None = None
    """Policy-loss clip eps_low (None: the loss's default)."""
    eps_high: float | None = None
    """Policy-loss clip eps_high (None: the loss's default)."""
    needs_critic: bool = False
    """True when the advantage needs a value model (gae)."""


ALGORITHM_PRESETS: dict[str, AlgorithmPreset] = {
    "ppo": AlgorithmPreset(advantage="gae", kl_mode=KLMode.REWARD, needs_critic=True),
    "reinforce++": AlgorithmPreset(advantage="reinforce", kl_mode=KLMode.REWARD),
    "reinforce++_baseline": AlgorithmPreset(
        advantage="reinforce_baseline", kl_mode=KLMode.LOSS, kl_estimator="k2"
    ),
    "rloo": AlgorithmPreset(advantage="rloo", kl_mode=KLMode.REWARD),
    "grpo": AlgorithmPreset(
        advantage="group_norm", aggregation="seq_mean_token_mean", kl_mode=KLMode.LOSS, kl_estimator="k3"
    ),
    "dr_grpo": AlgorithmPreset(advantage="dr_grpo", aggregation="seq_mean_token_sum_norm"),
    "dapo": AlgorithmPreset(advantage="group_norm", eps_low=0.2, eps_high=0.28),
    "gspo": AlgorithmPreset(advantage="group_norm", policy_loss="gspo", aggregation="seq_mean_token_mean"),
    "cispo": AlgorithmPreset(advantage="group_norm", policy_loss="cispo"),
}
