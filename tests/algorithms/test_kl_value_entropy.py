"""KL estimators / loss / controllers, value loss, entropy: hand values, loop references, resume."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms import value_loss as exported_value_loss
from relayrl.algorithms.entropy import entropy_bonus, entropy_from_logits
from relayrl.algorithms.kl import KL_CONTROLLERS, KL_ESTIMATORS, kl_estimate, kl_loss
from relayrl.algorithms.value import value_loss

F64 = torch.float64


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=F64), rtol=1e-6, atol=1e-12)


def test_kl_estimators_hand():
    # log_ratio = logp - ref = [0.5, -1.0, 15 (clamped to 10), masked]
    # k1 = [0.5, -1, 10] ; k2 = 0.5 lr^2 = [0.125, 0.5, 50] ;
    # k3 = e^-lr - 1 + lr = [0.60653066 - 0.5, 2.71828183 - 2, e^-10 + 9]
    logp = torch.tensor([[0.5, -1.0, 15.0, 3.0]], dtype=F64)
    ref = torch.zeros_like(logp)
    mask = torch.tensor([[1, 1, 1, 0]]).bool()
    k1, m1 = kl_estimate(logp, ref, mask, estimator="k1")
    close(k1, [[0.5, -1.0, 10.0, 0.0]])
    assert m1["kl"] == pytest.approx(9.5 / 3)
    close(kl_estimate(logp, ref, mask, estimator="k2")[0], [[0.125, 0.5, 50.0, 0.0]])
    close(
        kl_estimate(logp, ref, mask, estimator="k3")[0],
        [[math.exp(-0.5) - 0.5, math.e - 2.0, math.exp(-10) + 9.0, 0.0]],
    )
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(logp, ref, mask, estimator="k4")


def test_kl_estimators_match_loop():
    gen = torch.Generator().manual_seed(0)
    lr = torch.randn(4, 6, generator=gen, dtype=F64) * 3
    mask = torch.rand(4, 6, generator=gen) < 0.7
    fns = {"k1": lambda x: x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(-x) - 1 + x}
    for name in KL_ESTIMATORS:
        got, _ = kl_estimate(lr, torch.zeros_like(lr), mask, estimator=name, clamp=4.0)
        ref = [
            [fns[name](min(max(v, -4.0), 4.0)) * m for v, m in zip(r, mr, strict=True)]
            for r, mr in zip(lr.tolist(), mask.tolist(), strict=True)
        ]
        close(got, ref)


def test_kl_loss_gradients():
    # k2 loss gradient = coef * log_ratio (the true KL gradient form); k3: coef * (1 - e^-lr)
    logp = torch.tensor([[0.5, -1.0]], dtype=F64, requires_grad=True)
    ref = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2).bool()
    loss, m = kl_loss(logp, ref, mask, coef=0.1, estimator="k2")
    close(torch.autograd.grad(loss.sum(), logp)[0], [[0.05, -0.1]])
    assert m["kl_coef"] == 0.1
    loss, _ = kl_loss(logp, ref, mask, coef=0.1, estimator="k3")
    close(torch.autograd.grad(loss.sum(), logp)[0], [[0.1 * (1 - math.exp(-0.5)), 0.1 * (1 - math.e)]])


def test_kl_controllers_and_resume():
    # adaptive: e = clip(9/6 - 1, -0.2, 0.2) = 0.2 ; beta = 0.1 * (1 + 0.2 * 64 / 10000) = 0.100128
    c = KL_CONTROLLERS["adaptive"](0.1, target=6.0, horizon=10000)
    c.update(9.0, n_steps=64)
    assert c.value == pytest.approx(0.100128, rel=1e-12)
    # then kl 3 -> e = clip(-0.5) = -0.2 ; kl 7 -> e = 1/6 ; kl 6.5 -> e = 1/12 ; factor 1 + e * 64 / 10000
    resumed = KL_CONTROLLERS["adaptive"](5.0)
    resumed.load_state_dict(c.state_dict())
    for kl in (3.0, 7.0, 6.5):
        c.update(kl, 64)
        resumed.update(kl, 64)
    assert resumed.value == c.value  # bit-exact resume
    assert resumed.value == pytest.approx(
        0.100128 * (1 - 0.00128) * (1 + (7 / 6 - 1) * 0.0064) * (1 + (6.5 / 6 - 1) * 0.0064), rel=1e-12
    )
    f = KL_CONTROLLERS["fixed"](0.05)
    f.update(100.0, 64)
    g = KL_CONTROLLERS["fixed"](0.0)
    g.load_state_dict(f.state_dict())
    assert f.value == g.value == 0.05
    with pytest.raises(ValueError, match="target"):
        KL_CONTROLLERS["adaptive"](0.1, target=None)


def test_value_loss_hand():
    # t0: v=1, old=0.5, G=2, clip 0.2 -> v_clip = 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845, grad 0
    # t1: v=2, old=2, G=1 -> both 1 -> 0.5, grad (v - G) = 1 ; t2 masked
    v = torch.tensor([[1.0, 2.0, 5.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0]], dtype=F64)
    ret = torch.tensor([[2.0, 1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]]).bool()
    loss, m = value_loss(v, old, ret, mask, clip_eps=0.2)
    close(loss, [[0.845, 0.5, 0.0]])
    close(torch.autograd.grad(loss.sum(), v)[0], [[0.0, 1.0, 0.0]])
    assert m["value_clip_frac"] == 0.5 and m["value_error"] == pytest.approx(1.0)
    loss, _ = value_loss(v, old, ret, mask, clip_eps=None)  # 0.5 (v - G)^2 = [0.5, 0.5]
    close(loss, [[0.5, 0.5, 0.0]])


def test_value_loss_matches_loop():
    gen = torch.Generator().manual_seed(2)
    v, old, ret = (torch.randn(3, 5, generator=gen, dtype=F64) for _ in range(3))
    mask = torch.rand(3, 5, generator=gen) < 0.8
    loss, _ = value_loss(v, old, ret, mask, clip_eps=0.3)
    ref = [
        [
            0.5 * max((a - g) ** 2, (o + min(max(a - o, -0.3), 0.3) - g) ** 2) * mk
            for a, o, g, mk in zip(*rows, strict=True)
        ]
        for rows in zip(v.tolist(), old.tolist(), ret.tolist(), mask.tolist(), strict=True)
    ]
    close(loss, ref)


def test_entropy_hand_and_temperature():
    # logits [0, ln 3] -> p = [1/4, 3/4]; H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623351446
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    close(entropy_from_logits(torch.tensor([0.0, math.log(3)], dtype=F64)), h)
    # temperature 2 on [0, 2 ln 3] is the same distribution
    close(entropy_from_logits(torch.tensor([0.0, 2 * math.log(3)], dtype=F64), temperature=2.0), h)
    ent = torch.tensor([[h, 1.0, 7.0]], dtype=F64)
    loss, m = entropy_bonus(ent, torch.tensor([[1, 1, 0]]).bool(), coef=0.01)
    close(loss, [[-0.01 * h, -0.01, 0.0]])
    assert m["entropy"] == pytest.approx((h + 1.0) / 2)


def test_entropy_matches_loop():
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(3, 4, 7, generator=gen, dtype=F64) * 2
    got = entropy_from_logits(z, temperature=0.7)
    ref = []
    for row in (z / 0.7).reshape(-1, 7).tolist():
        mx = max(row)
        e = [math.exp(v - mx) for v in row]
        p = [x / sum(e) for x in e]
        ref.append(-sum(q * math.log(q) for q in p))
    close(got, torch.tensor(ref, dtype=F64).reshape(3, 4))


def test_kl_loss_expected_gradients():
    # Exact expectation over a 5-token vocabulary: sum_a sg[pi(a)] * grad k(a). The claims in kl.py:
    # E[grad k1] = 0, E[grad k2] = grad KL(pi || ref), E[grad k3] = grad KL(ref || pi)
    gen = torch.Generator().manual_seed(8)
    theta = torch.randn(5, generator=gen, dtype=F64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(5, generator=gen, dtype=F64), -1)
    logp = torch.log_softmax(theta, -1)
    pi = logp.exp()
    ones = torch.ones(1, 5).bool()
    targets = {
        "k1": torch.zeros(5, dtype=F64),
        "k2": torch.autograd.grad((pi * (logp - ref)).sum(), theta, retain_graph=True)[0],
        "k3": torch.autograd.grad((ref.exp() * (ref - logp)).sum(), theta, retain_graph=True)[0],
    }
    for name, want in targets.items():
        kl, _ = kl_loss(logp[None], ref[None], ones, coef=1.0, estimator=name)
        got = torch.autograd.grad((pi.detach() * kl[0]).sum(), theta, retain_graph=True)[0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    assert float(targets["k2"].abs().max()) > 1e-3 and not torch.allclose(targets["k2"], targets["k3"])


def test_value_loss_is_exported_as_the_function():
    # the package export must not be shadowed by a submodule of the same name (it returned the module)
    assert exported_value_loss is value_loss and callable(exported_value_loss)
