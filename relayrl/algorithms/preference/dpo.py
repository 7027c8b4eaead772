"""Direct preference losses on the log-ratio margin of a pair.

    h_i = (log pi(y_c|x) - log pi_ref(y_c|x)) - (log pi(y_r|x) - log pi_ref(y_r|x))     log-probs summed
                                                                                       over response tokens
    dpo   loss_i = -log sigmoid(beta h_i)                       Rafailov et al. 2023, arXiv 2305.18290, eq. 7
    cdpo  loss_i = -(1 - eps) log sigmoid(beta h_i) - eps log sigmoid(-beta h_i)
                   (conservative DPO: labels flipped with probability eps = label_smoothing; Mitchell 2023,
                   "A note on DPO with noisy preferences")
    ipo   loss_i = (h_i - 1 / (2 beta))^2                       Azar et al. 2023, arXiv 2310.12036, eq. 17,
                   with sequence log-likelihoods (sums), as the paper's formula and OpenRLHF; TRL averages
                   over tokens instead

Denominator: pairs. `dpo_rewards` gives the implicit rewards beta (log pi - log pi_ref) of both sides for the
metrics (chosen_reward, rejected_reward, acc = [chosen_reward > rejected_reward], margin).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor


def dpo(h: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """Sigmoid DPO (cDPO when label_smoothing > 0): [P] -> [P]."""
    z = beta * h
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def ipo(h: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """IPO: [P] -> [P] (label_smoothing does not apply)."""
    return (h - 1.0 / (2.0 * beta)) ** 2


DPO_LOSSES: dict[str, Callable[..., Tensor]] = {"dpo": dpo, "cdpo": dpo, "ipo": ipo}
"""name -> loss(h, beta=, label_smoothing=); cdpo is dpo with label_smoothing > 0 (checked by the config)."""


def dpo_rewards(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, beta: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(h [P], chosen_reward [P], rejected_reward [P]); the rewards are detached."""
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    return chosen_ratio - rejected_ratio, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
