"""RM, DPO, KTO, KD and PRM losses on the tiny model (CPU, padded layout).

Invariance: one optimizer step's gradient, that of sum(loss_sum) / sum(count) over the step, does not depend
on how the step's samples are split into micro-batches (one, one sample each, packed by a token budget).
References: each loss against a direct Hugging Face forward; DPO at policy == reference (h = 0: ln 2 per
pair and the closed-form gradient); KD with teacher == student (divergence 0); DPO precomputed == on the fly.

The models are float64, so the split is checked to 1e-12 (gradients relative to their largest entry; observed
~1e-15). Three losses cast to float32 inside (the RM's `token_values(...).float()`, `chunked_divergence`,
`step_loss`): their micro-batch loss sums are float32, so the step loss of different splits agrees to float32
rounding only (F32_LOSS); their gradients still agree to 1e-12 (the float32 values are the same in every split).
"""

from __future__ import annotations

import contextlib
import copy
import math
from functools import partial

import pytest
import torch

from relayrl.config import DataConfig
from relayrl.config.components import ModelConfig, TrainConfig
from relayrl.data.batches import sft_batch
from relayrl.data.packing import make_collate
from relayrl.data.preference import StepSample, UnpairedSample, tokenize_pair
from relayrl.data.records import RawRow
from relayrl.data.templates import encode, tokenize_sft
from relayrl.models.tiny import TinyModelSpec, build_tiny_model
from relayrl.tasks.preference import PLACEHOLDER, pair_rows, step_rows, unpaired_rows
from relayrl.trainers.dpo import dpo_loss, dpo_prepare, precompute_reference
from relayrl.trainers.kd import kd_batch, kd_loss, kd_prepare
from relayrl.trainers.kto import kl_partners, kl_sequence, kto_collate, kto_loss, kto_prepare, prompt_ids
from relayrl.trainers.pairs import pair_batch, side_logps
from relayrl.trainers.prm import prm_loss, step_batch
from relayrl.trainers.rm import rm_loss
from relayrl.trainers.sft import next_token_loss
from relayrl.training.step import TrainStep
from relayrl.workers.trained import Models, ModelWorker

LAYOUT = "padded"
N = 4  # samples (pairs) per optimizer step
TOL = 1e-12  # gradients: relative to the largest entry; losses: relative
F32_LOSS = 1e-6  # step loss where the loss sums are float32 (observed <= 9e-8)


def tiny(tok, seed):
    spec = TinyModelSpec(hidden=32, layers=2, heads=4, kv_heads=2, seed=seed)
    return build_tiny_model(tok, spec).double()


def frozen_copy(model):
    return copy.deepcopy(model).eval().requires_grad_(False)


def vary(rows):
    """Prompts of different lengths, so that padded micro-batches hold real padding."""
    return [{**r, "input": "add " * (i % 3) + r["input"]} for i, r in enumerate(rows)]


def raw(data, i=1):
    return RawRow(data=data, source="t.jsonl", file="t.jsonl", row=i)


def groupings(n, budget):
    """TrainConfigs that split an n-sample step differently: one micro-batch, one sample each, and packing by
    a token budget (padded layout: length-sorted bins, so the samples are also reordered)."""
    return {
        "one": TrainConfig(micro_batch_size=n, batch_size=n),
        "mbs1": TrainConfig(micro_batch_size=1, batch_size=n),
        "budget": TrainConfig(batch_size=n, packing=True, max_tokens_per_micro_batch=budget),
    }


class Capture(torch.optim.Optimizer):
    """Records the normalised gradients TrainStep hands to the optimizer; changes nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.grads = None

    def step(self, closure=None):
        self.grads = [
            torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
            for g in self.param_groups
            for p in g["params"]
        ]


def models_of(model, frozen):
    return Models(model=model, frozen=frozen, layout=LAYOUT, autocast=contextlib.nullcontext)


def one_step(model, micro_batches, loss_fn, *, prepare=None, frozen=None):
    """(StepOutput, gradients of sum(loss_sum) / sum(count)) of one TrainStep over `micro_batches`, after
    `prepare` ran over them without gradients (as ModelWorker.step does)."""
    if prepare is not None:
        with torch.no_grad():
            prepare(models_of(model, frozen), micro_batches, len(micro_batches))
    opt = Capture(model.parameters())
    engine = TrainStep(model=model, optimizer=opt, grad_clip=0.0, device="cpu", precision="fp32")
    out = engine.step(micro_batches, loss_fn)
    return out, opt.grads


def run_groupings(model, samples, budget, collate, loss_fn, **kw):
    results = {}
    for name, train in groupings(len(samples), budget).items():
        mbs = collate(samples, train)(list(range(len(samples))))
        out, grads = one_step(model, mbs, loss_fn, **kw)
        results[name] = (out, grads, len(mbs))
    return results


def assert_invariant(results, loss_rtol=TOL):
    """Every grouping gives the one-micro-batch step's count, loss and gradient."""
    (ref, ref_g, n_ref), *_ = results.values()
    assert n_ref == 1
    scale = max(float(g.abs().max()) for g in ref_g)
    assert scale > 1e-3  # a real gradient, not a trivially equal zero
    for name, (out, grads, n) in list(results.items())[1:]:
        assert n > 1, name
        assert out.count == ref.count, name
        assert math.isclose(out.loss, ref.loss, rel_tol=loss_rtol), name
        for a, b in zip(grads, ref_g, strict=True):
            torch.testing.assert_close(a, b, rtol=0.0, atol=TOL * scale, msg=name)


def pair_collate(samples, train):
    return make_collate(samples, train, LAYOUT, pair_batch)


def hf_response_logp(model, ids, mask):
    """sum over response tokens t of log p(ids[t] | ids[:t]), from the HF forward of the sequence alone."""
    ids = torch.as_tensor(ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].double(), -1)
    return sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])


# ---------------------------------------------------------------------------------------------- RM
@pytest.fixture(scope="module")
def value_model(tiny_model_path, tiny_tokenizer):
    from relayrl.models.value_head import build_value_model

    torch.manual_seed(0)
    cfg = ModelConfig(name_or_path=str(tiny_model_path), dtype="fp32")
    model = build_value_model(cfg, init="normal", pad_token_id=tiny_tokenizer.pad_token_id, device="cpu")
    return model.double()


def pairs_of(tok, n=N, seed=0):
    rows = vary(pair_rows("add2", "train", n, seed))
    pairs = [tokenize_pair(raw(r, i), tok, DataConfig(), "t") for i, r in enumerate(rows)]
    for i, p in enumerate(pairs):
        p.margin = 0.25 * (i % 3)
    return pairs


def test_rm_loss_against_hf_scores(value_model, tiny_tokenizer):
    """Score = the sequence-classification model's own output for the sequence alone;
    loss = sum over pairs of log(1 + exp(-(r_c - r_r - m)))."""
    pairs = pairs_of(tiny_tokenizer)
    with torch.no_grad():
        got = rm_loss(value_model, pair_batch(pairs, LAYOUT))
        score = [
            [
                float(value_model(input_ids=torch.tensor([s.input_ids])).logits[0, 0])
                for s in (p.chosen, p.rejected)
            ]
            for p in pairs
        ]
    expected = sum(math.log1p(math.exp(-(c - r - p.margin))) for (c, r), p in zip(score, pairs, strict=True))
    assert got.count == N
    assert math.isclose(float(got.loss_sum), expected, rel_tol=1e-6)
    assert float(got.metrics["acc"]) == sum(c > r for c, r in score)
    assert math.isclose(
        float(got.metrics["margin"]), sum(c - r for c, r in score), rel_tol=1e-5, abs_tol=1e-6
    )


def test_rm_micro_batch_invariance(value_model, tiny_tokenizer):
    results = run_groupings(value_model, pairs_of(tiny_tokenizer), 40, pair_collate, rm_loss)
    assert_invariant(results, F32_LOSS)


# ---------------------------------------------------------------------------------------------- DPO
DPO = {"loss": "dpo", "beta": 0.1, "label_smoothing": 0.0, "nll_coef": 0.0}


def test_dpo_at_step_zero_is_ln2_per_pair(tiny_tokenizer):
    """policy == reference: h = 0 exactly, so loss = ln 2 per pair (ipo: (1 / (2 beta))^2 = 25), and the
    gradient is the closed form of -log sigmoid(beta h) at h = 0: -beta / 2 * dh/dtheta. In fp32, the dtype
    the reference log-probs are stored in (a float64 policy would differ from them by float32 rounding)."""
    policy = tiny(tiny_tokenizer, 0).float()
    ref = frozen_copy(policy)
    mbs = pair_collate(pairs_of(tiny_tokenizer), groupings(N, 40)["budget"])(list(range(N)))
    with torch.no_grad():
        dpo_prepare(models_of(policy, ref), mbs, len(mbs))
    total, pairs = 0.0, 0
    policy.zero_grad()
    for mb in mbs:
        out = dpo_loss(policy, mb, **DPO)
        out.loss_sum.backward()
        total += out.loss_sum.item()
        pairs += out.count
        assert float(out.metrics["margin"]) == 0.0 and float(out.metrics["acc"]) == 0.0
        ipo = dpo_loss(policy, mb, **(DPO | {"loss": "ipo"}))
        assert math.isclose(ipo.loss_sum.item(), mb.num_pairs * 25.0, rel_tol=1e-7)
    assert pairs == N
    assert math.isclose(total, N * math.log(2.0), rel_tol=1e-7)
    g_loss = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    for mb in mbs:
        sums, _ = side_logps(policy, mb)
        (sums[: mb.num_pairs] - sums[mb.num_pairs :]).sum().backward()
    scale = max(float(g.abs().max()) for g in g_loss)
    for a, p in zip(g_loss, policy.parameters(), strict=True):
        torch.testing.assert_close(a, -0.05 * p.grad, rtol=0.0, atol=2e-5 * scale)  # fp32: observed 2.5e-6


def test_dpo_micro_batch_invariance(tiny_tokenizer):
    """dpo with the NLL term (a per-pair mean over the chosen tokens); the other variants differ only in the
    per-pair formula (tests/algorithms/test_preference_losses.py)."""
    policy, ref = tiny(tiny_tokenizer, 0), frozen_copy(tiny(tiny_tokenizer, 1))
    pairs = pairs_of(tiny_tokenizer)
    results = run_groupings(
        policy,
        pairs,
        40,
        pair_collate,
        partial(dpo_loss, **(DPO | {"nll_coef": 0.3})),
        prepare=dpo_prepare,
        frozen=ref,
    )
    assert_invariant(results)


def test_dpo_precomputed_reference_equals_on_the_fly(tiny_tokenizer):
    """precompute_reference (one pass, batched and packed differently from training) stores each pair's
    reference log-probs; training with them equals computing them in every step; both equal the HF forward."""
    policy, ref = tiny(tiny_tokenizer, 0), frozen_copy(tiny(tiny_tokenizer, 1))

    class Handle:  # ModelWorker.precompute: prepare over the batches, returned in order
        def call(self, method, batches):
            assert method is ModelWorker.precompute
            with torch.no_grad():
                dpo_prepare(models_of(policy, ref), batches, len(batches))
            return batches

    pre = pairs_of(tiny_tokenizer)
    train = TrainConfig(batch_size=3, micro_batch_size=1, packing=True, max_tokens_per_micro_batch=40)
    precompute_reference(Handle(), pre, train, LAYOUT)  # steps of 3 + 1 pairs
    for p in pre:
        want = [hf_response_logp(ref, s.input_ids, s.loss_mask) for s in (p.chosen, p.rejected)]
        assert p.ref_logps == pytest.approx(want, rel=1e-6)  # stored as float32
    step = groupings(N, 40)["mbs1"]
    mbs_pre = pair_collate(pre, step)(list(range(N)))
    assert all(mb.ref_logps is not None for mb in mbs_pre)
    out_pre, g_pre = one_step(policy, mbs_pre, partial(dpo_loss, **DPO), prepare=dpo_prepare, frozen=None)
    mbs_fly = pair_collate(pairs_of(tiny_tokenizer), step)(list(range(N)))
    assert all(mb.ref_logps is None for mb in mbs_fly)
    out_fly, g_fly = one_step(policy, mbs_fly, partial(dpo_loss, **DPO), prepare=dpo_prepare, frozen=ref)
    for a, b in zip(mbs_pre, mbs_fly, strict=True):  # float32 storage of float64 log-probs: equal to rounding
        torch.testing.assert_close(a.ref_logps, b.ref_logps, rtol=2e-7, atol=0)
    assert math.isclose(out_pre.loss, out_fly.loss, rel_tol=1e-7)
    scale = max(float(g.abs().max()) for g in g_fly)
    for a, b in zip(g_pre, g_fly, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * scale)


# ---------------------------------------------------------------------------------------------- KTO
KTO = {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.5}


def unpaired_of(tok, n=N):
    cfg = DataConfig()
    rows = vary(unpaired_rows("add2", "train", n, 0))
    return [
        UnpairedSample(sample=tokenize_sft(raw(r, i), tok, cfg, "response", "t"), desirable=r["label"])
        for i, r in enumerate(rows)
    ]


def kto_models(tok, samples):
    """(policy, reference, {KL sequence ids: log pi - log pi_ref over its response}), the two tiny models
    ordered so that the step's mean KL log-ratio is positive (z0 is not clamped to 0)."""
    a, b = tiny(tok, 0), tiny(tok, 1)
    partners = kl_partners([prompt_ids(s.sample) for s in samples])
    assert None not in partners
    kl = [kl_sequence(samples[k].sample, samples[j].sample) for k, j in enumerate(partners) if j is not None]
    diff = {tuple(ids): hf_response_logp(a, ids, m) - hf_response_logp(b, ids, m) for ids, m in kl}
    if sum(diff.values()) > 0:
        return a, frozen_copy(b), diff
    return b, frozen_copy(a), {k: -v for k, v in diff.items()}


def test_kto_reference_point_is_the_whole_steps_mean(tiny_tokenizer):
    """z0 = max(0, mean over ALL the step's KL sequences (prompt k + another prompt's response) of log pi -
    log pi_ref),
    the same in every micro-batch whatever the split (a per-micro-batch mean, OpenRLHF's, would differ),
    padding passes left out; the loss then matches the formula with that z0."""
    samples = unpaired_of(tiny_tokenizer)
    n = len(samples)
    policy, ref, diff = kto_models(tiny_tokenizer, samples)
    assert len(diff) == n
    z_want = sum(diff.values()) / n
    assert z_want > 1e-3
    for name, train in groupings(n, 30).items():
        mbs = kto_collate(samples, train, LAYOUT)(list(range(n)))
        with torch.no_grad():  # plus one padding pass (num_real excludes it)
            kto_prepare(models_of(policy, ref), [*mbs, mbs[0]], len(mbs))
        assert all(mb.z0 == pytest.approx(z_want, rel=1e-9) for mb in mbs), name
        kl_seqs = [[tuple(s.tolist()) for s in mb.input_ids[mb.num_samples :]] for mb in mbs]
        assert sorted(k for ks in kl_seqs for k in ks) == sorted(diff)  # every KL sequence once
        if len(mbs) > 1:  # a per-micro-batch reference point would differ
            per_mb = [max(0.0, sum(diff[k] for k in ks) / len(ks)) for ks in kl_seqs]
            assert max(abs(z - z_want) for z in per_mb) > 1e-3, name
        if name == "one":
            (one,) = mbs
    # the loss with that z0, by hand: desirable lambda_D (1 - sigmoid(beta (r - z0))), undesirable
    # lambda_U (1 - sigmoid(beta (z0 - r))), r = log pi - log pi_ref of the sample's own response
    expected = 0.0
    for s in samples:
        ids, mask = s.sample.input_ids, s.sample.loss_mask
        r = hf_response_logp(policy, ids, mask) - hf_response_logp(ref, ids, mask)
        x = KTO["beta"] * (r - z_want if s.desirable else z_want - r)
        weight = KTO["desirable_weight"] if s.desirable else KTO["undesirable_weight"]
        expected += weight * (1.0 - 1.0 / (1.0 + math.exp(-x)))
    with torch.no_grad():
        out = kto_loss(policy, one, **KTO)
    assert out.count == n
    assert math.isclose(float(out.loss_sum), expected, rel_tol=1e-6)  # ref log-probs are stored as float32
    assert math.isclose(float(out.metrics["kl"]) / n, z_want, rel_tol=1e-6)  # a float32 metric


def test_kto_micro_batch_invariance(tiny_tokenizer):
    samples = unpaired_of(tiny_tokenizer)
    policy, ref, _ = kto_models(tiny_tokenizer, samples)
    results = run_groupings(
        policy,
        samples,
        30,
        lambda s, train: kto_collate(s, train, LAYOUT),
        partial(kto_loss, **KTO),
        prepare=kto_prepare,
        frozen=ref,
    )
    assert_invariant(results)
    out = results["one"][0]
    assert out.metrics["reward_desirable"] != out.metrics["reward_undesirable"]


def test_kto_kl_partners_never_pair_a_prompt_with_itself():
    # an unshuffled eval set (a prompt's desirable and undesirable rows side by side): "the next sample" paired
    # 4 of 8 with their own prompt's other response; half the step away pairs none
    step = ["a", "a", "b", "b", "c", "c", "d", "d"]
    partners = kl_partners(step)
    assert partners == [4, 5, 6, 7, 0, 1, 2, 3]
    # the prompt check covers what the shift does not (odd-sized steps, repeated prompts anywhere)
    for step in (["a", "b", "a"], ["a", "b", "c", "a", "a"], ["x", "x", "x", "y"]):
        for k, j in enumerate(kl_partners(step)):
            assert j is not None and j != k and step[j] != step[k], (step, k, j)
    # nobody to pair with: a one-sample step, one prompt's responses only
    assert kl_partners(["a"]) == [None]
    assert kl_partners(["a", "a", "a"]) == [None, None, None]


def test_kto_step_without_kl_partner_uses_z0_zero(tiny_tokenizer):
    # a one-sample step (and a step of one prompt's responses): no KL sequence is valid, z0 = 0 (the sample's
    # own response would give z0 = max(0, r), its own reward)
    samples = unpaired_of(tiny_tokenizer)
    policy, ref, _ = kto_models(tiny_tokenizer, samples)
    (mb,) = kto_collate(samples, TrainConfig(batch_size=1, micro_batch_size=1), LAYOUT)([3])
    assert mb.kl_valid is not None and mb.kl_valid.tolist() == [False]
    with torch.no_grad():
        kto_prepare(models_of(policy, ref), [mb], 1)
    assert mb.z0 == 0.0


def test_kto_absent_side_logs_nothing(tiny_tokenizer):
    # a step of desirable samples only: reward_undesirable is left out of the row, not logged as 0.0
    samples = unpaired_of(tiny_tokenizer)
    good = [s for s in samples if s.desirable][:2]
    assert len(good) == 2
    policy, ref, _ = kto_models(tiny_tokenizer, samples)
    engine = TrainStep(model=policy, optimizer=None, grad_clip=0.0, device="cpu", precision="fp32")
    (mb,) = kto_collate(good, TrainConfig(batch_size=2, micro_batch_size=2), LAYOUT)([0, 1])
    with torch.no_grad():
        kto_prepare(models_of(policy, ref), [mb], 1)
    metrics = engine.evaluate([[mb]], partial(kto_loss, **KTO))
    assert "eval/reward_desirable" in metrics and "eval/reward_undesirable" not in metrics


# ---------------------------------------------------------------------------------------------- KD
KD = {"coef": 0.4, "temperature": 2.0, "beta": 0.3, "chunk": 5}


def sft_samples(tok, n=N):
    rows = vary(pair_rows("add2", "train", n, 1))
    cfg = DataConfig()
    return [
        tokenize_sft(raw({"input": r["input"], "output": r["chosen"]}, i), tok, cfg, "response", "t")
        for i, r in enumerate(rows)
    ]


def kd_collate(samples, train):
    return make_collate(samples, train, LAYOUT, kd_batch)


def test_kd_micro_batch_invariance(tiny_tokenizer):
    """jsd (beta 0.3): both KL terms; the divergences themselves are checked by loops elsewhere."""
    divergence = "jsd"
    student, teacher = tiny(tiny_tokenizer, 0), frozen_copy(tiny(tiny_tokenizer, 1))
    loss = partial(kd_loss, divergence=divergence, **KD)
    results = run_groupings(
        student, sft_samples(tiny_tokenizer), 20, kd_collate, loss, prepare=kd_prepare, frozen=teacher
    )
    assert_invariant(results, F32_LOSS)
    assert results["one"][0].metrics["kd"] > 1e-4


def test_kd_teacher_equal_to_student_gives_zero_divergence(tiny_tokenizer):
    """teacher == student: every divergence is 0 and so is its gradient (coef 1: the loss is the divergence)."""
    student = tiny(tiny_tokenizer, 0)
    mbs = kd_collate(sft_samples(tiny_tokenizer), groupings(N, 20)["budget"])(list(range(N)))
    with torch.no_grad():
        kd_prepare(models_of(student, frozen_copy(student)), mbs, len(mbs))
    for divergence in ("forward_kl", "reverse_kl", "jsd"):
        loss = partial(kd_loss, divergence=divergence, **(KD | {"coef": 1.0}))
        out, grads = one_step(student, mbs, loss)
        assert abs(out.metrics["kd"]) < 1e-7 and abs(out.loss) < 1e-7, divergence
        assert out.metrics["ce"] > 1.0
        assert max(float(g.abs().max()) for g in grads) < 1e-7, divergence


def test_kd_cross_entropy_is_the_sft_loss(tiny_tokenizer):
    """coef 0: the KD loss is the student's next-token cross-entropy on the response tokens, the SFT loss
    (the rows that predict a target are aligned with the targets)."""
    student, teacher = tiny(tiny_tokenizer, 0), frozen_copy(tiny(tiny_tokenizer, 1))
    samples = sft_samples(tiny_tokenizer)
    (mb,) = kd_collate(samples, groupings(N, 20)["one"])(list(range(N)))
    with torch.no_grad():
        kd_prepare(models_of(student, teacher), [mb], 1)
        out = kd_loss(student, mb, divergence="forward_kl", **(KD | {"coef": 0.0}))
        sft = next_token_loss(student, sft_batch(samples, LAYOUT))
    assert out.count == float(sft.count) == sum(sum(s.loss_mask[1:]) for s in samples)
    assert math.isclose(float(out.loss_sum), float(sft.loss_sum), rel_tol=1e-6)


# ---------------------------------------------------------------------------------------------- PRM
def step_samples(tok, n=N):
    mark = encode(tok, PLACEHOLDER)[0]
    out = []
    for i, r in enumerate(vary(step_rows("train", n, 0))):
        ids = encode(tok, r["input"])
        labels = [float(v) for v in r["label"]]
        labels[0] = 0.7 if i % 2 else labels[0]  # some soft labels
        out.append(
            StepSample(input_ids=ids, positions=[j for j, t in enumerate(ids) if t == mark], labels=labels)
        )
    return out


def test_prm_loss_against_hf_logits_and_micro_batch_invariance(tiny_tokenizer):
    model = tiny(tiny_tokenizer, 0)
    good, bad = encode(tiny_tokenizer, "+")[0], encode(tiny_tokenizer, "-")[0]
    samples = step_samples(tiny_tokenizer)
    loss = partial(prm_loss, good=good, bad=bad)
    expected, steps = 0.0, 0
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.input_ids])).logits[0]
            for pos, y in zip(s.positions, s.labels, strict=True):
                p = 1.0 / (1.0 + math.exp(-(float(logits[pos, good]) - float(logits[pos, bad]))))
                expected -= y * math.log(p) + (1.0 - y) * math.log(1.0 - p)
                steps += 1
        out = loss(model, step_batch(samples, LAYOUT))
    assert out.count == steps == 2 * N
    assert math.isclose(float(out.loss_sum), expected, rel_tol=1e-6)
    collate = lambda s, train: make_collate(s, train, LAYOUT, step_batch)  # noqa: E731
    assert_invariant(run_groupings(model, samples, 50, collate, loss), F32_LOSS)
