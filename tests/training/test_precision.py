"""Mixed precision (relayrl/training/precision.py), exercised on CPU with bf16 compute weights.

- The module computes in bf16 while the optimizer owns fp32 masters; gradients of several micro-batches
  are summed in fp32 on the masters (not in bf16 on the module), and the step divides by the global count.
- An update smaller than bf16's resolution still changes the fp32 master (a pure-bf16 model would lose it),
  and the module is always the master cast to bf16 after a step (canary 0).
- Checkpoints written inside `full_precision()` hold the exact fp32 weights and load back into the masters.
"""

from __future__ import annotations

import torch

from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.training.optim import build_optimizer
from relayrl.training.precision import MasterWeights
from relayrl.training.step import LossOutput, TrainStep


def _model():
    return build_tiny_model(build_tiny_tokenizer(), TinyModelSpec(seed=0))


def _loss(model, ids):
    out = model(input_ids=ids, labels=ids)
    n = ids.shape[1] - 1
    return LossOutput(loss_sum=out.loss * n * ids.shape[0], count=float(n * ids.shape[0]))


def test_bf16_compute_with_fp32_master_accumulation():
    torch.manual_seed(0)
    model = _model()
    master = MasterWeights(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for m in master.params)
    before = [m.detach().clone() for m in master.params]
    opt = build_optimizer(master.named_params(), lr=1e-6)  # Adam moves every weight by ~1e-6: below bf16 ulp
    step = TrainStep(model=model, optimizer=opt, grad_clip=0.0, device="cpu", precision="fp32", master=master)
    mbs = [torch.randint(4, 90, (2, 7)), torch.randint(4, 90, (3, 5))]
    # the fp32 sum of the micro-batches' bf16 gradients, divided by the total count, is what the step uses
    expect = [torch.zeros_like(m) for m in master.params]
    for ids in mbs:
        out = _loss(model, ids)  # autograd.grad does not accumulate into .grad, so no hook fires
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(out.loss_sum, params)
        for e, g in zip(expect, grads, strict=True):
            e.add_(g.float())
    total = sum(ids.shape[0] * (ids.shape[1] - 1) for ids in mbs)
    captured = {}
    orig_step = opt.step

    def spy_step(*a, **k):
        captured["grads"] = [m.grad.clone() for m in master.params]
        return orig_step(*a, **k)

    opt.step = spy_step
    out = step.step(mbs, _loss)
    assert not out.skipped and out.count == total
    for got, want in zip(captured["grads"], expect, strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want / total, rtol=1e-5, atol=1e-8)
    moved = sum(int(not torch.equal(m, b)) for m, b in zip(master.params, before, strict=True))
    assert moved == len(before)  # every master moved
    assert master.max_abs_diff() == 0.0  # the module is the masters cast to bf16
    for (_, p), m in zip(model.named_parameters(), master.params, strict=True):
        assert torch.equal(p, m.detach().to(torch.bfloat16))
    # the ~1e-6 updates are below bf16 resolution for most weights: the bf16 module alone would not have moved
    unchanged_in_bf16 = sum(
        int(torch.equal(b.to(torch.bfloat16), m.detach().to(torch.bfloat16)))
        for b, m in zip(before, master.params, strict=True)
    )
    assert unchanged_in_bf16 > 0


def test_full_precision_checkpoints_are_exact(tmp_path):
    from relayrl.training.checkpoint import load_weights_into

    torch.manual_seed(0)
    model = _model()
    master = MasterWeights(model, torch.bfloat16)
    with torch.no_grad():
        for m in master.params:
            m.add_(torch.randn_like(m) * 1e-5)  # fp32 detail that bf16 cannot hold
    master.refresh()
    ptrs = [p.data_ptr() for p in model.parameters()]
    with master.full_precision():
        assert all(p.dtype == torch.float32 for p in model.parameters())
        model.save_pretrained(tmp_path / "ckpt")
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # compute storage back in place
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    saved = [m.detach().clone() for m in master.params]
    other = _model()
    other_master = MasterWeights(other, torch.bfloat16)
    with other_master.full_precision():
        load_weights_into(other, tmp_path / "ckpt")
    for a, b in zip(other_master.params, saved, strict=True):
        assert torch.equal(a, b)
    assert other_master.max_abs_diff() == 0.0
