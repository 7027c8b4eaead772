"""Policy losses, selected by name: `POLICY_LOSSES[name](PolicyLossInputs(...), eps_low=, eps_high=,
dual_clip=, log_ratio_clamp=) -> (per-token loss [B, T], metrics)`. One file per variant, registered by one
Entry in relayrl/algorithms/registry.py; see `base.py`."""

from relayrl.algorithms.policy_losses.base import LOG_RATIO_CLAMP, PolicyLoss, PolicyLossInputs
from relayrl.algorithms.registry import POLICY_LOSSES

__all__ = ["LOG_RATIO_CLAMP", "POLICY_LOSSES", "PolicyLoss", "PolicyLossInputs"]
