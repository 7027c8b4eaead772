"""RL algorithm core: pure tensor functions selected by name (no `if algo == ...` in trainers).

Registries (relayrl.algorithms.registry: one Entry per name, carrying what it needs; the implementation is
imported on first lookup, so reading names and requirements imports no torch):

- `ADVANTAGES[name](AdvantageInputs(...), gamma=, lam=, eps=, whiten=) -> (advantages [B,T], returns [B,T], m)`
  names: gae, reinforce, reinforce_baseline, rloo, group_norm, dr_grpo
- `POLICY_LOSSES[name](PolicyLossInputs(...), eps_low=, eps_high=, dual_clip=, log_ratio_clamp=)
  -> (loss [B,T], m)`; names: ppo, dual_clip, gspo, cispo
- `AGGREGATIONS[name](loss [B,T], action_mask, *, norm_const=None) -> (loss_sum, count, m)`: the training
  core divides the step's summed gradients by the step's total count; names: token_mean,
  seq_mean_token_mean, seq_mean_token_sum_norm
- `OFF_POLICY[name](old_logprobs, rollout_logprobs, action_mask, *, low=None, high=None)
  -> (is_weight, keep_mask, m)`; names: none, tis, icepop, seq_mask_tis (None bounds: the method's own)
- `KL_ESTIMATORS` (k1, k2, k3) via `kl_estimate` / `kl_loss`; `KL_CONTROLLERS` (fixed, adaptive)
- `KL_MODES`, `FAILURE_POLICIES`, `AGENTS`: {name: Entry} of behaviours the trainer carries out itself
- `needs_critic(advantage)`, `needs_groups(advantage)`, `needs_reference(kl_mode)`: requirements by name
- `ALGORITHM_PRESETS[name] -> AlgorithmPreset` (ppo, reinforce++, reinforce++_baseline, rloo, grpo, dr_grpo,
  dapo, gspo, cispo): the registry names that make up each algorithm
- `value_loss`, `entropy_bonus`, shaping (`clip_rewards`, `overlong_penalty`, `truncation_penalty`,
  `RunningRewardNorm`), filtering (`dynamic_filter`, `group_rows`).

Shapes: B sequences (n samples of a prompt contiguous), T token positions, action_mask [B, T].
See docs/algorithms.md for formulas, defaults and papers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from relayrl.algorithms.presets import ALGORITHM_PRESETS, AlgorithmPreset
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
    Entry,
    Registry,
    needs_critic,
    needs_groups,
    needs_reference,
)

# The tensor functions load on first attribute access (PEP 562), so `import relayrl.algorithms` (and the
# config, which reads the registries' names) stays torch-free.
_TORCH_NAMES = {
    "AdvantageInputs": "relayrl.algorithms.advantages",
    "PolicyLossInputs": "relayrl.algorithms.policy_losses",
    "RunningRewardNorm": "relayrl.algorithms.shaping",
    "clip_rewards": "relayrl.algorithms.shaping",
    "overlong_penalty": "relayrl.algorithms.shaping",
    "truncation_penalty": "relayrl.algorithms.shaping",
    "dynamic_filter": "relayrl.algorithms.filtering",
    "group_rows": "relayrl.algorithms.filtering",
    "entropy_bonus": "relayrl.algorithms.entropy",
    "entropy_from_logits": "relayrl.algorithms.entropy",
    "kl_estimate": "relayrl.algorithms.kl",
    "kl_loss": "relayrl.algorithms.kl",
    "value_loss": "relayrl.algorithms.value_loss",
}

if TYPE_CHECKING:
    from relayrl.algorithms.advantages import AdvantageInputs
    from relayrl.algorithms.entropy import entropy_bonus, entropy_from_logits
    from relayrl.algorithms.filtering import dynamic_filter, group_rows
    from relayrl.algorithms.kl import kl_estimate, kl_loss
    from relayrl.algorithms.policy_losses import PolicyLossInputs
    from relayrl.algorithms.shaping import (
        RunningRewardNorm,
        clip_rewards,
        overlong_penalty,
        truncation_penalty,
    )
    from relayrl.algorithms.value_loss import value_loss


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module(_TORCH_NAMES[name]), name)
    raise AttributeError(f"module 'relayrl.algorithms' has no attribute {name!r}")


__all__ = [
    "ADVANTAGES",
    "AGENTS",
    "AGGREGATIONS",
    "ALGORITHM_PRESETS",
    "FAILURE_POLICIES",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "KL_MODES",
    "OFF_POLICY",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AlgorithmPreset",
    "Entry",
    "PolicyLossInputs",
    "Registry",
    "RunningRewardNorm",
    "clip_rewards",
    "dynamic_filter",
    "entropy_bonus",
    "entropy_from_logits",
    "group_rows",
    "kl_estimate",
    "kl_loss",
    "needs_critic",
    "needs_groups",
    "needs_reference",
    "overlong_penalty",
    "truncation_penalty",
    "value_loss",
]
