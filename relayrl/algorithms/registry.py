"""Every name an RL config can pick, with what it needs: a catalogue that imports no torch.

The validation pass of `relayrl rl` (relayrl.trainers.rl.validate, through relayrl.algorithms.presets) reads
the names and requirements here without loading torch; an implementation is imported from its entry's
`target` on the first lookup and cached. relayrl.config imports nothing from this package.

    Entry(name=, target="package.module:attribute", doc=, needs_critic=, needs_groups=, needs_reference=,
          applies_kl=, keeps_groups=, uses_bounds=)
    REGISTRY[name]                 -> the implementation (imported on first lookup)
    REGISTRY.entry(name)           -> its Entry; `name in REGISTRY`, iteration and len() import nothing
    needs_critic(advantage) / needs_groups(advantage) / needs_reference(kl_mode) -> bool

Implemented kinds (Registry): ADVANTAGES, POLICY_LOSSES, AGGREGATIONS, KL_ESTIMATORS, KL_CONTROLLERS,
OFF_POLICY. Named behaviours the trainer carries out itself (a read-only {name: Entry}, no target):
KL_MODES, FAILURE_POLICIES, AGENTS. A requirement lives on its entry, never in a separate list of names.
Adding an estimator: one new file plus one Entry line below.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:  # the Protocols live beside the torch code; only type checkers read them here
    from relayrl.algorithms.advantages.base import AdvantageEstimator
    from relayrl.algorithms.aggregation import Aggregation
    from relayrl.algorithms.off_policy import OffPolicyCorrection
    from relayrl.algorithms.policy_losses.base import PolicyLoss

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One registered name and what choosing it requires of the rest of the run."""

    name: str
    """The name a config uses (e.g. `algo.advantage: gae`)."""
    doc: str
    """One line: what it does, its paper."""
    target: str = ""
    """`package.module:attribute` of the implementation; "" for behaviours the trainer carries out itself
    (KL modes, failure policies, agents)."""
    needs_critic: bool = False
    """Advantage estimators: needs a value model (the critic worker is built; values fill AdvantageInputs)."""
    needs_groups: bool = False
    """Advantage estimators: compares the samples of one prompt (rollout.n_samples >= 2, whole groups)."""
    needs_reference: bool = False
    """KL modes: needs the reference model's log-probs (the reference worker is built)."""
    applies_kl: bool = False
    """KL modes: the KL enters the objective, so algo.kl_coef and its controller have an effect."""
    keeps_groups: bool = True
    """Failure policies: a prompt's samples stay together (False: drop_sample leaves groups of unequal size)."""
    uses_bounds: bool = False
    """Off-policy corrections: reads the weight bounds low / high (algo.off_policy_low / off_policy_high)."""


class Registry(Mapping[str, T], Generic[T]):
    """name -> implementation, imported from `Entry.target` on first lookup. An unknown name raises a KeyError
    that lists the valid ones."""

    def __init__(self, kind: str, *entries: Entry) -> None:
        self.kind = kind
        self._entries = MappingProxyType({e.name: e for e in entries})
        self._loaded: dict[str, T] = {}
        missing = [e.name for e in entries if ":" not in e.target]
        assert not missing, f"{kind}: entries {missing} need a target 'module:attribute'"

    @property
    def entries(self) -> Mapping[str, Entry]:
        """{name: Entry}, read-only."""
        return self._entries

    def entry(self, name: str) -> Entry:
        """The Entry of `name` (no import)."""
        return _lookup(self.kind, self._entries, name)

    def __getitem__(self, name: str) -> T:
        if name not in self._loaded:
            module, _, attribute = self.entry(name).target.partition(":")
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"


def _lookup(kind: str, entries: Mapping[str, Entry], name: str) -> Entry:
    try:
        return entries[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; choose one of: {', '.join(entries)}") from None


def _catalogue(*entries: Entry) -> Mapping[str, Entry]:
    return MappingProxyType({e.name: e for e in entries})


_A = "relayrl.algorithms.advantages"
ADVANTAGES: Registry[AdvantageEstimator] = Registry(
    "advantage estimator",
    Entry(name="gae", target=f"{_A}.gae:gae", needs_critic=True, doc="GAE(gamma, lambda) on a critic (PPO)"),
    Entry(name="reinforce", target=f"{_A}.reinforce:reinforce", doc="discounted return (REINFORCE++)"),
    Entry(
        name="reinforce_baseline",
        target=f"{_A}.reinforce_baseline:reinforce_baseline",
        needs_groups=True,
        doc="reward minus the group mean, batch-whitened (REINFORCE++-baseline)",
    ),
    Entry(
        name="rloo", target=f"{_A}.rloo:rloo", needs_groups=True, doc="leave-one-out group baseline (RLOO)"
    ),
    Entry(
        name="group_norm",
        target=f"{_A}.group_norm:group_norm",
        needs_groups=True,
        doc="(reward - group mean) / group std (GRPO)",
    ),
    Entry(
        name="dr_grpo",
        target=f"{_A}.dr_grpo:dr_grpo",
        needs_groups=True,
        doc="reward - group mean (Dr. GRPO)",
    ),
)

_P = "relayrl.algorithms.policy_losses"
POLICY_LOSSES: Registry[PolicyLoss] = Registry(
    "policy loss",
    Entry(
        name="ppo",
        target=f"{_P}.ppo:ppo_clip",
        doc="PPO clipped surrogate (clip-higher when eps_high > eps_low)",
    ),
    Entry(
        name="dual_clip", target=f"{_P}.ppo:dual_clip_ppo", doc="PPO with dual clip for negative advantages"
    ),
    Entry(name="gspo", target=f"{_P}.gspo:gspo", doc="sequence-level ratio (GSPO)"),
    Entry(name="cispo", target=f"{_P}.cispo:cispo", doc="clipped IS weight, stop-gradient (CISPO)"),
)

_G = "relayrl.algorithms.aggregation"
AGGREGATIONS: Registry[Aggregation] = Registry(
    "aggregation",
    Entry(name="token_mean", target=f"{_G}:token_mean", doc="every action token weighs the same (DAPO)"),
    Entry(
        name="seq_mean_token_mean",
        target=f"{_G}:seq_mean_token_mean",
        doc="every sequence weighs the same (GRPO)",
    ),
    Entry(
        name="seq_mean_token_sum_norm",
        target=f"{_G}:seq_mean_token_sum_norm",
        doc="token sums over a constant, per sequence (Dr. GRPO)",
    ),
)

_K = "relayrl.algorithms.kl"
KL_ESTIMATORS: Registry[Any] = Registry(
    "KL estimator",
    Entry(name="k1", target=f"{_K}:k1", doc="log ratio: unbiased, high variance"),
    Entry(name="k2", target=f"{_K}:k2", doc="half squared log ratio: its gradient is that of KL(pi || ref)"),
    Entry(name="k3", target=f"{_K}:k3", doc="exp(-log ratio) - 1 + log ratio: unbiased, >= 0 (GRPO)"),
)
KL_CONTROLLERS: Registry[Any] = Registry(
    "KL controller",
    Entry(name="fixed", target=f"{_K}:FixedKLController", doc="constant coefficient"),
    Entry(name="adaptive", target=f"{_K}:AdaptiveKLController", doc="towards a target KL (Ziegler et al.)"),
)

_O = "relayrl.algorithms.off_policy"
OFF_POLICY: Registry[OffPolicyCorrection] = Registry(
    "off-policy correction",
    Entry(name="none", target=f"{_O}:no_correction", doc="no correction: weight 1, nothing masked"),
    Entry(
        name="tis",
        target=f"{_O}:tis",
        uses_bounds=True,
        doc="truncated importance sampling (default bounds [0, 2])",
    ),
    Entry(
        name="icepop",
        target=f"{_O}:icepop",
        uses_bounds=True,
        doc="tokens with weight outside [0.5, 5] masked (IcePop)",
    ),
    Entry(
        name="seq_mask_tis",
        target=f"{_O}:seq_mask_tis",
        uses_bounds=True,
        doc="sequences with geometric-mean weight outside [0.5, 2] masked",
    ),
)

KL_MODES: Mapping[str, Entry] = _catalogue(
    Entry(name="none", doc="no KL term and no reference model"),
    Entry(name="monitor", needs_reference=True, doc="KL to the reference measured and logged only"),
    Entry(
        name="reward",
        needs_reference=True,
        applies_kl=True,
        doc="per-token penalty in the reward (PPO, RLOO)",
    ),
    Entry(
        name="loss", needs_reference=True, applies_kl=True, doc="a KL loss term beside the policy loss (GRPO)"
    ),
)
"""Where the KL to the reference model enters (`algo.kl_mode`)."""

FAILURE_POLICIES: Mapping[str, Entry] = _catalogue(
    Entry(name="drop_group", doc="drop every sample of a prompt that has a failed sample"),
    Entry(name="drop_sample", keeps_groups=False, doc="drop only the failed samples"),
    Entry(name="zero_reward", doc="keep failed samples with reward 0 (counted)"),
    Entry(name="raise", doc="stop the run at the first failure"),
)
"""What failed samples do (`rollout.failure_policy`; relayrl.agents.failures applies them)."""

AGENTS: Mapping[str, Entry] = _catalogue(
    Entry(name="single", doc="one completion per sample"),
    Entry(name="multi", doc="a multi-turn AgentInstance (rollout.agent_file) or multi-turn task"),
)
"""Built-in agent executors (`rollout.agent`; a path ending in .py names a user's executor instead)."""


def needs_critic(advantage: str) -> bool:
    """Whether the advantage estimator `advantage` needs a value model (critic)."""
    return ADVANTAGES.entry(advantage).needs_critic


def needs_groups(advantage: str) -> bool:
    """Whether the advantage estimator `advantage` compares the samples of a prompt (group_size >= 2)."""
    return ADVANTAGES.entry(advantage).needs_groups


def needs_reference(kl_mode: str) -> bool:
    """Whether the KL mode `kl_mode` needs the reference model's log-probs."""
    return _lookup("KL mode", KL_MODES, kl_mode).needs_reference


def applies_kl(kl_mode: str) -> bool:
    """Whether the KL mode `kl_mode` puts the KL into the objective (so kl_coef has an effect)."""
    return _lookup("KL mode", KL_MODES, kl_mode).applies_kl


def keeps_groups(failure_policy: str) -> bool:
    """Whether the failure policy keeps a prompt's samples together (what group estimators need)."""
    return _lookup("failure policy", FAILURE_POLICIES, failure_policy).keeps_groups
