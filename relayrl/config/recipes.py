"""The configs of the one-model training commands: each is `OneModelConfig` (model, data, optim, train, ckpt,
logger, dist; relayrl.config.components) plus the command's own section.

    SFTConfig(+ mode)            relayrl sft      relayrl.trainers.sft
    RMConfig(+ rm: RMSection)    relayrl rm       relayrl.trainers.rm
    PRMConfig(+ prm: PRMSection) relayrl prm      relayrl.trainers.prm
    DPOConfig(+ dpo: DPOSection) relayrl dpo      relayrl.trainers.dpo (iterative-dpo reuses DPOSection)
    KTOConfig(+ kto: KTOSection) relayrl kto      relayrl.trainers.kto
    KDConfig(+ kd: KDSection)    relayrl kd       relayrl.trainers.kd

One level of dataclass fields, no behaviour inherited: the shared recipe runner is typed on OneModelConfig and
reads only its sections; each recipe reads its own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from relayrl.config.base import check_choices, invalid
from relayrl.config.components import OneModelConfig


@dataclass(kw_only=True, slots=True)
class SFTConfig(OneModelConfig):
    """Supervised fine-tuning."""

    mode: Literal["response", "multiturn", "pretrain"] = "response"
    """Which tokens carry loss: response (the answer only), multiturn (every assistant turn), pretrain (all)."""
    aux_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the router load-balancing loss added to the token loss (as
    OpenRLHF's --aux_loss_coef), logged as train/aux_loss. 0: off. Dense models ignore it."""

    def __post_init__(self) -> None:
        OneModelConfig.__post_init__(self)
        if self.aux_loss_coef < 0:
            raise invalid(
                "aux_loss_coef", self.aux_loss_coef, "a float >= 0 (0 = no router load-balancing loss)"
            )


@dataclass(kw_only=True, slots=True)
class RMSection:
    """Reward-model options."""

    margin_key: str | None = None
    """Key of an optional per-pair margin (a number): loss -log sigmoid(r_chosen - r_rejected - margin)."""


@dataclass(kw_only=True, slots=True)
class RMConfig(OneModelConfig):
    """Reward model training (Bradley-Terry on preference pairs)."""

    rm: RMSection = field(default_factory=RMSection)
    """Reward-model options."""


@dataclass(kw_only=True, slots=True)
class PRMSection:
    """Process-reward-model options."""

    placeholder: str = "ки"
    """The token that closes every step in the input (one token of the tokenizer; Math-Shepherd's default)."""
    reward_tokens: list[str] = field(default_factory=lambda: ["+", "-"])
    """The (good, bad) tokens whose logits at a placeholder score the step; hard labels may be written as
    these strings."""

    def __post_init__(self) -> None:
        if len(self.reward_tokens) != 2 or self.reward_tokens[0] == self.reward_tokens[1]:
            raise invalid("reward_tokens", self.reward_tokens, "two different tokens: good, bad")


@dataclass(kw_only=True, slots=True)
class PRMConfig(OneModelConfig):
    """Process reward model training (per-step labels)."""

    prm: PRMSection = field(default_factory=PRMSection)
    """Process-reward-model options."""


@dataclass(kw_only=True, slots=True)
class DPOSection:
    """DPO options."""

    loss: Literal["dpo", "ipo", "cdpo"] = "dpo"
    """dpo (sigmoid), ipo (squared), cdpo (dpo with label smoothing)."""
    beta: float = 0.1
    """Strength of the KL constraint to the reference (the implicit reward scale)."""
    label_smoothing: float = 0.0
    """cDPO: probability that a preference label is flipped, in (0, 0.5); only with loss cdpo."""
    nll_coef: float = 0.0
    """Weight of an extra NLL term on the chosen response (mean over its tokens); 0 disables."""
    ref_model: str = ""
    """Reference model folder or Hub id; empty: the model being trained, as loaded (its base under LoRA)."""
    ref_mode: Literal["precompute", "on_the_fly"] = "precompute"
    """precompute: reference log-probs once before training, then the reference is freed; on_the_fly: in
    every step (no start-up pass, the reference stays in memory)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if self.beta <= 0:
            raise invalid("beta", self.beta, "a number > 0")
        if self.loss == "cdpo" and not 0 < self.label_smoothing < 0.5:
            raise invalid("label_smoothing", self.label_smoothing, "a number in (0, 0.5) with loss cdpo")
        if self.loss != "cdpo" and self.label_smoothing != 0:
            raise invalid(
                "label_smoothing", self.label_smoothing, "0 unless dpo.loss is cdpo (set --dpo.loss cdpo)"
            )
        if self.nll_coef < 0:
            raise invalid("nll_coef", self.nll_coef, "a number >= 0")


@dataclass(kw_only=True, slots=True)
class DPOConfig(OneModelConfig):
    """Direct preference optimisation on preference pairs."""

    dpo: DPOSection = field(default_factory=DPOSection)
    """DPO options."""


@dataclass(kw_only=True, slots=True)
class KTOSection:
    """KTO options."""

    beta: float = 0.1
    """Implicit reward scale."""
    desirable_weight: float = 1.0
    """lambda_D: weight of desirable samples' losses."""
    undesirable_weight: float = 1.0
    """lambda_U: weight of undesirable samples' losses (the paper keeps lambda_D n_D / (lambda_U n_U) in
    [1, 4/3])."""
    ref_model: str = ""
    """Reference model folder or Hub id; empty: the model being trained, as loaded (its base under LoRA)."""

    def __post_init__(self) -> None:
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            if getattr(self, name) <= 0:
                raise invalid(name, getattr(self, name), "a number > 0")


@dataclass(kw_only=True, slots=True)
class KTOConfig(OneModelConfig):
    """KTO on desirable / undesirable responses."""

    kto: KTOSection = field(default_factory=KTOSection)
    """KTO options."""


@dataclass(kw_only=True, slots=True)
class KDSection:
    """Distillation options."""

    teacher: str = ""
    """Teacher model folder or Hub id (required); it must share the student's tokenizer."""
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    """forward_kl KL(teacher || student), reverse_kl KL(student || teacher), jsd (generalised, kd.jsd_beta)."""
    coef: float = 0.4
    """Weight of the divergence; 1 - coef weighs the student's cross-entropy on the data (OpenRLHF's kd_coef)."""
    temperature: float = 1.0
    """Softmax temperature of both distributions in the divergence."""
    t2_scale: bool = True
    """Multiply the divergence by temperature^2 (Hinton et al. 2015), so its gradient keeps its weight against
    the cross-entropy when the temperature changes; false: the tempered divergence itself."""
    jsd_beta: float = 0.5
    """jsd: weight of the teacher in the mixture m = beta p + (1 - beta) q, in (0, 1)."""
    chunk: int = 1024
    """Tokens per LM-head chunk (peak memory ~ 4 x chunk x vocab floats)."""

    def __post_init__(self) -> None:
        check_choices(self)
        if not 0 <= self.coef <= 1:
            raise invalid("coef", self.coef, "a number in [0, 1]")
        if self.temperature <= 0:
            raise invalid("temperature", self.temperature, "a number > 0")
        if not 0 < self.jsd_beta < 1:
            raise invalid("jsd_beta", self.jsd_beta, "a number in (0, 1)")
        if self.chunk < 1:
            raise invalid("chunk", self.chunk, "an int >= 1")


@dataclass(kw_only=True, slots=True)
class KDConfig(OneModelConfig):
    """Knowledge distillation from a teacher model."""

    kd: KDSection = field(default_factory=KDSection)
    """Distillation options."""
