"""The train step over FSDP2 units (relayrl.training.sharded): keep_gathered gathers each unit once per step and
updates exactly as per-micro-batch gathering does; the norm and clipping on local shards equal torch's over
DTensors; dist.keep_gathered's resolution.

Exactness: keep_gathered changes when weights are gathered, not what is computed (the same gathered values, the
same fp32 gradient accumulation, the same one reduce-scatter per step), so the updates are compared bit for
bit; so is the local-shard norm (the ops of DTensor's own norm reduction on the same numbers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keep_gathered_ranks as kg
import pytest
import torch
from rank_spawn import spawn_ranks
from torch.distributed.tensor import DTensor

from relayrl.config.base import ConfigError
from relayrl.config.dist import DistConfig
from relayrl.distributed.fsdp import full_tensors, keep_gathered
from relayrl.training.sharded import clip_, scale_, total_norm


def _gathered_at_forward(step) -> tuple[list[list[bool]], list[Any]]:
    """Per forward of a step, whether each decoder layer was already gathered when it was called (a hook that
    runs before FSDP2's own pre-forward)."""
    seen: list[list[bool]] = []
    handles = []
    for i, layer in enumerate(kg.layers(step)):

        def hook(module, args, i=i):
            if i == 0:
                seen.append([])
            seen[-1].append(kg.gathered(module))

        handles.append(layer.register_forward_pre_hook(hook, prepend=True))
    return seen, handles


def test_keep_gathered_gathers_once_per_step_and_updates_bit_for_bit_as_before(one_rank_group):
    batches = [kg.micro_batches(seed=s) for s in range(2)]
    weights, outs = {}, {}
    for keep in (False, True):
        step = kg.sharded_step(keep)
        seen, handles = _gathered_at_forward(step)
        outs[keep] = [step.step(b) for b in batches]
        for h in handles:
            h.remove()
        # 2 steps x 3 micro-batches: with keep_gathered only each step's first forward finds the layers
        # sharded; without it every forward does (they were resharded after the previous forward / backward)
        first = [False, False]
        assert seen == ([first, [True, True], [True, True]] * 2 if keep else [first] * 6), keep
        assert all(isinstance(p, DTensor) for p in step.model.parameters()), "resharded after the step"
        weights[keep] = dict(full_tensors(step.model))
        # the layers' own setting is back: a no-grad forward reshards them after it
        with torch.no_grad():
            step.model(input_ids=torch.tensor([[5, 6, 7]]))
        assert not any(kg.gathered(layer) for layer in kg.layers(step))
        step.model.reshard()  # pyright: ignore[reportAttributeAccessIssue]  (the root stays gathered)
    for a, b in zip(outs[False], outs[True], strict=True):
        assert (a.loss, a.count, a.grad_norm) == (b.loss, b.count, b.grad_norm)
    assert weights[False].keys() == weights[True].keys()
    for name, w in weights[False].items():
        assert torch.equal(w, weights[True][name]), name


def test_a_step_cut_short_leaves_every_unit_resharded_and_the_next_step_runs(one_rank_group):
    step = kg.sharded_step(True)
    batch = kg.micro_batches(seed=0)
    calls = []

    def failing(model, mb):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return kg.next_token_loss(model, mb)

    with pytest.raises(RuntimeError, match="simulated"):
        step.step(batch, failing)
    assert all(isinstance(p, DTensor) for p in step.model.parameters())
    out = step.step(batch)
    assert out.count > 0 and torch.isfinite(torch.tensor(out.loss))


def test_the_local_shard_norm_refuses_a_plain_gradient_beside_sharded_ones(one_rank_group):
    step = kg.sharded_step(False)
    for mb in kg.micro_batches(seed=0):
        kg.next_token_loss(step.model, mb).loss_sum.backward()
    grads = [p.grad for p in step.model.parameters() if p.grad is not None]
    assert isinstance(grads[0], DTensor)
    with pytest.raises(ValueError, match="a plain tensor"):
        total_norm([*grads, torch.ones(3)])


def test_norm_clip_and_scale_of_plain_tensors_equal_torch():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(2, 2, 2, generator=g)]
    want = [t.clone() for t in grads]
    norm = total_norm(grads)
    assert torch.equal(norm, torch.nn.utils.get_total_norm(want, foreach=True))
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in want]
    for p, t in zip(params, want, strict=True):
        p.grad = t
    torch.nn.utils.clip_grads_with_norm_(params, 0.5, norm, foreach=True)
    clip_(grads, 0.5, norm)
    scale_(grads, 0.25)
    for a, b in zip(grads, want, strict=True):
        assert torch.equal(a, b * 0.25)


@pytest.mark.slow  # two spawned processes
def test_local_shard_norm_and_keep_gathered_over_two_ranks(tmp_path: Path):
    """2 gloo ranks, each with its own micro-batches: keep_gathered on and off give bit-equal steps and weights
    with 1 all-gather per unit a step (3 units: root + 2 layers) instead of 2 per micro-batch and layer plus
    the root's 1; the local-shard norm equals DTensor's, and clipping with it equals clipping with DTensor's.
    The same steps with the model replicated (dist.replicate) update as the sharded ones, the replicas stay
    bit-identical, and a replica that drifts is caught."""
    world = 2
    spawn_ranks(kg.rank_main, (world, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        before, after = got[False], got[True]
        assert before["outs"] == after["outs"]
        for name, w in before["weights"].items():
            assert torch.equal(w, after["weights"][name]), name
        assert before["gathers"] == [3 * (2 * 2 + 1)] * 2  # 3 micro-batches: 2 layers x (fwd + bwd) + root
        assert after["gathers"] == [3, 3]
        assert before["sharded_after"] and after["sharded_after"]
        ref, new = got["norm"]
        assert ref == new and ref > 0.5  # > the clip: clipping scaled the gradients
        assert got["clipped_equal"]
        # dist.replicate: the whole model on each rank, gradients summed once a step, equals the sharded update
        # (the same fp32 sums in another order: AdamW divides by sqrt(v), so a last-bit difference in a tiny
        # gradient moves a weight by up to ~2e-6 here; 2e-5 is 0.2% of one step of lr 1e-2, while ranks that
        # did not sum their gradients differ by the size of a whole step)
        rep = got["replicated"]
        for (loss, count, norm), (loss_s, count_s, norm_s) in zip(rep["outs"], before["outs"], strict=True):
            assert count == count_s and loss == pytest.approx(loss_s, rel=1e-6), (loss, loss_s)
            assert norm == pytest.approx(norm_s, rel=1e-5), (norm, norm_s)
        for name, w in rep["weights"].items():
            diff = (w - before["weights"][name]).abs().max().item()
            assert diff <= 2e-5, (name, diff)
        assert "replicated ranks' weights differ" in rep["caught"], rep["caught"]
    one, two = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False)["replicated"] for r in range(world))
    for name, w in one["weights"].items():  # the replicas stay bit-identical
        assert torch.equal(w, two["weights"][name]), name


def test_keep_gathered_resolution(monkeypatch):
    model = torch.nn.Linear(1000, 1000)  # 1,001,000 parameters: 2.0 MB in bf16, 4.0 MB in fp32
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert keep_gathered(None, model, cpu, "fp32")
    assert not keep_gathered(DistConfig(offload=True), model, cpu, "fp32")
    assert keep_gathered(DistConfig(offload=True, keep_gathered="yes"), model, cpu, "fp32")
    assert not keep_gathered(DistConfig(keep_gathered="no"), model, cpu, "fp32")

    class Props:
        total_memory = 16 * 2_002_000  # the bf16 weights are exactly 1/16 of it

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())
    assert keep_gathered(None, model, gpu, "bf16")
    assert not keep_gathered(None, model, gpu, "fp32")  # twice the bytes
    with pytest.raises(ConfigError, match="keep_gathered"):
        DistConfig(keep_gathered="maybe")  # pyright: ignore[reportArgumentType]
