"""The torch-free catalogue: lazy registries, requirements carried by the entries and matching behaviour."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from relayrl.algorithms import ALGORITHM_PRESETS
from relayrl.algorithms.advantages import AdvantageInputs
from relayrl.algorithms.registry import (
    ADVANTAGES,
    AGGREGATIONS,
    FAILURE_POLICIES,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    KL_MODES,
    OFF_POLICY,
    POLICY_LOSSES,
    Registry,
    applies_kl,
    keeps_groups,
    needs_critic,
    needs_groups,
    needs_reference,
)

REGISTRIES = [ADVANTAGES, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, KL_CONTROLLERS, OFF_POLICY]


def test_reading_names_and_requirements_imports_no_torch():
    code = (
        "import sys\n"
        "import relayrl.algorithms as A\n"
        "from relayrl.algorithms.registry import ADVANTAGES, OFF_POLICY, needs_critic, needs_reference\n"
        "assert 'gae' in ADVANTAGES and list(OFF_POLICY)[0] == 'none' and len(A.POLICY_LOSSES) == 4\n"
        "assert needs_critic('gae') and needs_reference('loss') and A.ALGORITHM_PRESETS['ppo'].needs_critic\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "A.ADVANTAGES['gae']\n"
        "assert 'torch' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("registry", REGISTRIES, ids=lambda r: r.kind)
def test_every_target_resolves_once(registry: Registry):
    for name in registry:
        impl = registry[name]
        assert callable(impl) and registry[name] is impl
        assert registry.entry(name).name == name and registry.entry(name).doc


def test_unknown_name_lists_the_choices():
    with pytest.raises(
        KeyError, match=r"unknown policy loss 'ppo2'; choose one of: ppo, dual_clip, gspo, cispo"
    ):
        POLICY_LOSSES["ppo2"]
    with pytest.raises(KeyError, match="unknown KL mode 'kl'"):
        needs_reference("kl")
    assert POLICY_LOSSES.get("ppo2") is None and "ppo2" not in POLICY_LOSSES


def test_requirements():
    assert [n for n in ADVANTAGES if needs_critic(n)] == ["gae"]
    assert sorted(n for n in ADVANTAGES if needs_groups(n)) == [
        "dr_grpo",
        "group_norm",
        "reinforce_baseline",
        "rloo",
    ]
    assert {n for n in KL_MODES if needs_reference(n)} == {"monitor", "reward", "loss"}
    assert {n for n in KL_MODES if applies_kl(n)} == {"reward", "loss"}
    assert [n for n in FAILURE_POLICIES if not keeps_groups(n)] == ["drop_sample"]
    assert [n for n in OFF_POLICY if not OFF_POLICY.entry(n).uses_bounds] == ["none"]
    for name, preset in ALGORITHM_PRESETS.items():
        assert preset.needs_critic == needs_critic(preset.advantage), name
        assert preset.kl_mode in KL_MODES, name


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_flags_match_the_estimator(name):
    # needs_critic: fails without values, else runs without them
    no_values = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0]), action_mask=torch.ones(2, 3).bool(), group_size=2
    )
    if needs_critic(name):
        with pytest.raises(ValueError, match="values"):
            ADVANTAGES[name](no_values)
    else:
        ADVANTAGES[name](no_values)
    # needs_groups: rejects group_size 1, else runs on it
    inp = AdvantageInputs(
        rewards=torch.tensor([1.0, 0.0]),
        action_mask=torch.ones(2, 3).bool(),
        group_size=1,
        values=torch.zeros(2, 3),
    )
    if needs_groups(name):
        with pytest.raises(ValueError, match="group_size >= 2"):
            ADVANTAGES[name](inp)
    else:
        ADVANTAGES[name](inp)
