"""`relayrl sft`: supervised fine-tuning, a recipe on the shared training core (relayrl/training).

    SFTConfig(model, data, optim, train, ckpt, logger, mode)
      -> build_sft_data(data, tokenizer, mode)        relayrl.data.build: TokenizedSample(input_ids, loss_mask)
      -> make_sft_collate(...)                        step indices -> micro-batches (relayrl.data.batches.SFTBatch:
                                                      token ids + target masks, grouped by relayrl.data.packing)
      -> Trainer(TrainStep(loss_fn=next_token_loss), ResumableSampler, CheckpointManager, MetricsLogger).fit()
         (the parts built from the component configs by training/setup.py, shared with RM / DPO / KTO)

Forward passes go through relayrl.models.forward: on a GPU the micro-batch's samples are packed into one
row and attention runs per sample with variable-length (cu_seqlens) kernels; on a CPU they run as
length-bucketed, right-padded rows with plain causal attention (no dense mask in either case). Log-probs
come from the chunked LM-head path (no [N, V] fp32 logits).

Modes (masks are built by the data layer): response (loss on the response only, default), multiturn (loss on
every assistant turn), pretrain (every token). The loss is token-level cross-entropy summed over the target
tokens of the whole optimizer step divided by their count (training/step.py), so micro-batch size and the
layout do not change the update.

Run folder (train.output_dir, default runs/sft): config.yaml (fully resolved), metrics.jsonl,
tensorboard/ (when asked), checkpoints/step_<N>/ (model/ is an HF folder), checkpoints/latest.

Programmatic use (the demo): `result = run_sft(cfg)`; `result.model`, `result.metrics`, `result.run_dir`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from relayrl.config.components import TrainConfig
from relayrl.config.recipes import SFTConfig
from relayrl.data.batches import SFTBatch, sft_batch
from relayrl.data.build import build_sft_data
from relayrl.data.packing import MicroBatching, make_collate
from relayrl.models.forward import to_device, token_logprobs
from relayrl.models.moe import moe_pass
from relayrl.models.vlm import images_for
from relayrl.trainers.recipe import Recipe, RecipeResult, recipe_main, run_recipe
from relayrl.training.step import LossOutput

SFTResult = RecipeResult
"""What `run_sft` returns."""


# ---------------------------------------------------------------------------------------------- loss
def next_token_loss(model: torch.nn.Module, batch: SFTBatch, aux_loss_coef: float = 0.0) -> LossOutput:
    """Summed token cross-entropy: loss_sum = sum over target tokens t of -log p(x_t | x_<t of the same
    sample); count = number of target tokens. A mixture-of-experts model with `aux_loss_coef` > 0 adds
    aux_loss_coef * (router load-balancing loss of the micro-batch, relayrl/models/moe.py) * count, so the step
    averages it over micro-batches by their token counts (metric aux_loss)."""
    with (
        images_for(batch.images),
        moe_pass([len(s) for s in batch.input_ids], collect=aux_loss_coef > 0) as moe,
    ):
        logp, _ = token_logprobs(model, batch.input_ids, batch.layout)
    mask = torch.cat(batch.targets)
    mask[to_device(torch.tensor(_first_positions(batch.input_ids)), mask.device)] = False
    mask = to_device(mask, logp.device)
    loss_sum = -torch.where(mask, logp, 0.0).sum()
    count = mask.sum().float()
    aux = moe.aux_loss() if aux_loss_coef > 0 else None
    if aux is None:
        return LossOutput(loss_sum=loss_sum, count=count)
    return LossOutput(
        loss_sum=loss_sum + aux_loss_coef * aux * count,
        count=count,
        metrics={"aux_loss": aux.detach() * count},
    )


def _first_positions(seqs: Sequence[torch.Tensor]) -> list[int]:
    starts, at = [], 0
    for s in seqs:
        starts.append(at)
        at += len(s)
    return starts


# ---------------------------------------------------------------------------------------------- batching
def sft_micro_batches(
    samples: Sequence[Any],
    *,
    layout: str,
    packing: bool,
    micro_batch_size: int = 1,
    max_tokens_per_micro_batch: int = 0,
) -> list[SFTBatch]:
    """One optimizer step's samples -> micro-batches, grouped by relayrl.data.packing.MicroBatching."""
    batching = MicroBatching(
        layout=layout,
        packing=packing,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens_per_micro_batch,
    )
    groups = batching.groups([len(s.input_ids) for s in samples])
    return [sft_batch([samples[i] for i in g], layout) for g in groups]


def make_sft_collate(samples: Sequence[Any], cfg: TrainConfig, layout: str) -> Callable[[list[int]], list]:
    """indices -> micro-batches, per the train config (packing, micro_batch_size, token budget)."""
    return make_collate(samples, cfg, layout, sft_batch, size=lambda s: len(s.input_ids))


# ---------------------------------------------------------------------------------------------- run
def sft_recipe(cfg: SFTConfig) -> Recipe:
    """The SFT recipe: response / multiturn / pretrain token cross-entropy on tokenized samples."""

    def load(tokenizer: Any) -> tuple[list, list]:
        train, evals, _ = build_sft_data(cfg.data, tokenizer, cfg.mode)
        return train, evals

    return Recipe(
        name="sft",
        cfg=cfg,
        loss_fn=functools.partial(next_token_loss, aux_loss_coef=cfg.aux_loss_coef),
        load_data=load,
        to_batch=sft_batch,
        describe=f"{cfg.mode} loss",
    )


def run_sft(cfg: SFTConfig) -> SFTResult:
    """Train per `cfg` (relayrl.trainers.recipe.run_recipe: one process or N Ray ranks, same loop); writes the
    run folder; returns the model, metrics and paths."""
    return run_recipe(sft_recipe(cfg))


def main(argv: list[str] | None = None) -> int:
    """`relayrl sft [--config run.yaml] [--dotted.flags ...]`."""
    return recipe_main(
        argv,
        "sft",
        SFTConfig,
        run_sft,
        [("train/loss", "train loss"), ("eval/loss", "eval loss")],
        __doc__ or "",
    )
