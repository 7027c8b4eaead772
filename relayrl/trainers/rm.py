"""`relayrl rm`: a Bradley-Terry reward model on chosen / rejected pairs, a recipe on the shared training core.

    RMConfig(model, data, optim, train, ckpt, logger, dist, rm)
      -> build_pair_data(data, tokenizer, margin_key)     relayrl.data.preference: PairSample(chosen, rejected)
      -> pair_batch(...)                                  PairBatch: the P chosen then the P rejected sequences
      -> run_recipe(loss_fn=rm_loss, head="value")        relayrl.trainers.recipe

The model is the causal LM's trunk plus a new value head `score` (hidden -> 1, N(0, 1/(H+1)) as OpenRLHF),
saved as AutoModelForSequenceClassification (relayrl.models.value_head). A sequence's reward is the head at
its last token (the response's EOS). Loss: relayrl.algorithms.preference.bradley_terry, averaged over pairs.
Metrics (train/ and eval/): acc, chosen_reward, rejected_reward, margin.

After training, the rewards of every training sequence (both sides) give reward_mean / reward_std, written
into final/ (config.json and reward_stats.json): `relayrl rl --reward.source rm:<run>/final --reward.normalize true` normalises rewards
with them. The folder works with `relayrl serve-rm` and anything that loads a sequence-classification model.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from relayrl.algorithms.preference import bradley_terry
from relayrl.config.recipes import RMConfig
from relayrl.data.packing import chunk_by_count, make_collate
from relayrl.data.preference import build_pair_data
from relayrl.models.forward import to_device, token_values
from relayrl.models.value_head import write_reward_stats
from relayrl.trainers.pairs import PairBatch, last_token, pair_batch
from relayrl.trainers.recipe import Recipe, RecipeResult, recipe_main, run_recipe
from relayrl.training.step import LossOutput
from relayrl.workers.trained import ModelWorker


def _scores(model: Any, batch: PairBatch) -> Tensor:
    return last_token(token_values(model, batch.input_ids, batch.layout), batch.input_ids)


def rm_loss(model: Any, batch: PairBatch) -> LossOutput:
    """Bradley-Terry loss summed over the micro-batch's pairs; count = pairs."""
    scores = _scores(model, batch)
    p = batch.num_pairs
    loss, metrics = bradley_terry(scores[:p], scores[p:], to_device(batch.margins, scores.device))
    return LossOutput(loss_sum=loss.sum(), count=float(p), metrics={k: v.sum() for k, v in metrics.items()})


def rm_scores(models: Any, batch: PairBatch) -> list[float]:
    """Rewards of the batch's 2P sequences (no gradient; for the statistics)."""
    with models.autocast():
        return _scores(models.model, batch).float().cpu().tolist()


def write_stats(handle: Any, result: RecipeResult, cfg: RMConfig) -> tuple[float, float]:
    """Mean / std of the trained model's rewards over every training sequence, into final/ (config.json and reward_stats.json)."""
    pairs = result.train_samples or []
    collate = make_collate(pairs, cfg.train, result.layout, pair_batch)
    batches = [mb for chunk in chunk_by_count(len(pairs), cfg.train.batch_size) for mb in collate(chunk)]
    scores = [s for part in handle.call(ModelWorker.infer, rm_scores, batches) for s in part]
    mean = sum(scores) / len(scores)
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / len(scores))
    assert result.final_model is not None  # after_fit runs after the export only
    write_reward_stats(result.final_model, mean, max(std, 1e-6))
    print(
        f"relayrl rm: reward mean {mean:.4f}, std {std:.4f} over {len(scores)} training sequences (final/reward_stats.json)"
    )
    return mean, std


def rm_recipe(cfg: RMConfig) -> Recipe:
    def load(tokenizer: Any) -> tuple[list, list]:
        train, evals, _ = build_pair_data(cfg.data, tokenizer, margin_key=cfg.rm.margin_key)
        return train, evals

    def after_fit(handle: Any, result: RecipeResult) -> None:
        write_stats(handle, result, cfg)

    return Recipe(
        name="rm",
        cfg=cfg,
        loss_fn=rm_loss,
        load_data=load,
        to_batch=pair_batch,
        describe="Bradley-Terry reward model",
        head="value",
        after_fit=after_fit,
    )


def run_rm(cfg: RMConfig) -> RecipeResult:
    """Train a reward model per `cfg`; the final folder carries reward_mean / reward_std."""
    return run_recipe(rm_recipe(cfg))


def main(argv: list[str] | None = None) -> int:
    """`relayrl rm [--config run.yaml] [--dotted.flags ...]`."""
    return recipe_main(
        argv,
        "rm",
        RMConfig,
        run_rm,
        [("train/loss", "train loss"), ("train/acc", "acc"), ("eval/acc", "eval acc")],
        __doc__ or "",
    )
