"""rewards -> advantages from explicit scalars (relayrl.algorithms.experience): hand-worked values for the shaping
order and for the KL in the reward, and the group size each estimator sees."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from relayrl.algorithms.advantages import AdvantageInputs
from relayrl.algorithms.experience import compute_advantages, shape_rewards
from relayrl.algorithms.registry import ADVANTAGES


def close(a, b):
    assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=1e-6, atol=1e-12)


def test_shaping_order_penalties_then_clip_then_norm():
    # overlong (max 4, buffer 2 -> start 2): lengths 2, 3, 4 -> 0, -0.5, -1:  [1, 0, 2] -> [1, -0.5, 1]
    # truncation 0.5 on the second: -1.0;  clip 0.8: [0.8, -0.8, 0.8];  norm doubles: [1.6, -1.6, 1.6]
    rewards, m = shape_rewards(
        torch.tensor([1.0, 0.0, 2.0]),
        torch.tensor([2, 3, 4]),
        torch.tensor([False, True, False]),
        max_new_tokens=4,
        overlong_buffer=2,
        overlong_penalty=1.0,
        truncation_penalty=0.5,
        clip=0.8,
        norm=lambda r: (r * 2, {"norm_seen": float(r.numel())}),
    )
    assert rewards.dtype == torch.float32
    close(rewards, [1.6, -1.6, 1.6])
    assert m == pytest.approx(
        {
            "rollout/overlong_frac": 2 / 3,
            "rollout/truncated_frac": 1 / 3,
            "rollout/reward_clip_frac": 1.0,
            "rollout/norm_seen": 3.0,
        }
    )


def test_shaping_off_returns_the_rewards_unchanged():
    r = torch.tensor([0.25, -3.0])
    out, m = shape_rewards(r, torch.tensor([9, 9]), torch.tensor([True, True]), max_new_tokens=4)
    close(out, [0.25, -3.0])
    assert m == {}


def _kl_inputs():
    mask = torch.tensor([[False, True, True]])
    old = torch.tensor([[0.0, -1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, -1.5, -0.5]], dtype=torch.float64)
    return torch.tensor([1.0], dtype=torch.float64), mask, old, ref


def test_kl_enters_the_reward_only_in_reward_mode():
    # k1 = old - ref = [., 0.5, -0.5]; R_t = -0.1 kl_t + [last] r = [., -0.05, 1.05]; G (gamma 1) = [., 1.0, 1.05]
    rewards, mask, old, ref = _kl_inputs()
    kw = dict(advantage="reinforce", gamma=1.0, lam=0.95, kl_estimator="k1", n_samples=1, kl_coef=0.1)
    _, ret, kl, m = compute_advantages(rewards, mask, old, ref, None, kl_mode="reward", **kw)
    close(ret, [[0.0, 1.0, 1.05]])
    assert kl is not None
    close(kl.to(torch.float64), [[0.0, 0.5, -0.5]])
    assert m["rollout/kl"] == pytest.approx(0.0)
    _, ret, kl, m = compute_advantages(rewards, mask, old, ref, None, kl_mode="loss", **kw)
    close(ret, [[0.0, 1.0, 1.0]])  # measured (rollout/kl), not in the reward
    assert kl is not None and "rollout/kl" in m
    _, _, kl, m = compute_advantages(rewards, mask, old, None, None, kl_mode="none", **kw)
    assert kl is None and "rollout/kl" not in m


@pytest.mark.parametrize(("advantage", "group"), [("group_norm", 2), ("rloo", 2), ("reinforce", 1)])
def test_group_estimators_see_the_prompt_groups(advantage, group):
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=torch.float64)
    mask = torch.ones(4, 3, dtype=torch.bool)
    old = torch.zeros(4, 3, dtype=torch.float64)
    adv, ret, _, m = compute_advantages(
        rewards,
        mask,
        old,
        None,
        None,
        advantage=advantage,
        gamma=1.0,
        lam=0.95,
        kl_mode="none",
        kl_estimator="k3",
        n_samples=2,
        kl_coef=0.0,
    )
    want_adv, want_ret, want_m = ADVANTAGES[advantage](
        AdvantageInputs(rewards=rewards, action_mask=mask, group_size=group), gamma=1.0, lam=0.95
    )
    close(adv, want_adv.float())
    close(ret, want_ret.float())
    assert adv.dtype == ret.dtype == torch.float32
    assert m == {f"adv/{k}": v for k, v in want_m.items()}
