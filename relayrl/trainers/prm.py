"""`relayrl prm`: a process reward model, a recipe on the shared training core (OpenRLHF's PRM form).

    PRMConfig(model, data, optim, train, ckpt, logger, dist, prm)
      -> build_step_data(data, tokenizer, placeholder, reward_tokens)   StepSample(input_ids, positions, labels)
      -> step_batch(...)                                                StepBatch
      -> run_recipe(loss_fn=prm_loss)                                   a causal LM, trained at the placeholders

The input holds a placeholder token after each reasoning step (prm.placeholder) and the row one label per
step. At each placeholder the model's logits over the two reward tokens (prm.reward_tokens: good, bad) give
p(good) = softmax([good, bad])[0]; the loss is relayrl.algorithms.preference.step_loss (cross-entropy with
hard or soft labels), averaged over steps. The saved model is a causal LM: to score a solution, put the
placeholder after each step and read p(good) at each placeholder. Metrics: acc (step accuracy), p_good.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from relayrl.agents.rewards.prm import write_prm_file
from relayrl.algorithms.preference import step_loss
from relayrl.config.recipes import PRMConfig
from relayrl.data.preference import build_step_data, single_token
from relayrl.models.forward import forward_hidden, hf_model
from relayrl.models.loading import load_tokenizer
from relayrl.trainers.recipe import Recipe, RecipeResult, recipe_main, run_recipe
from relayrl.training.step import LossOutput


@dataclass(kw_only=True, slots=True)
class StepBatch:
    """One micro-batch of step-labelled samples."""

    input_ids: list[Tensor]
    """Per sample, [L_i] int64."""
    positions: Tensor
    """[S] int64: each step's placeholder row in the flattened micro-batch."""
    labels: Tensor
    """[S] float32 in [0, 1]: probability that the step is good."""
    layout: str = "padded"
    num_tokens: int = 0


def step_batch(samples: list[Any], layout: str) -> StepBatch:
    positions, labels, at = [], [], 0
    for s in samples:
        positions += [at + p for p in s.positions]
        labels += s.labels
        at += len(s.input_ids)
    return StepBatch(
        input_ids=[torch.as_tensor(s.input_ids, dtype=torch.long) for s in samples],
        positions=torch.tensor(positions, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.float32),
        layout=layout,
        num_tokens=at,
    )


def prm_loss(model: Any, batch: StepBatch, *, good: int, bad: int) -> LossOutput:
    """Step cross-entropy summed over the micro-batch's steps; count = steps."""
    hidden = forward_hidden(model, batch.input_ids, batch.layout)
    h = hidden[batch.positions.to(hidden.device)]
    head = hf_model(model).get_output_embeddings()
    logits = head(h)[:, [good, bad]]
    loss, m = step_loss(logits, batch.labels.to(logits.device))
    return LossOutput(loss_sum=loss.sum(), count=float(len(loss)), metrics={k: v.sum() for k, v in m.items()})


def prm_recipe(cfg: PRMConfig, tokenizer: Any = None) -> Recipe:
    p = cfg.prm
    m = cfg.model
    tok = tokenizer or load_tokenizer(
        m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
    )
    good = single_token(tok, p.reward_tokens[0], "prm.reward_tokens[0]")
    bad = single_token(tok, p.reward_tokens[1], "prm.reward_tokens[1]")

    def load(tokenizer: Any) -> tuple[list, list]:
        train, evals, _ = build_step_data(
            cfg.data,
            tokenizer,
            placeholder=p.placeholder,
            reward_tokens=(p.reward_tokens[0], p.reward_tokens[1]),
        )
        return train, evals

    def after_fit(handle: Any, result: RecipeResult) -> None:
        assert result.final_model is not None  # after_fit runs after the export only
        write_prm_file(result.final_model, p.placeholder, (p.reward_tokens[0], p.reward_tokens[1]))

    return Recipe(
        name="prm",
        cfg=cfg,
        loss_fn=partial(prm_loss, good=good, bad=bad),
        load_data=load,
        to_batch=step_batch,
        after_fit=after_fit,
        describe=f"process reward model (placeholder {p.placeholder!r}, reward tokens {p.reward_tokens})",
    )


def run_prm(cfg: PRMConfig) -> RecipeResult:
    """Train per `cfg` (see module doc)."""
    return run_recipe(prm_recipe(cfg))


def main(argv: list[str] | None = None) -> int:
    """`relayrl prm [--config run.yaml] [--dotted.flags ...]`."""
    return recipe_main(
        argv,
        "prm",
        PRMConfig,
        run_prm,
        [("train/loss", "train loss"), ("train/acc", "step acc"), ("eval/acc", "eval step acc")],
        __doc__ or "",
    )
