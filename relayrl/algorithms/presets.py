"""Algorithm presets: one setting (`algorithm: grpo`) picks the registry entries that make an algorithm.

`ALGORITHM_PRESETS[name] -> AlgorithmPreset`; a trainer reads the names and looks them up in `ADVANTAGES`,
`POLICY_LOSSES`, `AGGREGATIONS`, `KL_MODES`, `KL_ESTIMATORS` (relayrl.algorithms.registry, whose entries say
what each needs: the critic column below is `needs_critic(advantage)`). Imports no torch.
`relayrl rl --algo.preset NAME` applies one (relayrl.config.rl.resolve_algo): the preset only supplies
defaults, every field set explicitly in the trainer config wins. eps None: the policy loss's own default
clip range.

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

from relayrl.algorithms.registry import needs_critic


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
