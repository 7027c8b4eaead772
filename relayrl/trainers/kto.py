"""`relayrl kto`: Kahneman-Tversky optimisation on desirable / undesirable responses (unpaired feedback), a
recipe on the shared training core.

    KTOConfig(model, data, optim, train, ckpt, logger, dist, kto)
      -> build_unpaired_data(data, tokenizer)     relayrl.data.preference: UnpairedSample(sample, desirable)
      -> kto_collate(...)                         per step: each sample k also gets a KL sequence, its prompt
                                                  with the response of another prompt's sample (kl_partners)
      -> run_recipe(loss_fn=kto_loss, frozen=reference, prepare=kto_prepare)

`kto_prepare` runs before each step without gradients: the reference log-probs of every sample, and the KL
reference point z0 = max(0, mean over the whole step's KL sequences, on every rank, of log pi - log pi_ref)
(relayrl.algorithms.preference.kto). The loss is relayrl.algorithms.preference.kto averaged over samples.
Metrics (train/ and eval/): reward_desirable / reward_undesirable (beta log pi / pi_ref, each over its own
samples; left out of a step with no sample of that side, never a made-up 0), kl (z0).

KL pairing (`kl_partners`): sample k of a step of n takes the response of the first sample j, going round from
k + n // 2 (half the step away), whose prompt differs from k's. Half the step away keeps a prompt's rows that
sit next to each other (an unshuffled eval set, a paired dataset split into desirable and undesirable rows)
from pairing with each other; the prompt check covers the rest. A sample with no other prompt in its step (a
one-sample step, a step of one prompt's responses) has no KL sequence: it is left out of z0, and a step in
which no sample has one uses z0 = 0 (the reference point of a policy equal to its reference).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from relayrl.algorithms.preference import kto, kto_reference_point
from relayrl.config.components import TrainConfig
from relayrl.config.recipes import KTOConfig
from relayrl.data.packing import MicroBatching
from relayrl.data.preference import UnpairedSample, build_unpaired_data
from relayrl.models.forward import to_device
from relayrl.trainers.pairs import side_logps
from relayrl.trainers.recipe import Recipe, RecipeResult, recipe_main, run_recipe
from relayrl.training.step import LossOutput


@dataclass(kw_only=True, slots=True)
class KTOBatch:
    """One micro-batch of N samples and their N KL sequences."""

    input_ids: list[Tensor]
    """2N sequences [L_i] int64: the N samples, then their N KL sequences (prompt k + another response)."""
    targets: list[Tensor]
    """2N [L_i] bool: response tokens."""
    desirable: Tensor
    """[N] bool."""
    kl_valid: Tensor | None = None
    """[N] bool: the sample's KL sequence pairs it with another prompt's response (False: a placeholder, its own
    sequence, left out of z0). None: all True."""
    ref_logps: Tensor | None = None
    """[N] float32 reference log-probs of the samples' responses (filled by kto_prepare)."""
    z0: float | None = None
    """The step's KL reference point (filled by kto_prepare)."""
    layout: str = "padded"
    num_tokens: int = 0
    """Real tokens of the N samples (the KL sequences are extra forwards without gradient)."""

    @property
    def num_samples(self) -> int:
        return len(self.input_ids) // 2


def _prompt_len(mask: Sequence[bool]) -> int:
    return next((i for i, t in enumerate(mask) if t), len(mask))


def kl_sequence(prompt_of: Any, response_of: Any) -> tuple[list[int], list[bool]]:
    """prompt of one sample + response of another (token ids, response mask)."""
    a = _prompt_len(prompt_of.loss_mask)
    b = _prompt_len(response_of.loss_mask)
    ids = list(prompt_of.input_ids[:a]) + list(response_of.input_ids[b:])
    return ids, [False] * a + [True] * (len(ids) - a)


def prompt_ids(sample: Any) -> tuple[int, ...]:
    """The prompt tokens of a sample (before its first response token)."""
    return tuple(sample.input_ids[: _prompt_len(sample.loss_mask)])


def kl_partners(prompts: Sequence[Any]) -> list[int | None]:
    """For each sample of a step, the sample whose response makes its KL sequence: the first j, going round from
    k + n // 2, with another prompt; None when every other sample shares k's prompt (see module doc)."""
    n = len(prompts)
    out: list[int | None] = []
    for k in range(n):
        order = ((k + n // 2 + i) % n for i in range(n))
        out.append(next((j for j in order if j != k and prompts[j] != prompts[k]), None))
    return out


def kto_collate(
    samples: Sequence[UnpairedSample], train: TrainConfig, layout: str
) -> Callable[[list[int]], list[Any]]:
    """step indices -> KTOBatches; sample k's KL sequence uses the response of sample `kl_partners(...)[k]`."""
    batching = MicroBatching.of(train, layout)

    def collate(indices: list[int]) -> list[KTOBatch]:
        step = [samples[i] for i in indices]
        partners = kl_partners([prompt_ids(u.sample) for u in step])
        kl = [kl_sequence(step[k].sample, step[k if j is None else j].sample) for k, j in enumerate(partners)]
        out = []
        for g in batching.groups([s.num_tokens for s in step]):
            seqs = [step[k].sample.input_ids for k in g] + [kl[k][0] for k in g]
            masks = [step[k].sample.loss_mask for k in g] + [kl[k][1] for k in g]
            out.append(
                KTOBatch(
                    input_ids=[torch.as_tensor(s, dtype=torch.long) for s in seqs],
                    targets=[torch.as_tensor(m, dtype=torch.bool) for m in masks],
                    desirable=torch.tensor([step[k].desirable for k in g], dtype=torch.bool),
                    kl_valid=torch.tensor([partners[k] is not None for k in g], dtype=torch.bool),
                    layout=layout,
                    num_tokens=sum(step[k].num_tokens for k in g),
                )
            )
        return out

    return collate


def _matched(batch: KTOBatch) -> KTOBatch:
    n = batch.num_samples
    return replace(batch, input_ids=batch.input_ids[:n], targets=batch.targets[:n])


def _mismatched(batch: KTOBatch) -> KTOBatch:
    n = batch.num_samples
    return replace(batch, input_ids=batch.input_ids[n:], targets=batch.targets[n:])


def kto_prepare(models: Any, micro_batches: list[KTOBatch], num_real: int) -> None:
    """Reference log-probs of the samples and the step's KL reference point z0 (over every rank)."""
    total = torch.zeros(2, dtype=torch.float64)
    for i, mb in enumerate(micro_batches):
        with models.autocast():
            mb.ref_logps = side_logps(models.frozen, _matched(mb))[0].float()
            kl_pol = side_logps(models.model, _mismatched(mb))[0].double().cpu()
            kl_ref = side_logps(models.frozen, _mismatched(mb))[0].double().cpu()
        if i < num_real:
            valid = mb.kl_valid if mb.kl_valid is not None else torch.ones(len(kl_pol), dtype=torch.bool)
            total += torch.stack([(kl_pol - kl_ref)[valid].sum(), valid.sum().to(torch.float64)])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    z0 = float(kto_reference_point(total[0], total[1]))
    for mb in micro_batches:
        mb.z0 = z0


def kto_loss(model: Any, batch: KTOBatch, *, beta: float, desirable_weight: float, undesirable_weight: float):
    """KTO summed over the micro-batch's samples; count = samples (see module doc)."""
    if batch.ref_logps is None or batch.z0 is None:
        raise RuntimeError("kto_loss: the batch has no reference log-probs / z0 (kto_prepare did not run)")
    sums, _ = side_logps(model, _matched(batch))
    good = to_device(batch.desirable, sums.device)
    loss, m = kto(
        sums,
        to_device(batch.ref_logps, sums.device),
        good,
        batch.z0,
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
    )
    n_good = good.sum().float()
    metrics: dict[str, float | Tensor] = {
        "reward_desirable": torch.where(good, m["reward"], 0.0).sum(),
        "reward_undesirable": torch.where(good, 0.0, m["reward"]).sum(),
        "kl": torch.tensor(batch.z0 * len(sums), dtype=torch.float64),
    }
    counts: dict[str, float | Tensor] = {"reward_desirable": n_good, "reward_undesirable": len(sums) - n_good}
    return LossOutput(loss_sum=loss.sum(), count=float(len(sums)), metrics=metrics, metric_counts=counts)


def kto_recipe(cfg: KTOConfig) -> Recipe:
    k = cfg.kto

    def load(tokenizer: Any) -> tuple[list, list]:
        train, evals, _ = build_unpaired_data(cfg.data, tokenizer)
        good = sum(u.desirable for u in train)
        print(f"relayrl kto: {good} desirable, {len(train) - good} undesirable training samples")
        return train, evals

    return Recipe(
        name="kto",
        cfg=cfg,
        loss_fn=partial(
            kto_loss,
            beta=k.beta,
            desirable_weight=k.desirable_weight,
            undesirable_weight=k.undesirable_weight,
        ),
        load_data=load,
        to_batch=lambda s, layout: None,  # unused: kto_collate builds whole steps
        collate=kto_collate,
        describe=f"kto (beta {k.beta})",
        frozen=replace(cfg.model, name_or_path=k.ref_model or cfg.model.name_or_path),
        prepare=kto_prepare,
    )


def run_kto(cfg: KTOConfig) -> RecipeResult:
    """Train per `cfg` (see module doc)."""
    return run_recipe(kto_recipe(cfg))


def main(argv: list[str] | None = None) -> int:
    """`relayrl kto [--config run.yaml] [--dotted.flags ...]`."""
    return recipe_main(
        argv,
        "kto",
        KTOConfig,
        run_kto,
        [("train/loss", "train loss"), ("train/kl", "kl"), ("eval/loss", "eval loss")],
        __doc__ or "",
    )
