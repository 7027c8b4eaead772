"""Policy losses, selected by name: `POLICY_LOSSES[name](PolicyLossInputs(...), eps_low=, eps_high=,
dual_clip=, log_ratio_clamp=) -> (per-token loss [B, T], metrics)`. One file per variant; see `base.py`."""

from relayrl.algorithms.policy_losses.base import LOG_RATIO_CLAMP, PolicyLoss, PolicyLossInputs
from relayrl.algorithms.policy_losses.cispo import cispo
from relayrl.algorithms.policy_losses.gspo import gspo
from relayrl.algorithms.policy_losses.ppo import dual_clip_ppo, ppo_clip

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": ppo_clip,
    "dual_clip": dual_clip_ppo,
    "gspo": gspo,
    "cispo": cispo,
}

__all__ = ["LOG_RATIO_CLAMP", "POLICY_LOSSES", "PolicyLoss", "PolicyLossInputs"]
