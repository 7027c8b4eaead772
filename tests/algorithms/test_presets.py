"""Every preset names registered components; group presets use group estimators."""

from __future__ import annotations

import pytest
import torch

from relayrl.algorithms import (
    ADVANTAGES,
    AGGREGATIONS,
    ALGORITHM_PRESETS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
)
from relayrl.algorithms.advantages import AdvantageInputs
from relayrl.algorithms.policy_losses import PolicyLossInputs


@pytest.mark.parametrize("name", sorted(ALGORITHM_PRESETS))
def test_preset_runs_end_to_end(name):
    p = ALGORITHM_PRESETS[name]
    assert p.advantage in ADVANTAGES and p.policy_loss in POLICY_LOSSES
    assert p.aggregation in AGGREGATIONS and p.kl_estimator in KL_ESTIMATORS
    assert p.needs_critic == (p.advantage == "gae")
    # one tiny step through the registries, no if-chains: rewards -> advantages -> loss -> scalar
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]]).bool()
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, -1.0]), action_mask=mask, group_size=2, values=torch.zeros(2, 3)
    )
    adv, _, _ = ADVANTAGES[p.advantage](inp)
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, _ = POLICY_LOSSES[p.policy_loss](
        PolicyLossInputs(logprobs=logp, old_logprobs=logp.detach(), advantages=adv, action_mask=mask),
        eps_low=p.eps_low,
        eps_high=p.eps_high,
    )
    loss_sum, count, _ = AGGREGATIONS[p.aggregation](loss, mask, norm_const=2)
    total = loss_sum / count
    total.backward()
    # the rewarded sequence is pushed up, the other down (ratio 1: no clipping at the first step)
    assert logp.grad[0, 1] < 0 < logp.grad[1, 1]


def test_resolve_names_fills_unset_choices_and_is_idempotent():
    from relayrl.algorithms.presets import AlgoNames, resolve_names

    none = resolve_names(AlgoNames())
    assert (none.advantage, none.policy_loss, none.aggregation, none.kl_mode, none.kl_estimator) == (
        "group_norm",
        "ppo",
        "token_mean",
        "none",
        "k3",
    )
    assert none.off_policy == "none" and resolve_names(AlgoNames(), async_train=True).off_policy == "tis"
    assert resolve_names(AlgoNames(off_policy="icepop"), async_train=True).off_policy == "icepop"
    dapo = resolve_names(AlgoNames(preset="dapo", clip_eps_high=0.3))
    assert (dapo.clip_eps_low, dapo.clip_eps_high) == (0.2, 0.3)
    for name in ALGORITHM_PRESETS:
        once = resolve_names(AlgoNames(preset=name))
        assert resolve_names(once) == once and once.advantage == ALGORITHM_PRESETS[name].advantage
    with pytest.raises(KeyError):
        resolve_names(AlgoNames(preset="grpo2"))  # the validation pass checks the name first
