"""Exact mode's batch-invariant Triton kernels (relayrl/rollout/exact_kernels.py), in Triton's interpreter on a
CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU; skipped without triton).

Two properties each: the kernel computes the function (against torch in float32: 1e-5 absolute for values of
order 1-10, the summation order being the only difference) and it is batch-invariant BIT FOR BIT (torch.equal):
a row's product alone, in a batch of 3 or of 17 rows; a token's attention output in a prefill of its whole
sequence, in a one-query decode step over a longer padded cache, and beside other queries. Then the whole
exact path through the kernels: the engine's sampled-token log-probs equal the trainer's bit for bit (fp32),
and the kernels' autograd Functions give torch's gradients (rtol 1e-4 of the largest entry).
"""

from __future__ import annotations

import functools

import pytest
import torch

from relayrl.rollout import exact
from relayrl.rollout import exact_kernels as EK
from relayrl.rollout.kernels import usable

pytestmark = pytest.mark.skipif(
    not usable(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
    reason="triton not installed (or no GPU and TRITON_INTERPRET unset)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def test_matmul_rows_are_batch_invariant():
    x, w, b = _rand(40, 80), _rand(150, 80, seed=1), _rand(150, seed=2)  # N spans two column tiles
    full = EK.matmul(x, w, b)
    assert (full - (x @ w.t() + b)).abs().max().item() <= 1e-5
    for rows in (slice(7, 8), slice(20, 23), slice(3, 20), slice(23, 40)):  # batches of 1, 3, 17, 17 rows
        assert torch.equal(EK.matmul(x[rows], w, b), full[rows])
    many = torch.cat([x, _rand(100, 80, seed=3)])  # the rows again, in a 140-row call (three row tiles)
    assert torch.equal(EK.matmul(many, w, b)[:40], full)


def test_attention_prefill_equals_decode_bitwise():
    r, t, h, hkv, d = 2, 70, 6, 2, 16  # 70 keys: two key blocks, a partial one
    q, k, v = _rand(r, t, h, d), _rand(r, hkv, t, d, seed=1), _rand(r, hkv, t, d, seed=2)
    pos = torch.arange(t, device=DEV).expand(r, t)
    prefill = EK.attention_kernel(q, k, v, pos, 0.3)
    torch.testing.assert_close(prefill, EK.attention_ref(q, k, v, pos, 0.3), rtol=0, atol=1e-5)
    cache_k, cache_v = (torch.cat([c, torch.full((r, hkv, 60, d), 1e4, device=DEV)], 2) for c in (k, v))
    for p in (0, 5, 63, 64, 69):  # one key, inside, the block edge, past it, the last
        one = EK.attention_kernel(q[:, p : p + 1], cache_k, cache_v, pos[:, p : p + 1], 0.3)  # a decode step
        assert torch.equal(one, prefill[:, p : p + 1])
    some = torch.tensor([[3, 64, 69], [69, 0, 30]], device=DEV)  # queries in another order and company
    picked = EK.attention_kernel(q.gather(1, some[..., None, None].expand(r, 3, h, d)), k, v, some, 0.3)
    assert torch.equal(picked, prefill.gather(1, some[..., None, None].expand(r, 3, h, d)))


def test_rms_norm_rows_are_batch_invariant():
    x, w = _rand(17, 96), 1 + 0.1 * _rand(96, seed=1)
    full = EK.rms_norm(x, w, 1e-6)
    assert (full - EK.rms_norm_ref(x, w, 1e-6)).abs().max().item() <= 1e-5
    for rows in (slice(4, 5), slice(0, 3)):
        assert torch.equal(EK.rms_norm(x[rows], w, 1e-6), full[rows])


def test_rope_matches_torch_per_token():
    cos, sin = _rand(40, 16, seed=1), _rand(40, 16, seed=2)
    x, pos = (
        _rand(3, 7, 5, 16),
        torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(3)).to(DEV),
    )
    full = EK.rope(x, pos, cos, sin)
    assert (full - EK.rope_ref(x, pos, cos, sin)).abs().max().item() <= 1e-5
    assert torch.equal(EK.rope(x[1:2, 4:5], pos[1:2, 4:5], cos, sin), full[1:2, 4:5])


@pytest.mark.parametrize("causal", [False, True], ids=["masked-backward", "causal-backward"])
def test_kernel_functions_give_torchs_gradients(causal):
    x, w, b = (t.requires_grad_() for t in (_rand(9, 24), _rand(12, 24, seed=1), _rand(12, seed=2)))
    q, k, v = (
        _rand(*s, seed=i).requires_grad_() for i, s in enumerate([(2, 9, 4, 8), (2, 2, 9, 8), (2, 2, 9, 8)])
    )
    pos = torch.arange(9, device=DEV).expand(2, 9)
    nw = (1 + 0.1 * _rand(12, seed=5)).requires_grad_()

    cos, sin = _rand(9, 8, seed=6), _rand(9, 8, seed=7)

    def loss(lin, att, norm, rope):
        y = norm(lin(x, w, b), nw, 1e-6)
        return (y * y.detach().cos()).sum() + (att(rope(q, pos, cos, sin), k, v, pos, 0.5) ** 2).sum()

    grads = []
    for fns in (
        (EK.linear, functools.partial(EK.attention, causal=causal), EK.rms_norm, EK.rope),
        (exact.linear, exact.attention, exact.rms_norm, EK.rope_ref),
    ):
        leaves = [x, w, b, q, k, v, nw]
        grads.append(torch.autograd.grad(loss(*fns), leaves))
    for a, ref in zip(*grads, strict=True):
        assert (a - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_kernels_are_batch_invariant_on_the_gpu():
    """bf16 at the 0.5B shapes, compiled for the GPU (what exact mode runs there): the same bitwise
    invariance; values within bf16 rounding of fp32 torch (matmul 2^-7 relative + 1e-3; attention 3e-2
    absolute: bf16 probabilities before the PV product)."""

    def bf(*shape, seed=0):
        return _rand(*shape, seed=seed).to(torch.bfloat16)

    x = bf(2000, 896)
    for n in (4864, 896):  # 64- and 32-column tiles (mm_tile_n)
        w, b = 0.05 * bf(n, 896, seed=1), bf(n, seed=2)
        full = EK.matmul(x, w, b)
        ref = x.float() @ w.float().t() + b.float()
        assert ((full.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-3).all()
        for rows in (slice(5, 6), slice(7, 10), slice(100, 117), slice(64, 128), slice(1000, 1300)):
            assert torch.equal(EK.matmul(x[rows].clone(), w, b), full[rows])
    r, t, h, hkv, d = 3, 300, 14, 2, 64
    q, k, v = bf(r, t, h, d, seed=3), bf(r, hkv, t, d, seed=4), bf(r, hkv, t, d, seed=5)
    pos = torch.arange(t, device=DEV).expand(r, t)
    prefill = EK.attention_kernel(q, k, v, pos, d**-0.5)
    assert (
        prefill.float() - EK.attention_ref(q.float(), k.float(), v.float(), pos, d**-0.5)
    ).abs().max() <= 3e-2
    ck, cv = (torch.cat([c, torch.full((r, hkv, 212, d), 3e4, device=DEV, dtype=c.dtype)], 2) for c in (k, v))
    for p in (0, 63, 64, 200, 299):  # one decode step over a padded cache (garbage past the keys)
        step = EK.attention_kernel(
            q[:, p : p + 1].contiguous(), ck, cv, pos[:, p].contiguous()[:, None], d**-0.5
        )
        assert torch.equal(step, prefill[:, p : p + 1])


def test_matmul_tile_follows_the_weight_shape_only(monkeypatch):
    """Column tiles per weight (enough programs for a decode step's one row tile: the 0.5B shape's 896-column
    projections get 32-column tiles, the MLP's 4,864 64, the head 128); "fixed" restores 128 everywhere.
    The row count never enters (batch invariance: test_matmul_rows_are_batch_invariant runs 32-column tiles)."""
    assert [EK.mm_tile_n(n) for n in (128, 896, 4864, 151936)] == [32, 32, 64, 128]
    monkeypatch.setattr(EK, "MM_TILES", "fixed")
    assert EK.mm_tile_n(896) == 128
