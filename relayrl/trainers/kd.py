"""`relayrl kd`: knowledge distillation from a teacher model over the whole vocabulary, a recipe on the shared
training core.

    KDConfig(model, data, optim, train, ckpt, logger, dist, kd)
      -> build_sft_data(data, tokenizer, "response")    the SFT data (samples with response masks)
      -> kd_batch(...)                                  relayrl.data.batches.sft_batch + the teacher's hidden
                                                        states (kd_prepare)
      -> run_recipe(loss_fn=kd_loss, frozen=teacher, prepare=kd_prepare)

Per target token t (the response tokens, as SFT): the student's and the teacher's next-token distributions at
t's previous position. loss = (1 - kd.coef) * CE(student, x_t) + kd.coef * D(teacher || student), D one of
relayrl.algorithms.preference.DIVERGENCES (forward_kl, reverse_kl, jsd) at temperature kd.temperature (times
T^2 with kd.t2_scale, the default, as Hinton et al.),
averaged over target tokens. The teacher runs without gradients before each step (its final hidden states
only); both LM heads are applied chunk by chunk inside the loss (chunked_divergence), so no [N, V] float32
logits exist. Teacher and student must share the tokenizer (same vocabulary). Metrics: kd (the divergence),
ce (the student's cross-entropy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from relayrl.algorithms.preference import chunked_divergence
from relayrl.config.base import invalid
from relayrl.config.recipes import KDConfig
from relayrl.data.batches import sft_batch
from relayrl.data.build import build_sft_data
from relayrl.models.forward import forward_hidden, hf_model
from relayrl.trainers.recipe import Recipe, RecipeResult, recipe_main, run_recipe
from relayrl.training.step import LossOutput


@dataclass(kw_only=True, slots=True)
class KDBatch:
    """An SFT micro-batch plus what the teacher gives it."""

    input_ids: list[Tensor]
    """Per sample, [L_i] int64."""
    targets: list[Tensor]
    """Per sample, [L_i] bool: response tokens."""
    teacher_hidden: Tensor | None = None
    """[R, H_t] teacher final hidden states at the R rows that predict a target (filled by kd_prepare)."""
    teacher_head: Tensor | None = None
    """[V, H_t] the teacher's LM-head weight (filled by kd_prepare)."""
    layout: str = "padded"
    num_tokens: int = 0


def kd_batch(samples: list[Any], layout: str) -> KDBatch:
    b = sft_batch(samples, layout)
    return KDBatch(input_ids=b.input_ids, targets=b.targets, layout=layout, num_tokens=b.num_tokens)


def _predicting_rows(batch: KDBatch) -> tuple[Tensor, Tensor]:
    """(flat rows whose next token is a target, those target token ids)."""
    rows, tokens, at = [], [], 0
    for ids, mask in zip(batch.input_ids, batch.targets, strict=True):
        t = torch.nonzero(mask[1:]).flatten()  # t + 1 is a target; row at + t predicts it
        rows.append(at + t)
        tokens.append(ids[1:][t])
        at += len(ids)
    return torch.cat(rows), torch.cat(tokens)


def _head(model: Any) -> Tensor:
    weight = hf_model(model).get_output_embeddings().weight
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


def kd_prepare(models: Any, micro_batches: list[KDBatch], num_real: int) -> None:
    """The teacher's final hidden states at the rows that predict a target, and its LM-head weight."""
    head = None
    for mb in micro_batches:
        rows, _ = _predicting_rows(mb)
        with models.autocast():
            hidden = forward_hidden(models.frozen, mb.input_ids, models.layout)
        if head is None:
            # a copy: a sharded teacher's gathered weight is freed when it reshards after these passes
            head = _head(models.frozen).detach().clone()
        mb.teacher_hidden = hidden[rows.to(hidden.device)]
        mb.teacher_head = head


def kd_loss(
    model: Any,
    batch: KDBatch,
    *,
    divergence: str,
    coef: float,
    temperature: float,
    beta: float,
    chunk: int,
    t2_scale: bool = True,
):
    """(1 - coef) CE + coef D summed over target tokens; count = target tokens (see module doc)."""
    if batch.teacher_hidden is None or batch.teacher_head is None:
        raise RuntimeError("kd_loss: the batch has no teacher outputs (kd_prepare did not run)")
    rows, tokens = _predicting_rows(batch)
    hidden = forward_hidden(model, batch.input_ids, batch.layout)
    h = hidden[rows.to(hidden.device)]
    head = _head(model)
    div, ce = chunked_divergence(
        h,
        head.to(h.dtype) if head.dtype != h.dtype else head,
        batch.teacher_hidden.to(h.device, h.dtype),
        batch.teacher_head.to(h.device, h.dtype),
        tokens.to(h.device),
        divergence=divergence,
        temperature=temperature,
        beta=beta,
        chunk=chunk,
        t2_scale=t2_scale,
    )
    loss = (1.0 - coef) * ce + coef * div
    return LossOutput(
        loss_sum=loss, count=float(len(tokens)), metrics={"kd": div.detach(), "ce": ce.detach()}
    )


def kd_recipe(cfg: KDConfig) -> Recipe:
    k = cfg.kd
    if not k.teacher:
        raise invalid("kd.teacher", k.teacher, "a teacher model folder or Hub id (--kd.teacher PATH)")

    def load(tokenizer: Any) -> tuple[list, list]:
        train, evals, _ = build_sft_data(cfg.data, tokenizer, "response")
        return train, evals

    teacher = replace(cfg.model, name_or_path=k.teacher, tokenizer_name_or_path=None)
    return Recipe(
        name="kd",
        cfg=cfg,
        loss_fn=partial(
            kd_loss,
            divergence=k.divergence,
            coef=k.coef,
            temperature=k.temperature,
            beta=k.jsd_beta,
            chunk=k.chunk,
            t2_scale=k.t2_scale,
        ),
        load_data=load,
        to_batch=kd_batch,
        describe=f"distillation ({k.divergence}, coef {k.coef}) from {k.teacher}",
        frozen=teacher,
        prepare=kd_prepare,
    )


def run_kd(cfg: KDConfig) -> RecipeResult:
    """Train per `cfg` (see module doc)."""
    return run_recipe(kd_recipe(cfg))


def main(argv: list[str] | None = None) -> int:
    """`relayrl kd [--config run.yaml] [--dotted.flags ...]`."""
    return recipe_main(
        argv,
        "kd",
        KDConfig,
        run_kd,
        [("train/loss", "train loss"), ("train/kd", "kd"), ("eval/kd", "eval kd")],
        __doc__ or "",
    )
