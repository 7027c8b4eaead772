"""Process reward model loss (Lightman et al. 2023, "Let's Verify Step by Step", arXiv 2305.20050; Math-Shepherd,
Wang et al. 2023, arXiv 2312.08935, for soft labels), in OpenRLHF's form: a causal LM reads a placeholder token
after each step; its logits over two reward tokens (good, bad) at that position give the step's score.

    p_k    = softmax([logit_good, logit_bad])[0]           at step k's placeholder
    loss_k = -(y_k log p_k + (1 - y_k) log (1 - p_k))      y_k = 1 / 0 (hard labels) or in [0, 1] (soft)

Denominator: steps. Metrics (per step, summed by the caller): acc = [(p_k > 1/2) == (y_k > 1/2)], p_good = p_k.
"""

from __future__ import annotations

import torch
from torch import Tensor


def step_loss(good_bad_logits: Tensor, labels: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """good_bad_logits [S, 2] (good first), labels [S] in [0, 1] -> (loss [S], per-step metrics)."""
    if good_bad_logits.shape[-1] != 2 or good_bad_logits.shape[0] != labels.shape[0]:
        raise ValueError(
            f"expected logits [S, 2] and labels [S]; got {tuple(good_bad_logits.shape)} and {tuple(labels.shape)}"
        )
    logp = torch.log_softmax(
        good_bad_logits.to(torch.promote_types(good_bad_logits.dtype, torch.float32)), -1
    )
    y = labels.to(logp.dtype)
    loss = -(y * logp[:, 0] + (1.0 - y) * logp[:, 1])
    p = logp[:, 0].detach().exp()
    return loss, {"acc": ((p > 0.5) == (y > 0.5)).to(loss.dtype), "p_good": p}
