"""Advantage estimators, selected by name: `ADVANTAGES[name](inputs, gamma=..., lam=..., eps=..., whiten=...)`.

Every estimator takes an `AdvantageInputs` (rewards [B], action_mask [B, T], group_size, optional values /
kl / kl_coef) and returns `(advantages [B, T], returns [B, T], metrics)`. See `base.py` for the data shapes
and how multi-turn (non-contiguous) action tokens are handled. Adding one: a new file + one Entry in
relayrl/algorithms/registry.py (which also says whether it needs a critic or groups).
"""

from relayrl.algorithms.advantages.base import (
    AdvantageEstimator,
    AdvantageInputs,
    masked_mean_std,
    masked_moments,
    moments_to_mean_std,
    whiten,
)
from relayrl.algorithms.registry import ADVANTAGES

__all__ = [
    "ADVANTAGES",
    "AdvantageEstimator",
    "AdvantageInputs",
    "masked_mean_std",
    "masked_moments",
    "moments_to_mean_std",
    "whiten",
]
