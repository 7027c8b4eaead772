"""Bradley-Terry reward-model loss (Ouyang et al. 2022, "Training language models to follow instructions with
human feedback", arXiv 2203.02155, eq. 1; margin as in Llama 2, arXiv 2307.09288, eq. 2).

    loss_i = -log sigmoid(r_chosen_i - r_rejected_i - m_i)         per pair; denominator: pairs

r is the model's scalar score of the whole sequence (its value head on the last token), m_i the row's margin
(0 without a margin key). Metrics (per-pair values, summed by the caller): acc = [r_chosen > r_rejected],
chosen_reward, rejected_reward, margin = r_chosen - r_rejected.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """chosen, rejected, margin: [P] -> (loss [P], per-pair metrics [P] each, detached)."""
    if chosen.shape != rejected.shape:
        raise ValueError(
            f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} scores differ in shape"
        )
    diff = chosen - rejected
    loss = -F.logsigmoid(diff if margin is None else diff - margin)
    d = diff.detach()
    return loss, {
        "acc": (d > 0).to(loss.dtype),
        "chosen_reward": chosen.detach(),
        "rejected_reward": rejected.detach(),
        "margin": d,
    }
