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
