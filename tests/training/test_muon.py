"""Muon (relayrl.training.muon): equal to a plain reference written here (fp64, per-parameter loops, AdamW from
torch.optim for the non-Muon parameters), which parameters take Muon, the update's RMS (Moonshot's scale),
clipping of the raw gradient before Newton-Schulz, and 2 FSDP2 ranks equal to 1 plain rank.

Tolerances: the reference comparison runs in float64, rtol 1e-10 / atol 1e-12 (the same operations in another
order; a wrong coefficient, scale, Nesterov term or bias correction moves the weights by > 1e-4). The 2-rank
comparison runs in fp32: atol 3e-7 on weights of size ~0.1 after 2 steps of lr 1e-2 (gradients summed in
another order by the reduce-scatter, ~1e-7 relative; seen <= 2e-7; an unorthogonalised shard or a shard-local
Newton-Schulz moves a weight by > 1e-3), except the key bias (see the test)."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from dp_fixtures import addition_rows, run_sft
from rank_spawn import spawn_ranks

from relayrl.config.components import OptimConfig
from relayrl.distributed.fsdp import ShardSpec, full_tensors, shard_model
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.training.muon import Muon, muon_param_groups, muon_scale, newton_schulz, uses_muon
from relayrl.training.optim import build_optim
from relayrl.training.setup import build_train_step
from relayrl.training.step import LossOutput


def _reference_ns(g: torch.Tensor) -> torch.Tensor:
    """Jordan's quintic written out: normalise, transpose a tall matrix, 5 x (aX + bAX + cA^2X)."""
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x - 4.7750 * (a @ x) + 2.0315 * (a @ a @ x)
    return x.T if tall else x


class ReferenceMuon:
    """Plain Muon over a list of matrices (Moonshot's Nesterov form and scale), lr and wd fixed."""

    def __init__(self, params, lr, wd, mu=0.95):
        self.params, self.lr, self.wd, self.mu = params, lr, wd, mu
        self.bufs = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.params, self.bufs, strict=True):
            buf.copy_(self.mu * buf + p.grad)
            o = _reference_ns(p.grad + self.mu * buf)
            p.copy_(p * (1 - self.lr * self.wd) - self.lr * 0.2 * math.sqrt(max(p.shape)) * o)


def _model(tok, **kw):
    return build_tiny_model(tok, TinyModelSpec(hidden=32, layers=1, seed=0, **kw))


def _loss(model, ids):
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def test_the_groups_put_hidden_matrices_on_muon_and_the_rest_on_adamw(tiny_tokenizer):
    named = list(_model(tiny_tokenizer).named_parameters())
    muon = {n for n, p in named if uses_muon(n, p)}
    assert muon == {
        f"model.layers.0.{m}.weight"
        for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }  # fmt: skip
    groups = muon_param_groups(named, weight_decay=0.1)
    assert [(g["use_muon"], g["weight_decay"], len(g["params"])) for g in groups] == [
        (True, 0.1, 7),
        (False, 0.1, 1),  # the (tied) embedding / lm_head
        (False, 0.0, len(named) - 8),  # norms and the q/k/v biases
    ]
    assert not uses_muon("score.weight", torch.zeros(1, 32)) and not uses_muon("x.weight", torch.zeros(1, 8))


def test_newton_schulz_pushes_every_singular_value_near_one_and_keeps_the_singular_vectors():
    g = torch.randn(48, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    o = newton_schulz(g)
    s = torch.linalg.svdvals(o)
    assert o.shape == g.shape and s.min() > 0.6 and s.max() < 1.25  # Jordan: ~U(0.7, 1.2) by design
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    d = torch.diagonal(u.T @ o @ vh.T)
    assert torch.allclose(o, u @ torch.diag(d) @ vh, atol=1e-10)  # o = U diag(d) V^T: the same U, V
    torch.testing.assert_close(o, _reference_ns(g), rtol=1e-12, atol=1e-12)


def test_muon_equals_the_reference_over_three_steps_in_float64(tiny_tokenizer):
    model = _model(tiny_tokenizer).double()
    ref = _model(tiny_tokenizer).double()
    cfg = OptimConfig(name="muon", lr=0.02, weight_decay=0.1, adam_betas=(0.9, 0.95), eps=1e-8)
    opt, _ = build_optim(model, cfg, total_steps=3)
    assert isinstance(opt, Muon)
    named = list(ref.named_parameters())
    mats = [p for n, p in named if uses_muon(n, p)]
    ref_muon = ReferenceMuon(mats, lr=0.02, wd=0.1)
    decay = [p for n, p in named if not uses_muon(n, p) and p.ndim == 2]
    rest = [p for n, p in named if p.ndim < 2]
    ref_adam = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                 lr=0.02, betas=(0.9, 0.95), eps=1e-8, foreach=False)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        ids = torch.randint(4, 60, (2, 9), generator=gen)
        for m in (model, ref):
            m.zero_grad()
            _loss(m, ids).backward()
        opt.step()
        ref_muon.step()
        ref_adam.step()
    for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert not torch.allclose(p, before[n], atol=1e-4), f"{n} did not move"
        torch.testing.assert_close(p, r, rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("shape", [(64, 64), (128, 32), (24, 96)])
def test_the_update_rms_is_that_of_adamw(shape):
    """Moonshot's scale: NS5 of a full-rank (A, B) matrix times 0.2 sqrt(max(A, B)) has RMS ~0.2 (singular
    values ~[0.7, 1.2] by design, so RMS in [0.14, 0.24]); Jordan's sqrt(max(1, A/B)) would give 1/sqrt(B)."""
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    rms = (newton_schulz(g) * muon_scale(g.shape)).pow(2).mean().sqrt().item()
    assert 0.14 < rms < 0.24, rms


def test_clipping_acts_on_the_raw_gradient_before_newton_schulz(tiny_tokenizer):
    """TrainStep clips before `step()`: after one step every Muon momentum buffer is its clipped gradient
    (and every AdamW first moment (1 - beta1) x its clipped gradient): together of norm max_grad_norm."""
    model = _model(tiny_tokenizer)
    cfg = OptimConfig(name="muon", lr=1.0, weight_decay=0.0, max_grad_norm=0.01, scheduler="constant",
                      warmup_ratio=0.0)  # fmt: skip
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    step = build_train_step(model, cfg, 1, lambda m, b: LossOutput(loss_sum=_loss(m, b), count=16.0),
                            precision="fp32", device=torch.device("cpu"))  # fmt: skip
    out = step.step([ids])
    assert out.grad_norm > 0.1  # so clipping to 0.01 really rescales
    bufs = [
        step.optimizer.state[p]["momentum_buffer"] for n, p in model.named_parameters() if uses_muon(n, p)
    ]
    moments = [s["exp_avg"] / 0.1 for s in step.optimizer.state.values() if "exp_avg" in s]  # (1 - beta1) g
    assert len(bufs) == 7 and len(moments) == len(list(model.parameters())) - 7
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in bufs + moments]))
    assert total.item() == pytest.approx(0.01, rel=1e-5)


def _rank_run(rank: int, world: int, store: str, out: str) -> None:
    """Shard the model over `world` gloo ranks (FSDP2), 2 Muon steps, each rank taking its rows of the batch;
    rank 0 saves the gathered weights."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    try:
        model = shard_model(
            _model(build_tiny_tokenizer(), intermediate=51), ShardSpec(device=torch.device("cpu"))
        )
        step = _two_steps(model, sharded=True, rows=slice(rank * 4 // world, (rank + 1) * 4 // world))
        weights = dict(full_tensors(model))
        if rank == 0:
            torch.save({"weights": weights, "muon_state": step}, out)
        dist.barrier()  # no rank tears gloo down while its peer is still in a collective (SIGABRT seen in CI)
    finally:
        dist.destroy_process_group()


def _two_steps(model, *, sharded: bool, rows: slice) -> int:
    cfg = OptimConfig(name="muon", lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, scheduler="constant",
                      warmup_ratio=0.0)  # fmt: skip
    step = build_train_step(
        model, cfg, 2, lambda m, b: LossOutput(loss_sum=_loss(m, b), count=b[:, 1:].numel()),
        precision="fp32", device=torch.device("cpu"), sharded=sharded,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        ids = torch.randint(4, 60, (4, 7), generator=gen)
        step.step([ids[rows]])
    return sum(1 for s in step.optimizer.state.values() if "momentum_buffer" in s)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_fsdp_ranks_equal_one_plain_rank(tmp_path):
    """Muon on 2 FSDP2 ranks (gloo; the MLP's 51 rows split 26 / 25) == Muon on one unsharded model."""
    one = _model(build_tiny_tokenizer(), intermediate=51)
    n_muon = _two_steps(one, sharded=False, rows=slice(0, 4))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    spawn_ranks(_rank_run, (2, str(tmp_path / "store"), str(tmp_path / "two.pt")), nprocs=2)
    two = torch.load(tmp_path / "two.pt")
    assert two["muon_state"] == n_muon == 7
    for n, p in one.named_parameters():
        # k_proj.bias: softmax is shift-invariant in it, its gradient is rounding noise that AdamW normalises
        # into an lr-sized step; everything else (every Muon matrix included) agrees to < 3e-7 (seen 2e-7)
        atol = 1e-5 if n.endswith("k_proj.bias") else 3e-7
        torch.testing.assert_close(two["weights"][n], p.detach(), rtol=0, atol=atol, msg=n)


@pytest.mark.slow  # a whole (6-step) SFT run
def test_sft_with_muon_learns_through_the_cli(tiny_model_path, tmp_path):
    """`relayrl sft --optim.name muon` on the addition rows: the train loss falls (6 steps, lr 3e-3)."""
    rows = run_sft(tiny_model_path, addition_rows(tmp_path / "train.jsonl"), tmp_path / "out", "--optim.name",
                   "muon", "--train.max_steps", "6", batch_size=8)  # fmt: skip
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses


def test_a_state_dict_round_trip_continues_exactly(tiny_tokenizer):
    """Checkpoint resume: an optimizer loaded from another's state_dict (momentum, moments, step counters)
    takes the same next step, bitwise."""
    cfg = OptimConfig(name="muon", lr=0.01, weight_decay=0.1)
    a, b = _model(tiny_tokenizer), _model(tiny_tokenizer)
    opt_a, _ = build_optim(a, cfg, total_steps=3)
    ids = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    _loss(a, ids).backward()
    opt_a.step()
    b.load_state_dict(a.state_dict())
    opt_b, _ = build_optim(b, cfg, total_steps=3)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as from a file: no tensor shared with opt_a
    for m, o in ((a, opt_a), (b, opt_b)):
        o.zero_grad()
        _loss(m, ids.flip(0)).backward()
        o.step()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
