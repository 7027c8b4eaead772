"""Preference, reward-model, distillation and process-reward losses: hand-worked float64 values and gradients
(expected numbers from scalar `math`, not from the torch formula under test), loops over the vocabulary,
chunked == unchunked, input checks."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.preference import (
    DIVERGENCES,
    DPO_LOSSES,
    bradley_terry,
    chunked_divergence,
    dpo_rewards,
    kto,
    kto_reference_point,
    step_loss,
)

F64 = torch.float64


def t(values, grad=False):
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def close(a, b, rtol=1e-9):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=rtol, atol=1e-12)


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def softplus(x):  # log(1 + e^x) = -log sigmoid(-x)
    return math.log1p(math.exp(x))


def grad(y, x):
    return torch.autograd.grad(y.sum(), x)[0]


# ---------------------------------------------------------------------------------------------- Bradley-Terry
def test_bradley_terry_hand():
    # d = chosen - rejected = [0.7, -1.0, 0.0, 1.5]; loss = -log sigmoid(d) = log(1 + e^-d)
    # d loss / d chosen = sigmoid(d) - 1 = -1 / (1 + e^d); d loss / d rejected = +1 / (1 + e^d)
    chosen, rejected = t([1.0, -0.5, 2.0, 0.3], True), t([0.3, 0.5, 2.0, -1.2], True)
    d = [0.7, -1.0, 0.0, 1.5]
    loss, m = bradley_terry(chosen, rejected)
    close(loss, [softplus(-x) for x in d])
    assert math.isclose(loss[2].item(), math.log(2.0), rel_tol=1e-15)
    gc, gr = torch.autograd.grad(loss.sum(), (chosen, rejected))
    close(gc, [-1.0 / (1.0 + math.exp(x)) for x in d])
    close(gr, [1.0 / (1.0 + math.exp(x)) for x in d])
    close(m["acc"], [1.0, 0.0, 0.0, 1.0])  # a tie is not a win
    close(m["margin"], d)
    close(m["chosen_reward"], [1.0, -0.5, 2.0, 0.3])
    close(m["rejected_reward"], [0.3, 0.5, 2.0, -1.2])
    assert not any(v.requires_grad for v in m.values())


def test_bradley_terry_margin_hand():
    # x = d - m = [0.7 - 0.2, -1.0 - 0, 0.0 - 1.0, 1.5 - 0.5] = [0.5, -1.0, -1.0, 1.0]; loss = log(1 + e^-x)
    # the metrics ignore the margin (margin metric = d, acc = [d > 0])
    chosen, rejected = t([1.0, -0.5, 2.0, 0.3], True), t([0.3, 0.5, 2.0, -1.2])
    loss, m = bradley_terry(chosen, rejected, t([0.2, 0.0, 1.0, 0.5]))
    x = [0.5, -1.0, -1.0, 1.0]
    close(loss, [softplus(-v) for v in x])
    close(grad(loss, chosen), [sigmoid(v) - 1.0 for v in x])
    close(m["margin"], [0.7, -1.0, 0.0, 1.5])
    close(m["acc"], [1.0, 0.0, 0.0, 1.0])


def test_bradley_terry_large_margin_is_finite():
    # d = -40: loss = 40 + log(1 + e^-40) (no overflow), gradient -1 / (1 + e^-40)
    chosen = t([-20.0], True)
    loss, _ = bradley_terry(chosen, t([20.0]))
    close(loss, [40.0 + math.log1p(math.exp(-40.0))])
    close(grad(loss, chosen), [-1.0 / (1.0 + math.exp(-40.0))])


def test_bradley_terry_shape_mismatch():
    with pytest.raises(ValueError, match=r"chosen \(3,\) and rejected \(2,\)"):
        bradley_terry(t([1.0, 2.0, 3.0]), t([1.0, 2.0]))


# ---------------------------------------------------------------------------------------------- DPO family
H = [0.5, -1.0, 3.0, 0.0]


def test_dpo_hand_and_gradient():
    # beta 0.1: loss = -log sigmoid(beta h) = log(1 + e^(-beta h)); at h = 0: ln 2
    # d loss / d h = beta (sigmoid(beta h) - 1)
    h = t(H, True)
    loss = DPO_LOSSES["dpo"](h, beta=0.1)
    close(loss, [softplus(-0.1 * x) for x in H])
    assert math.isclose(loss[3].item(), math.log(2.0), rel_tol=1e-15)
    close(grad(loss, h), [0.1 * (sigmoid(0.1 * x) - 1.0) for x in H])
    # a large negative margin stays finite: beta h = -60 -> 60 + log(1 + e^-60)
    far = t([-30.0], True)
    close(DPO_LOSSES["dpo"](far, beta=2.0), [60.0 + math.log1p(math.exp(-60.0))])
    close(grad(DPO_LOSSES["dpo"](far, beta=2.0), far), [2.0 * (sigmoid(-60.0) - 1.0)])


def test_cdpo_hand_and_gradient():
    # eps 0.2, z = beta h: loss = (1 - eps) log(1 + e^-z) + eps log(1 + e^z);
    # d loss / d h = beta (sigmoid(z) - (1 - eps)): zero at sigmoid(z) = 0.8, not at h = infinity
    h = t(H, True)
    loss = DPO_LOSSES["cdpo"](h, beta=0.1, label_smoothing=0.2)
    close(loss, [0.8 * softplus(-0.1 * x) + 0.2 * softplus(0.1 * x) for x in H])
    close(grad(loss, h), [0.1 * (sigmoid(0.1 * x) - 0.8) for x in H])
    z_star = math.log(4.0)  # sigmoid(z*) = 0.8
    at_min = t([z_star / 0.1], True)
    close(grad(DPO_LOSSES["cdpo"](at_min, beta=0.1, label_smoothing=0.2), at_min), [0.0])
    close(DPO_LOSSES["cdpo"](t(H), beta=0.1, label_smoothing=0.0), DPO_LOSSES["dpo"](t(H), beta=0.1))


def test_ipo_hand_and_gradient():
    # beta 0.1: loss = (h - 1 / (2 beta))^2 = (h - 5)^2, d loss / d h = 2 (h - 5); label_smoothing ignored
    h = t(H, True)
    loss = DPO_LOSSES["ipo"](h, beta=0.1, label_smoothing=0.3)
    close(loss, [20.25, 36.0, 4.0, 25.0])
    close(grad(loss, h), [-9.0, -12.0, -4.0, -10.0])
    close(DPO_LOSSES["ipo"](t([2.5]), beta=0.2), [0.0])  # the target margin 1 / (2 beta) = 2.5


def test_dpo_registry():
    assert set(DPO_LOSSES) == {"dpo", "cdpo", "ipo"}


def test_dpo_rewards_hand():
    # chosen ratio = pc - rc = [0.5, 0.5], rejected ratio = pr - rr = [-1.0, 0.5]
    # h = [1.5, 0.0]; rewards beta * ratio (beta 0.1) = [0.05, 0.05] and [-0.1, 0.05], detached
    pc, pr = t([-3.0, -2.0], True), t([-4.0, -1.0], True)
    h, cr, rr = dpo_rewards(pc, pr, t([-3.5, -2.5]), t([-3.0, -1.5]), 0.1)
    close(h, [1.5, 0.0])
    close(cr, [0.05, 0.05])
    close(rr, [-0.1, 0.05])
    assert not cr.requires_grad and not rr.requires_grad
    gc, gr = torch.autograd.grad(h.sum(), (pc, pr))
    close(gc, [1.0, 1.0])
    close(gr, [-1.0, -1.0])
    # through the loss: d dpo / d log pi(chosen) = beta (sigmoid(beta h) - 1), the rejected side the negative
    loss = DPO_LOSSES["dpo"](h, beta=0.1)
    gc, gr = torch.autograd.grad(loss.sum(), (pc, pr))
    close(gc, [0.1 * (sigmoid(0.15) - 1.0), 0.1 * (0.5 - 1.0)])
    close(gr, [-0.1 * (sigmoid(0.15) - 1.0), -0.1 * (0.5 - 1.0)])


# ---------------------------------------------------------------------------------------------- KTO
def test_kto_hand_and_gradient():
    # r = policy - ref = [0.5, -1.0, 0.0, 0.5]; desirable [T, F, T, F]; z0 0.2, beta 0.5, lambda_D 1.5, lambda_U 0.7
    # desirable:   1.5 (1 - sigmoid(0.5 (r - 0.2)))  -> x = [0.15, -, -0.1, -]
    # undesirable: 0.7 (1 - sigmoid(0.5 (0.2 - r)))  -> y = [-, 0.6, -, -0.15]
    # d/d policy: desirable -lambda_D beta s(x)(1 - s(x)), undesirable +lambda_U beta s(y)(1 - s(y))
    policy = t([-3.0, -5.0, -2.0, -4.0], True)
    desirable = torch.tensor([True, False, True, False])
    loss, m = kto(
        policy,
        t([-3.5, -4.0, -2.0, -4.5]),
        desirable,
        0.2,
        beta=0.5,
        desirable_weight=1.5,
        undesirable_weight=0.7,
    )
    s = sigmoid
    close(loss, [1.5 * (1 - s(0.15)), 0.7 * (1 - s(0.6)), 1.5 * (1 - s(-0.1)), 0.7 * (1 - s(-0.15))])
    close(
        grad(loss, policy),
        [
            -1.5 * 0.5 * s(0.15) * (1 - s(0.15)),
            0.7 * 0.5 * s(0.6) * (1 - s(0.6)),
            -1.5 * 0.5 * s(-0.1) * (1 - s(-0.1)),
            0.7 * 0.5 * s(-0.15) * (1 - s(-0.15)),
        ],
    )
    close(m["reward"], [0.25, -0.5, 0.0, 0.25])
    assert not m["reward"].requires_grad


def test_kto_z0_as_tensor_and_zero():
    # z0 = 0, r = 0: both kinds lose lambda (1 - 1/2); a float64 tensor z0 gives the same as the float
    pol, ref = t([-1.0, -1.0]), t([-1.0, -1.0])
    good = torch.tensor([True, False])
    loss, _ = kto(pol, ref, good, 0.0, beta=0.1, desirable_weight=2.0, undesirable_weight=3.0)
    close(loss, [1.0, 1.5])
    a, _ = kto(pol + 0.3, ref, good, torch.tensor(0.1, dtype=F64), beta=0.1)
    b, _ = kto(pol + 0.3, ref, good, 0.1, beta=0.1)
    close(a, b)
    close(a, [1 - sigmoid(0.1 * 0.2), 1 - sigmoid(0.1 * -0.2)])


def test_kto_reference_point():
    # z0 = max(0, kl_sum / kl_count), detached, float64
    z = kto_reference_point(3.0, 4)
    assert z.dtype == F64 and float(z) == 0.75
    assert float(kto_reference_point(-2.0, 4)) == 0.0  # a negative mean log-ratio clamps to 0
    assert float(kto_reference_point(torch.tensor(1.5, dtype=F64), torch.tensor(3.0))) == 0.5
    assert float(kto_reference_point(0.0, 0)) == 0.0  # no KL sequences: max(count, 1)
    assert float(kto_reference_point(0.4, 0.5)) == 0.4  # count < 1 is read as 1
    s = torch.tensor(2.0, dtype=F64, requires_grad=True)
    assert not kto_reference_point(s, 4.0).requires_grad


# ---------------------------------------------------------------------------------------------- divergences
S = [[0.1, -0.4, 1.2, 0.0, 0.7], [2.0, 0.0, -1.0, 0.5, 0.5]]
T = [[0.3, 0.2, -0.5, 1.0, 0.0], [1.0, 1.0, -2.0, 0.0, 0.3]]


def probs(row):
    z = [math.exp(v) for v in row]
    return [v / sum(z) for v in z]


def kl_loop(p, q):
    return sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q, strict=True))


def jsd_loop(p, q, beta):
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q, strict=True)]
    return beta * kl_loop(p, m) + (1 - beta) * kl_loop(q, m)


def test_forward_and_reverse_kl_against_vocabulary_loops():
    # p = softmax(teacher), q = softmax(student), per row
    s, te = t(S), t(T)
    fwd = [kl_loop(probs(b), probs(a)) for a, b in zip(S, T, strict=True)]
    rev = [kl_loop(probs(a), probs(b)) for a, b in zip(S, T, strict=True)]
    close(DIVERGENCES["forward_kl"](s, te), fwd)
    close(DIVERGENCES["reverse_kl"](s, te), rev)
    close(DIVERGENCES["forward_kl"](te, s), rev)  # swapping the arguments swaps the direction
    assert all(v > 0 for v in fwd + rev)


def test_kl_gradients_closed_form():
    # d KL(p || q) / d student logits = q - p; d KL(q || p) / d student logits = q (log q - log p - KL(q || p))
    s = t(S, True)
    g = grad(DIVERGENCES["forward_kl"](s, t(T)), s)
    close(
        g, [[qv - pv for qv, pv in zip(probs(a), probs(b), strict=True)] for a, b in zip(S, T, strict=True)]
    )
    g = grad(DIVERGENCES["reverse_kl"](s, t(T)), s)
    want = []
    for a, b in zip(S, T, strict=True):
        q, p = probs(a), probs(b)
        kl = kl_loop(q, p)
        want.append([qv * (math.log(qv) - math.log(pv) - kl) for qv, pv in zip(q, p, strict=True)])
    close(g, want)


@pytest.mark.parametrize("beta", [0.5, 0.3, 0.9])
def test_jsd_against_vocabulary_loop(beta):
    # m = beta p + (1 - beta) q; jsd = beta KL(p || m) + (1 - beta) KL(q || m)
    want = [jsd_loop(probs(b), probs(a), beta) for a, b in zip(S, T, strict=True)]
    close(DIVERGENCES["jsd"](t(S), t(T), beta=beta), want)
    # the teacher weight beta becomes the student weight 1 - beta when the arguments swap
    close(DIVERGENCES["jsd"](t(T), t(S), beta=1 - beta), want)


def test_jsd_symmetric_bounded_and_zero_for_equal_distributions():
    s, te = t(S), t(T)
    close(DIVERGENCES["jsd"](s, te), DIVERGENCES["jsd"](te, s), rtol=1e-12)
    assert bool((DIVERGENCES["jsd"](s, te) < math.log(2.0)).all())  # JSD <= ln 2
    # equal distributions (logits shifted by a constant give the same softmax): every divergence is 0
    for name in DIVERGENCES:
        torch.testing.assert_close(
            DIVERGENCES[name](s, s + 3.0), torch.zeros(2, dtype=F64), rtol=0, atol=1e-15
        )
    # disjoint-ish distributions approach ln 2
    far = t([[50.0, 0.0]])
    assert math.isclose(float(DIVERGENCES["jsd"](far, far.flip(-1))), math.log(2.0), rel_tol=1e-9)


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1])
def test_jsd_beta_out_of_range(beta):
    with pytest.raises(ValueError, match=r"jsd beta must be in \(0, 1\)"):
        DIVERGENCES["jsd"](t(S), t(T), beta=beta)


# ---------------------------------------------------------------------------------------------- chunked
def kd_inputs(n=7, hidden=4, vocab=6, teacher_hidden=3):
    g = torch.Generator().manual_seed(0)
    hs = torch.randn(n, hidden, generator=g, dtype=F64, requires_grad=True)
    ws = torch.randn(vocab, hidden, generator=g, dtype=F64, requires_grad=True)
    ht = torch.randn(n, teacher_hidden, generator=g, dtype=F64)
    wt = torch.randn(vocab, teacher_hidden, generator=g, dtype=F64)
    return hs, ws, ht, wt, torch.randint(0, vocab, (n,), generator=g)


def unchunked(hs, ws, ht, wt, targets, divergence, temperature, beta):
    """The same two sums from the full [N, V] logits at once, in float64."""
    student, teacher = hs @ ws.T, ht @ wt.T
    div = DIVERGENCES[divergence](student / temperature, teacher / temperature, beta=beta).sum()
    ce = -torch.log_softmax(student, -1).gather(-1, targets[:, None]).sum()
    return div, ce


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_chunked_divergence_equals_unchunked(divergence):
    """Values and gradients (student hidden, student head) for chunks of 1, 3, N and more than N rows.

    `_chunk_terms` computes the logits' softmax in float32 (`.float()`, meant to upcast bf16), so the float64
    inputs agree with the float64 reference to float32 rounding (observed <= 3e-7 relative): rtol 1e-6
    here; the float64 contract is test_chunked_divergence_keeps_float64 below."""
    hs, ws, ht, wt, targets = kd_inputs()
    kw = {"temperature": 2.0, "beta": 0.3}
    ref_div, ref_ce = unchunked(hs, ws, ht, wt, targets, divergence, **kw)
    ref_g = torch.autograd.grad(0.4 * ref_div + 0.6 * ref_ce, (hs, ws))
    for chunk in (1, 3, 7, 11):
        div, ce = chunked_divergence(hs, ws, ht, wt, targets, divergence=divergence, chunk=chunk, **kw)
        torch.testing.assert_close(div.double(), ref_div.detach(), rtol=1e-6, atol=0)
        torch.testing.assert_close(ce.double(), ref_ce.detach(), rtol=1e-6, atol=0)
        got = torch.autograd.grad(0.4 * div + 0.6 * ce, (hs, ws))
        for a, b in zip(got, ref_g, strict=True):
            assert a.dtype == F64
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.abs().max()))


def test_chunked_divergence_teacher_gets_no_gradient():
    hs, ws, ht, wt, targets = kd_inputs()
    ht.requires_grad_(True)
    wt.requires_grad_(True)
    div, ce = chunked_divergence(hs, ws, ht, wt, targets, chunk=3)
    (div + ce).backward()
    assert ht.grad is None and wt.grad is None
    assert hs.grad is not None and ws.grad is not None


def test_chunked_divergence_keeps_float64():
    hs, ws, ht, wt, targets = kd_inputs()
    div, ce = chunked_divergence(hs, ws, ht, wt, targets, chunk=3)
    ref_div, ref_ce = unchunked(hs, ws, ht, wt, targets, "forward_kl", 1.0, 0.5)
    assert div.dtype == F64
    torch.testing.assert_close(div, ref_div, rtol=1e-12, atol=0)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-12, atol=0)


def test_chunked_divergence_bad_inputs():
    hs, ws, ht, wt, targets = kd_inputs()
    with pytest.raises(ValueError, match=r"vocabulary \(6\) and the teacher's \(5\) differ"):
        chunked_divergence(hs, ws, ht, wt[:5], targets)
    with pytest.raises(ValueError, match=r"divergence must be one of .*'tvd'"):
        chunked_divergence(hs, ws, ht, wt, targets, divergence="tvd")


# ---------------------------------------------------------------------------------------------- PRM
LOGITS = [[2.0, 0.5], [-1.0, 1.0], [0.3, 0.3], [0.0, 4.0]]
P_GOOD = [sigmoid(1.5), sigmoid(-2.0), 0.5, sigmoid(-4.0)]  # softmax([good, bad])[0] = sigmoid(good - bad)


def bce(p, y):
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


@pytest.mark.parametrize(
    ("labels", "acc"),
    [([1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]), ([0.7, 0.2, 0.5, 0.9], [1.0, 1.0, 1.0, 0.0])],
    ids=["hard", "soft"],
)
def test_step_loss_hand(labels, acc):
    # loss_k = -(y log p + (1 - y) log(1 - p)); d loss / d logit_good = p - y = -d loss / d logit_bad
    # acc = [(p > 1/2) == (y > 1/2)]: p = 1/2 is "bad", y = 1/2 is "bad"
    # (computed in float32 inside, see test_step_loss_keeps_float64: rtol 1e-6)
    logits = t(LOGITS, True)
    loss, m = step_loss(logits, t(labels))
    want = [bce(p, y) for p, y in zip(P_GOOD, labels, strict=True)]
    torch.testing.assert_close(loss.double(), t(want), rtol=1e-6, atol=0)
    g = grad(loss, logits)
    d = [p - y for p, y in zip(P_GOOD, labels, strict=True)]
    torch.testing.assert_close(g, t([[v, -v] for v in d]), rtol=1e-6, atol=1e-7)
    close(m["acc"].double(), acc)
    torch.testing.assert_close(m["p_good"].double(), t(P_GOOD), rtol=1e-6, atol=0)
    assert not m["p_good"].requires_grad


def test_step_loss_keeps_float64():
    loss, _ = step_loss(t(LOGITS), t([1.0, 0.0, 1.0, 1.0]))
    assert loss.dtype == F64
    close(loss, [bce(p, y) for p, y in zip(P_GOOD, [1.0, 0.0, 1.0, 1.0], strict=True)], rtol=1e-12)


def test_step_loss_shapes():
    with pytest.raises(
        ValueError, match=r"expected logits \[S, 2\] and labels \[S\]; got \(4, 3\) and \(4,\)"
    ):
        step_loss(torch.zeros(4, 3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"got \(4, 2\) and \(3,\)"):
        step_loss(torch.zeros(4, 2), torch.zeros(3))


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_divergences_mask_minus_inf_logits(name):
    # row 0: entry 1 masked (-inf) in both models: exactly the divergence over the other entries (0 log 0 = 0),
    # where 0 x -inf made the row NaN. Row 1: entries masked in one model only are left out of the sum
    # (OpenRLHF's KD mask); each model's softmax still normalises over its own finite entries.
    inf = -math.inf
    s = t([[0.3, inf, -1.2, 0.5], [1.0, 0.2, inf, -0.4]], True)
    te = t([[-0.7, inf, 0.4, 0.1], [0.5, -0.3, 0.9, inf]])
    got = DIVERGENCES[name](s, te)
    close(got[:1], DIVERGENCES[name](t([[0.3, -1.2, 0.5]]), t([[-0.7, 0.4, 0.1]])))
    q = [v / sum(math.exp(x) for x in (1.0, 0.2, -0.4)) for v in (math.exp(1.0), math.exp(0.2))]
    p = [v / sum(math.exp(x) for x in (0.5, -0.3, 0.9)) for v in (math.exp(0.5), math.exp(-0.3))]
    if name == "forward_kl":
        close(got[1:], [sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q, strict=True))])
    elif name == "reverse_kl":
        close(got[1:], [sum(qv * (math.log(qv) - math.log(pv)) for pv, qv in zip(p, q, strict=True))])
    assert bool(torch.isfinite(got).all())
    g = grad(got, s)
    assert bool(torch.isfinite(g).all()) and float(g[0, 1]) == 0.0


def test_chunked_divergence_t2_scale():
    # t2_scale multiplies the tempered divergence by T^2 (Hinton et al.): T = 2 -> 4x; the cross-entropy is
    # untouched
    hs, ws, ht, wt, targets = kd_inputs()
    plain, ce = chunked_divergence(hs, ws, ht, wt, targets, temperature=2.0, chunk=3)
    scaled, ce2 = chunked_divergence(hs, ws, ht, wt, targets, temperature=2.0, chunk=3, t2_scale=True)
    torch.testing.assert_close(scaled, 4.0 * plain, rtol=1e-12, atol=0)
    torch.testing.assert_close(ce2, ce, rtol=0, atol=0)
