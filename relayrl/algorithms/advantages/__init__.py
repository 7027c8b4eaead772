"""Advantage estimators, selected by name: `ADVANTAGES[name](inputs, gamma=..., lam=..., eps=..., whiten=...)`.

Every estimator takes an `AdvantageInputs` (rewards [B], action_mask [B, T], group_size, optional values /
kl / kl_coef) and returns `(advantages [B, T], returns [B, T], metrics)`. See `base.py` for the data shapes
and how multi-turn (non-contiguous) action tokens are handled. Adding one: a new file + one line below.
"""

from relayrl.algorithms.advantages.base import (
    AdvantageEstimator,
    AdvantageInputs,
    masked_moments,
    moments_to_mean_std,
    whiten,
)
from relayrl.algorithms.advantages.dr_grpo import dr_grpo
from relayrl.algorithms.advantages.gae import gae
from relayrl.algorithms.advantages.group_norm import group_norm
from relayrl.algorithms.advantages.reinforce import reinforce
from relayrl.algorithms.advantages.reinforce_baseline import reinforce_baseline
from relayrl.algorithms.advantages.rloo import rloo

ADVANTAGES: dict[str, AdvantageEstimator] = {
    "gae": gae,
    "reinforce": reinforce,
    "reinforce_baseline": reinforce_baseline,
    "rloo": rloo,
    "group_norm": group_norm,
    "dr_grpo": dr_grpo,
}

GROUP_ESTIMATORS = frozenset({"reinforce_baseline", "rloo", "group_norm", "dr_grpo"})
"""Estimators that need group_size >= 2."""

__all__ = [
    "ADVANTAGES",
    "GROUP_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "masked_moments",
    "moments_to_mean_std",
    "whiten",
]
