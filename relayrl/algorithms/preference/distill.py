"""Knowledge-distillation divergences between a teacher's and a student's next-token distributions, per token,
over the whole vocabulary (Hinton et al. 2015, arXiv 1503.02531; reverse KL as in MiniLLM, Gu et al. 2023,
arXiv 2306.08543; generalised JSD as in GKD, Agarwal et al. 2023, arXiv 2306.13649).

    p = softmax(teacher_logits / T), q = softmax(student_logits / T)     per token
    forward_kl   KL(p || q) = sum_v p_v (log p_v - log q_v)
    reverse_kl   KL(q || p) = sum_v q_v (log q_v - log p_v)
    jsd          beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q   (beta = 0.5: the JSD)

Vocabulary entries that either model gives a -inf logit (a masked entry: padding rows of the vocabulary, a
constrained decoder) are left out of the sum, as OpenRLHF's KD loss masks them: with the mask shared by both
models that is the exact divergence (0 log 0 = 0); without it, 0 x -inf would make the whole row NaN.

Temperature: `chunked_divergence(..., t2_scale=True)` multiplies the divergence by T^2 (Hinton et al. 2015,
section 2: the soft targets' gradients scale as 1 / T^2, so T^2 keeps their weight against the cross-entropy
term when T changes); t2_scale=False gives the divergence of the tempered distributions itself. T = 1: no
difference.

Denominator: target tokens. OpenRLHF's KD loss is the cross-entropy -sum_v p_v log q_v, which is forward_kl
plus the teacher's entropy (a constant): the same gradient, a different value; relayrl reports the KL itself.

`chunked_divergence` runs the two LM heads chunk by chunk (recomputing each chunk in the backward pass), so
no [N, V] float32 logits tensor exists at once: peak extra memory ~ 4 chunk x V floats.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def _log_probs(student: Tensor, teacher: Tensor) -> tuple[Tensor, Tensor]:
    """(log q_student, log p_teacher) [C, V], both 0 where either logit is -inf (left out of every sum: the
    terms there become p (0 - 0) = 0, with finite gradients)."""
    masked = torch.isinf(student) | torch.isinf(teacher)
    lq, lp = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    return lq.masked_fill(masked, 0.0), lp.masked_fill(masked, 0.0)


def forward_kl(student: Tensor, teacher: Tensor, *, beta: float = 0.5) -> Tensor:
    """KL(p_teacher || q_student) per row: [C, V] logits -> [C]."""
    lq, lp = _log_probs(student, teacher)
    return (lp.exp() * (lp - lq)).sum(-1)


def reverse_kl(student: Tensor, teacher: Tensor, *, beta: float = 0.5) -> Tensor:
    """KL(q_student || p_teacher) per row: [C, V] logits -> [C]."""
    lq, lp = _log_probs(student, teacher)
    return (lq.exp() * (lq - lp)).sum(-1)


def jsd(student: Tensor, teacher: Tensor, *, beta: float = 0.5) -> Tensor:
    """Generalised Jensen-Shannon divergence per row (see module doc): [C, V] logits -> [C]."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}")
    lq, lp = _log_probs(student, teacher)
    lm = torch.logsumexp(torch.stack([lp + math.log(beta), lq + math.log(1.0 - beta)]), 0)
    return beta * (lp.exp() * (lp - lm)).sum(-1) + (1.0 - beta) * (lq.exp() * (lq - lm)).sum(-1)


DIVERGENCES: dict[str, Callable[..., Tensor]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": jsd,
}


def _chunk_terms(
    hs: Tensor,
    ws: Tensor,
    ht: Tensor,
    wt: Tensor,
    targets: Tensor,
    divergence: Callable[..., Tensor],
    temperature: float,
    beta: float,
    scale: float,
) -> tuple[Tensor, Tensor]:
    acc = torch.promote_types(hs.dtype, torch.float32)  # bf16 -> fp32, fp64 stays
    student = (hs @ ws.T).to(acc)
    with torch.no_grad():
        teacher = (ht @ wt.T).to(acc)
    div = divergence(student / temperature, teacher / temperature, beta=beta).sum() * scale
    ce = -torch.log_softmax(student, -1).gather(-1, targets[:, None]).sum()
    return div, ce


def chunked_divergence(
    student_hidden: Tensor,
    student_head: Tensor,
    teacher_hidden: Tensor,
    teacher_head: Tensor,
    targets: Tensor,
    *,
    divergence: str = "forward_kl",
    temperature: float = 1.0,
    beta: float = 0.5,
    chunk: int = 1024,
    t2_scale: bool = False,
) -> tuple[Tensor, Tensor]:
    """(sum over rows of the divergence, sum over rows of the student's cross-entropy on `targets`).

    student_hidden [N, H] (differentiable), student_head [V, H]; teacher_hidden [N, H_t], teacher_head [V, H_t]
    (no gradient); targets [N] token ids (the next token of each row). Rows are processed `chunk` at a time
    under activation checkpointing. `t2_scale`: multiply the divergence by temperature^2 (see module doc)."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {sorted(DIVERGENCES)}, got {divergence!r}")
    if student_head.shape[0] != teacher_head.shape[0]:
        raise ValueError(
            f"the student's vocabulary ({student_head.shape[0]}) and the teacher's ({teacher_head.shape[0]}) "
            "differ: distillation over the vocabulary needs one tokenizer for both"
        )
    fn = DIVERGENCES[divergence]
    acc = torch.promote_types(student_hidden.dtype, torch.float32)
    div = student_hidden.new_zeros((), dtype=acc)
    ce = student_hidden.new_zeros((), dtype=acc)
    for s in range(0, student_hidden.shape[0], chunk):
        e = s + chunk
        d, c = checkpoint(
            _chunk_terms,
            student_hidden[s:e],
            student_head,
            teacher_hidden[s:e],
            teacher_head,
            targets[s:e],
            fn,
            temperature,
            beta,
            temperature**2 if t2_scale else 1.0,
            use_reentrant=False,
        )
        div, ce = div + d, ce + c
    return div, ce
