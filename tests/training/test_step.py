"""The training core: optimizer groups, schedules, (loss_sum, count) accumulation, sampler, exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.models.tiny import TinyModelSpec, build_tiny_model
from relayrl.trainers.sft import make_sft_collate, next_token_loss, sft_micro_batches
from relayrl.training.checkpoint import CheckpointManager
from relayrl.training.logging import MetricsLogger, read_jsonl
from relayrl.training.loop import LoopSettings, Trainer
from relayrl.training.optim import build_optimizer, build_scheduler, lr_factor, param_groups
from relayrl.training.sampler import ResumableSampler
from relayrl.training.step import TrainStep


class Sample:
    def __init__(self, ids, mask):
        self.input_ids, self.loss_mask = ids, mask


def make_samples(n: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(4, 12, (1,), generator=g))
        ids = torch.randint(4, 100, (length,), generator=g).tolist()
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        out.append(Sample(ids, [0] * prompt + [1] * (length - prompt)))
    return out


def test_param_groups_no_decay_on_bias_and_norm(tiny_model):
    groups = param_groups(tiny_model, 0.1)
    names = {id(p): n for n, p in tiny_model.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert "model.layers.0.self_attn.q_proj.weight" in decay
    assert "model.layers.0.self_attn.q_proj.bias" in no_decay  # Qwen2 q/k/v have biases
    assert "model.layers.0.input_layernorm.weight" in no_decay and "model.norm.weight" in no_decay
    assert len(decay) + len(no_decay) == len(list(tiny_model.parameters()))


def test_lr_schedules_hand_values():
    kw = {"total_steps": 10, "warmup_steps": 2, "min_lr_ratio": 0.1}
    # warmup: (step+1)/2
    assert lr_factor(0, schedule="cosine", **kw) == 0.5
    assert lr_factor(1, schedule="cosine", **kw) == 1.0
    # step 6: p = (6-2)/8 = 0.5 -> cosine 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55; linear 0.1 + 0.9 * 0.5 = 0.55
    assert math.isclose(lr_factor(6, schedule="cosine", **kw), 0.55, rel_tol=1e-12)
    assert math.isclose(lr_factor(6, schedule="linear", **kw), 0.55, rel_tol=1e-12)
    # step 4: p = 0.25 -> cosine 0.1 + 0.45 * (1 + cos(pi/4)) = 0.868198; linear 0.1 + 0.9 * 0.75 = 0.775
    assert math.isclose(
        lr_factor(4, schedule="cosine", **kw), 0.1 + 0.45 * (1 + math.sqrt(0.5)), rel_tol=1e-12
    )
    assert math.isclose(lr_factor(4, schedule="linear", **kw), 0.775, rel_tol=1e-12)
    assert math.isclose(lr_factor(10, schedule="cosine", **kw), 0.1, rel_tol=1e-12)
    assert lr_factor(7, schedule="constant", **kw) == 1.0
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=2.0)
    sched = build_scheduler(opt, total_steps=10, warmup_ratio=0.2, schedule="linear", min_lr_ratio=0.1)
    lrs = []
    for _ in range(3):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == [1.0, 2.0, 2.0 * 1.0]  # warmup 0.2*10 = 2 steps; step 2 is p=0 of the decay
    with pytest.raises(ValueError, match=r"optim\.scheduler"):
        build_scheduler(opt, total_steps=10, schedule="step")


def _one_step_grads(samples, *, packing, mbs=1, budget=0):
    torch.manual_seed(0)
    tok_model = build_tiny_model(_tok(), TinyModelSpec(seed=0))
    opt = torch.optim.SGD(tok_model.parameters(), lr=0.1)
    engine = TrainStep(model=tok_model, loss_fn=next_token_loss, optimizer=opt, grad_clip=0.0, device="cpu")
    mbs_list = sft_micro_batches(
        samples, layout="padded", packing=packing, micro_batch_size=mbs, max_tokens_per_micro_batch=budget
    )
    out = engine.step(mbs_list)
    return out, len(mbs_list), {n: p.detach().clone() for n, p in tok_model.named_parameters()}


def _tok():
    from relayrl.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def test_accumulation_normalised_by_global_token_count():
    """Same 8 samples, split 1 / 2 / 4 / 8 per micro-batch, padded or packed, or by a token budget:
    the same loss and the same SGD update (weights after the step), because the denominator is the
    step's total target tokens, not a per-micro-batch mean."""
    samples = make_samples(8)
    ref, n_ref, ref_w = _one_step_grads(samples, packing=False, mbs=8)
    assert n_ref == 1
    target_tokens = sum(sum(s.loss_mask[1:]) for s in samples)
    assert ref.count == target_tokens
    for kw in (
        {"packing": False, "mbs": 1},
        {"packing": False, "mbs": 2},
        {"packing": True, "mbs": 4},
        {"packing": True, "budget": 20},
    ):
        out, n, w = _one_step_grads(samples, **kw)
        assert n > 1
        assert out.count == ref.count
        assert abs(out.loss - ref.loss) < 1e-6
        assert abs(out.grad_norm - ref.grad_norm) < 1e-6 * max(1.0, ref.grad_norm)
        for name in ref_w:
            torch.testing.assert_close(w[name], ref_w[name], atol=1e-7, rtol=1e-6, msg=name)


def test_naive_mean_of_means_differs():
    """Guard: averaging per-micro-batch means (the common bug) gives a different loss here."""
    samples = make_samples(8)
    ref, _, _ = _one_step_grads(samples, packing=False, mbs=8)
    model = build_tiny_model(_tok(), TinyModelSpec(seed=0))
    means = []
    for b in sft_micro_batches(samples, layout="padded", packing=False, micro_batch_size=2):
        out = next_token_loss(model, b)
        means.append(float(out.loss_sum.detach()) / out.count)
    assert abs(sum(means) / len(means) - ref.loss) > 1e-4


def test_sampler_epochs_and_state():
    s = ResumableSampler(10, 4, seed=3)
    first = [s.next_indices() for _ in range(2)]
    assert (s.epoch, s.position) == (0, 8)
    third = s.next_indices()  # 2 left < 4: next epoch
    assert (s.epoch, s.position) == (1, 4)
    assert len(set(first[0] + first[1])) == 8 and set(first[0] + first[1]) <= set(range(10))
    t = ResumableSampler(10, 4, seed=3)
    t.load_state_dict({"epoch": 1, "position": 0})
    assert t.next_indices() == third
    with pytest.raises(ValueError, match=r"train\.batch_size=11"):
        ResumableSampler(10, 11)


def _trainer(tmp_path, samples, total, *, save_every, seed=0):
    from relayrl.config.components import TrainConfig

    torch.manual_seed(seed)
    model = build_tiny_model(_tok(), TinyModelSpec(seed=0))
    opt = build_optimizer(model, lr=3e-3, weight_decay=0.01)
    sched = build_scheduler(opt, total_steps=total, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1)
    engine = TrainStep(model=model, loss_fn=next_token_loss, optimizer=opt, scheduler=sched, device="cpu")
    cfg = TrainConfig(batch_size=4, micro_batch_size=2, packing=True)
    return Trainer(
        train_step=engine,
        sampler=ResumableSampler(len(samples), 4, seed=seed),
        collate=make_sft_collate(samples, cfg, "padded"),
        settings=LoopSettings(total_steps=total, save_every=save_every),
        ckpt=CheckpointManager(tmp_path / "ckpt", keep_last=2),
        tokenizer=_tok(),
    )


def test_resume_is_exact(tmp_path):
    """Uninterrupted 6 steps == 3 steps, a fresh process-like restart from the checkpoint, 3 more steps:
    identical per-step losses and bitwise-identical final weights (CPU, fp32). 10 samples / batch 4 means
    the run crosses an epoch boundary after the resume."""
    samples = make_samples(10, seed=1)
    full = _trainer(tmp_path / "a", samples, 6, save_every=0)
    full_losses = [h["train/loss"] for h in full.fit().history]

    first = _trainer(tmp_path / "b", samples, 6, save_every=3)
    first.settings.total_steps = 3  # "crash" after step 3
    part1 = [h["train/loss"] for h in first.fit().history]
    torch.manual_seed(12345)  # disturb RNG: resume must restore it
    second = _trainer(tmp_path / "b", samples, 6, save_every=3, seed=0)
    assert second.resume() and second.step == 3
    part2 = [h["train/loss"] for h in second.fit().history]
    assert part1 + part2 == full_losses
    for (name, p), q in zip(
        full.train_step.model.named_parameters(), second.train_step.model.parameters(), strict=True
    ):
        assert torch.equal(p, q), name


def test_fit_logs_eval_and_jsonl(tmp_path):
    samples = make_samples(8, seed=2)
    trainer = _trainer(tmp_path, samples, 4, save_every=0)
    trainer.settings.eval_every = 2
    collate = make_sft_collate(samples[:4], trainer_cfg(), "padded")
    trainer.eval_batches = lambda: [collate([0, 1, 2, 3])]
    with MetricsLogger(tmp_path / "run", total_steps=4, console=False) as logger:
        trainer.logger = logger
        trainer.fit()
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [("eval/loss" in r) for r in rows] == [False, True, False, True]
    assert all(r["train/loss"] > 0 and r["perf/tokens_per_s"] > 0 for r in rows)
    # eval loss = token-weighted CE of the 4 eval samples under the final weights
    model = trainer.train_step.model
    out = [next_token_loss(model, b) for b in collate([0, 1, 2, 3])]
    expect = sum(float(o.loss_sum.detach()) for o in out) / sum(o.count for o in out)
    assert abs(rows[-1]["eval/loss"] - expect) < 1e-6
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_4"


def trainer_cfg():
    from relayrl.config.components import TrainConfig

    return TrainConfig(batch_size=4, micro_batch_size=4)


def test_precision_resolution():
    from relayrl.training.step import resolve_precision

    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_precision("bf16", torch.device("cpu"))


@pytest.mark.gpu
def test_bf16_autocast_on_cuda():
    """On a GPU the step computes under bf16 autocast over fp32 master weights (varlen attention): the loss is
    within bf16 rounding of the fp32 step's, gradients land in fp32, the optimizer states are fp32."""
    from relayrl.models.forward import prepare_model

    samples = make_samples(8)
    batches = sft_micro_batches(samples, layout="varlen", packing=True, micro_batch_size=4)
    model = build_tiny_model(_tok(), TinyModelSpec(seed=0)).cuda()
    prepare_model(model, "varlen")
    opt = build_optimizer(model, lr=1e-3)
    fp32 = TrainStep(model=model, loss_fn=next_token_loss, optimizer=opt, precision="fp32")
    engine = TrainStep(model=model, loss_fn=next_token_loss, optimizer=opt)
    assert engine.precision == "bf16"  # auto on a bf16-capable GPU
    ref = fp32.evaluate([batches])["eval/loss"]
    got = engine.evaluate([batches])["eval/loss"]
    assert abs(got - ref) < 0.02 * ref  # bf16 matmuls: ~3 significant digits
    out = engine.step(batches)
    assert abs(out.loss - ref) < 0.02 * ref and not out.skipped
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_metrics_logger_resume_keeps_rows_up_to_checkpoint(tmp_path):
    with MetricsLogger(tmp_path, console=False) as lg:
        for step in (1, 2, 3, 4):
            lg.log({"train/loss": float(step), "bad": "text"}, step)
    with MetricsLogger(tmp_path, console=False, start_step=2) as lg:  # resumed from the step-2 checkpoint
        lg.log({"train/loss": 30.0}, 3)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["train/loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert all("bad" not in r for r in rows)  # non-scalars are skipped
    with MetricsLogger(tmp_path, console=False) as lg:  # a fresh run starts a new file
        lg.log({"train/loss": float("nan")}, 1)
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["train/loss"] is None


def _quadratic_step(max_nonfinite: int = 3) -> tuple[TrainStep, torch.nn.Parameter]:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    model = torch.nn.Module()
    model.w = w
    opt = torch.optim.SGD([w], lr=0.5)
    return TrainStep(model=model, optimizer=opt, grad_clip=0.0, device="cpu", max_nonfinite=max_nonfinite), w


def test_loss_sum_contract_and_metric_denominators():
    """Two micro-batches: loss_sum = sum_i x_i * w^2 over their units; the step's gradient is the sum of the
    gradients divided by the total count (3 + 1 units), and each metric by its own total denominator."""
    from relayrl.training.step import LossOutput

    step, w = _quadratic_step()
    units = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]

    def loss_fn(model, x):
        loss_sum = (x[:, None] * model.w**2).sum()
        return LossOutput(
            loss_sum=loss_sum,
            count=float(len(x)),
            metrics={"x": x.sum(), "rows": 1.0},
            metric_counts={"rows": 1.0},
        )

    out = step.step(units, loss_fn)
    # L = (1+2+3+4) * (w0^2 + w1^2) / 4 = 2.5 * 5 = 12.5; dL/dw = 2.5 * 2w = [5, 10]; SGD lr 0.5
    assert out.count == 4 and out.loss == pytest.approx(12.5, rel=1e-12)
    assert out.metrics == {"x": pytest.approx(10 / 4), "rows": pytest.approx(2 / 2)}
    torch.testing.assert_close(w.detach(), torch.tensor([1.0 - 2.5, 2.0 - 5.0]))
    assert out.grad_norm == pytest.approx(math.hypot(5.0, 10.0), rel=1e-6) and not out.skipped


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run():
    """A NaN loss or gradient: no update (weights unchanged), counted; a finite step resets the streak;
    `max_nonfinite` in a row raises NonFiniteError naming what to do."""
    from relayrl.training.step import LossOutput, NonFiniteError

    step, w = _quadratic_step(max_nonfinite=2)
    bad = {"v": float("nan")}

    def loss_fn(model, scale):
        return LossOutput(loss_sum=(model.w**2).sum() * scale, count=1.0)

    before = w.detach().clone()
    out = step.step([bad["v"]], loss_fn)
    assert out.skipped and step.nonfinite_total == 1
    assert torch.equal(w.detach(), before) and w.grad is None
    good = step.step([1.0], loss_fn)
    assert not good.skipped and not torch.equal(w.detach(), before) and step.nonfinite_in_a_row == 0
    step.step([float("inf")], loss_fn)
    with pytest.raises(NonFiniteError, match="2 optimizer steps in a row had a non-finite"):
        step.step([float("nan")], loss_fn)
    assert step.nonfinite_total == 3
