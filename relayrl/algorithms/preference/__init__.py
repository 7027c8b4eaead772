"""Losses of the preference / reward-model / distillation trainers: pure functions of tensors, one file per
family, each naming its paper and formula. The trainers (relayrl/trainers/) compute the log-probs, scores and
logits from the model and sum these per-unit losses; the unit (pair, sample, step, token) is the loss's
normalising denominator.

    bradley_terry(chosen, rejected, margin)              reward model (pairs)        bradley_terry.py
    DPO_LOSSES[name](h, beta=, label_smoothing=)         dpo / ipo / cdpo (pairs)    dpo.py
    kto(...), kto_reference_point(...)                   KTO (samples)               kto.py
    DIVERGENCES[name](student_logits, teacher_logits)    KD per token                distill.py
    chunked_divergence(...)                              KD without [N, V] logits    distill.py
    step_loss(good_bad_logits, labels)                   process reward model        process.py
"""

from relayrl.algorithms.preference.bradley_terry import bradley_terry
from relayrl.algorithms.preference.distill import DIVERGENCES, chunked_divergence
from relayrl.algorithms.preference.dpo import DPO_LOSSES, dpo_rewards
from relayrl.algorithms.preference.kto import kto, kto_reference_point
from relayrl.algorithms.preference.process import step_loss

__all__ = [
    "DIVERGENCES",
    "DPO_LOSSES",
    "bradley_terry",
    "chunked_divergence",
    "dpo_rewards",
    "kto",
    "kto_reference_point",
    "step_loss",
]
