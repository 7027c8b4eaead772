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
  dapo, gspo, cispo): the registry names that make up each algorithm; `resolve_names` fills a config's unset
  choices from them (relayrl.algorithms.presets)

This package's namespace holds only that torch-free catalogue, so `import relayrl.algorithms` loads no torch.
The tensor functions are imported from their modules: `advantages` (AdvantageInputs), `policy_losses`
(PolicyLossInputs), `aggregation`, `off_policy`, `kl`, `value` (value_loss), `entropy`, `shaping` (clip_rewards,
overlong_penalty, truncation_penalty, RunningRewardNorm), `filtering` (dynamic_filter, group_rows),
`experience` (shape_rewards, compute_advantages: rewards -> advantages from explicit scalars), `objective`
(PolicyObjective, ValueObjective) and `preference` (BT, DPO / IPO / cDPO, KTO, KD).

Shapes: B sequences (n samples of a prompt contiguous), T token positions, action_mask [B, T].
See docs/algorithms.md for formulas, defaults and papers.

`from relayrl.algorithms import value_loss` gives the critic loss function (imported on first use, like the
registries' implementations; its module is `relayrl.algorithms.value`, so no submodule shadows the name).
"""

from __future__ import annotations

import importlib
from typing import Any

from relayrl.algorithms.presets import ALGORITHM_PRESETS, AlgoNames, AlgorithmPreset, resolve_names
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
    "AlgoNames",
    "AlgorithmPreset",
    "Entry",
    "Registry",
    "needs_critic",
    "needs_groups",
    "needs_reference",
    "resolve_names",
]

_LAZY = {"value_loss": ("relayrl.algorithms.value", "value_loss")}
"""Tensor functions exported here but imported on first access (they need torch): name -> (module, attribute)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
