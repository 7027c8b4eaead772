"""RL algorithm core: pure tensor functions selected by name (no `if algo == ...` in trainers).

Registries (every entry returns `(tensor(s), metrics: dict[str, float])`):

- `ADVANTAGES[name](AdvantageInputs(...), gamma=, lam=, eps=, whiten=) -> (advantages [B,T], returns [B,T], m)`
  names: gae, reinforce, reinforce_baseline, rloo, group_norm, dr_grpo
- `POLICY_LOSSES[name](PolicyLossInputs(...), eps_low=, eps_high=, dual_clip=, log_ratio_clamp=)
  -> (loss [B,T], m)`; names: ppo, dual_clip, gspo, cispo
- `AGGREGATIONS[name](loss [B,T], action_mask, num_tokens=, num_seqs=, norm_const=) -> (scalar, m)`
  names: token_mean, seq_mean_token_mean, seq_mean_token_sum_norm
- `OFF_POLICY[name](old_logprobs, rollout_logprobs, action_mask, low=, high=) -> (is_weight, keep_mask, m)`
  names: tis, icepop, seq_mask_tis
- `KL_ESTIMATORS` (k1, k2, k3) via `kl_estimate` / `kl_loss`; `KL_CONTROLLERS` (fixed, adaptive)
- `ALGORITHM_PRESETS[name] -> AlgorithmPreset` (ppo, reinforce++, reinforce++_baseline, rloo, grpo, dr_grpo,
  dapo, gspo, cispo): the registry names that make up each algorithm
- `value_loss`, `entropy_bonus`, shaping (`clip_rewards`, `overlong_penalty`, `truncation_penalty`,
  `RunningRewardNorm`), filtering (`dynamic_filter`, `group_rows`).

Shapes: B sequences (n samples of a prompt contiguous), T token positions, action_mask [B, T].
See docs/algorithms.md for formulas, defaults and papers.
"""

from relayrl.algorithms.advantages import ADVANTAGES, GROUP_ESTIMATORS, AdvantageInputs
from relayrl.algorithms.aggregation import AGGREGATIONS, step_denominators
from relayrl.algorithms.entropy import entropy_bonus, entropy_from_logits
from relayrl.algorithms.filtering import dynamic_filter, group_rows
from relayrl.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS, kl_estimate, kl_loss
from relayrl.algorithms.off_policy import OFF_POLICY
from relayrl.algorithms.policy_losses import POLICY_LOSSES, PolicyLossInputs
from relayrl.algorithms.presets import ALGORITHM_PRESETS, AlgorithmPreset, KLMode
from relayrl.algorithms.shaping import RunningRewardNorm, clip_rewards, overlong_penalty, truncation_penalty
from relayrl.algorithms.value_loss import value_loss

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "ALGORITHM_PRESETS",
    "GROUP_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "OFF_POLICY",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AlgorithmPreset",
    "KLMode",
    "PolicyLossInputs",
    "RunningRewardNorm",
    "clip_rewards",
    "dynamic_filter",
    "entropy_bonus",
    "entropy_from_logits",
    "group_rows",
    "kl_estimate",
    "kl_loss",
    "overlong_penalty",
    "step_denominators",
    "truncation_penalty",
    "value_loss",
]
