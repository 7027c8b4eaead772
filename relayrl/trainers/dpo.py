"""`relayrl dpo`: direct preference optimisation (DPO, IPO, cDPO) on chosen / rejected pairs, a recipe on the
shared training core.

    DPOConfig(model, data, optim, train, ckpt, logger, dist, dpo)
      -> build_pair_data(data, tokenizer)               relayrl.data.preference: PairSample(chosen, rejected)
      -> pair_batch(...)                                PairBatch: the P chosen then the P rejected sequences
      -> run_recipe(loss_fn=dpo_loss, frozen=reference)  relayrl.trainers.recipe

Log-probs of each side are summed over its response tokens (chosen and rejected of a pair go through one
forward, packed together). The reference model is `dpo.ref_model` (default: the model being trained, as
loaded at the start; under LoRA the base weights). Its log-probs are either computed once before training
(`dpo.ref_mode precompute`, default: one pass over the train and eval pairs, then the reference is freed) or
on the fly in every step (`on_the_fly`: as OpenRLHF; no start-up pass, the reference stays in memory).

Loss per pair: relayrl.algorithms.preference.DPO_LOSSES[dpo.loss](h) + dpo.nll_coef * (mean negative
log-likelihood of the chosen response's tokens), averaged over pairs. Metrics (train/ and eval/): acc
(chosen reward > rejected reward), chosen_reward and rejected_reward (beta log pi / pi_ref), margin, chosen_logp
and rejected_logp (summed over the response), nll.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

from torch import Tensor

from relayrl.algorithms.preference import DPO_LOSSES, dpo_rewards
from relayrl.config.components import TrainConfig
from relayrl.config.recipes import DPOConfig
from relayrl.data.packing import MicroBatching, chunk_by_count
from relayrl.data.preference import build_pair_data
from relayrl.models.forward import to_device
from relayrl.trainers.pairs import PairBatch, pair_batch, side_logps
from relayrl.trainers.recipe import Recipe, RecipeResult, recipe_main, run_recipe
from relayrl.training.step import LossOutput
from relayrl.workers.trained import ModelWorker


def dpo_loss(
    model: Any, batch: PairBatch, *, loss: str, beta: float, label_smoothing: float, nll_coef: float
):
    """The DPO-family loss summed over the micro-batch's pairs; count = pairs (see module doc)."""
    if batch.ref_logps is None:
        raise RuntimeError("dpo_loss: the batch has no reference log-probs (prepare did not run)")
    sums, counts = side_logps(model, batch)
    p = batch.num_pairs
    ref = to_device(batch.ref_logps, sums.device)
    h, chosen_r, rejected_r = dpo_rewards(sums[:p], sums[p:], ref[:p], ref[p:], beta)
    per_pair = DPO_LOSSES[loss](h, beta=beta, label_smoothing=label_smoothing)
    nll = -sums[:p] / counts[:p].clamp(min=1)
    if nll_coef:
        per_pair = per_pair + nll_coef * nll
    metrics: dict[str, float | Tensor] = {
        "acc": (chosen_r > rejected_r).float().sum(),
        "chosen_reward": chosen_r.sum(),
        "rejected_reward": rejected_r.sum(),
        "margin": (chosen_r - rejected_r).sum(),
        "chosen_logp": sums[:p].detach().sum(),
        "rejected_logp": sums[p:].detach().sum(),
        "nll": nll.detach().sum(),
    }
    return LossOutput(loss_sum=per_pair.sum(), count=float(p), metrics=metrics)


def dpo_prepare(models: Any, micro_batches: list[PairBatch], num_real: int) -> None:
    """Reference log-probs of every side, summed over its response (skipped where precomputed)."""
    for mb in micro_batches:
        if mb.ref_logps is None:
            with models.autocast():
                mb.ref_logps = side_logps(models.frozen, mb)[0].float()


def precompute_reference(handle: Any, samples: list[Any], train: TrainConfig, layout: str) -> None:
    """One reference pass over `samples` (pairs), batched like training (the train section's batch size and
    micro-batching): stores ref_logps on each pair; the worker frees the reference afterwards."""
    batching = MicroBatching.of(train, layout)
    groups, batches = [], []
    for chunk in chunk_by_count(len(samples), train.batch_size):
        for g in batching.groups([samples[i].num_tokens for i in chunk]):
            ids = [chunk[j] for j in g]
            groups.append(ids)
            batches.append(pair_batch([samples[i] for i in ids], layout))
    done = handle.call(ModelWorker.precompute, batches) if batches else []
    for ids, mb in zip(groups, done, strict=True):
        ref = mb.ref_logps.tolist()
        for k, i in enumerate(ids):
            samples[i].ref_logps = (ref[k], ref[len(ids) + k])


def dpo_recipe(cfg: DPOConfig) -> Recipe:
    d = cfg.dpo

    def load(tokenizer: Any) -> tuple[list, list]:
        train, evals, _ = build_pair_data(cfg.data, tokenizer)
        return train, evals

    def before_fit(handle: Any, train: list, evals: list, layout: str) -> None:
        if d.ref_mode != "precompute":
            return
        print(
            f"relayrl dpo: reference log-probs of {len(train) + len(evals)} pairs (one pass) ...", flush=True
        )
        precompute_reference(handle, [*train, *evals], cfg.train, layout)

    ref = replace(cfg.model, name_or_path=d.ref_model or cfg.model.name_or_path)  # loaded without adapters
    return Recipe(
        name="dpo",
        cfg=cfg,
        loss_fn=partial(
            dpo_loss, loss=d.loss, beta=d.beta, label_smoothing=d.label_smoothing, nll_coef=d.nll_coef
        ),
        load_data=load,
        to_batch=pair_batch,
        describe=f"{d.loss} (beta {d.beta}, reference {d.ref_mode})",
        frozen=ref,
        prepare=dpo_prepare,
        before_fit=before_fit,
    )


def run_dpo(cfg: DPOConfig) -> RecipeResult:
    """Train per `cfg` (see module doc)."""
    return run_recipe(dpo_recipe(cfg))


def main(argv: list[str] | None = None) -> int:
    """`relayrl dpo [--config run.yaml] [--dotted.flags ...]`."""
    return recipe_main(
        argv,
        "dpo",
        DPOConfig,
        run_dpo,
        [("train/loss", "train loss"), ("train/margin", "margin"), ("eval/acc", "eval acc")],
        __doc__ or "",
    )
