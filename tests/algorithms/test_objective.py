"""PolicyObjective / ValueObjective: the registry pieces composed into one micro-batch's (loss_sum, count,
metrics), against hand-worked values in float64 (rtol 1e-12), plus micro-batch invariance; on the meta device
the whole objective runs without a host read (what keeps a GPU update's micro-batch loop free of syncs)."""

from __future__ import annotations

import math

import pytest
import torch

from relayrl.algorithms.objective import PolicyObjective, PolicyTerms, ValueObjective, ValueTerms

F64 = torch.float64
# two rows, three positions; 4 action tokens: (0, 0), (0, 1), (1, 0), (1, 2)
MASK = torch.tensor([[True, True, False], [True, False, True]])
ADV = torch.tensor([[1.0, -2.0, 0.0], [0.5, 0.0, 3.0]], dtype=F64)
LOGP = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]], dtype=F64)


def close(a, b):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), rtol=1e-12, atol=1e-12
    )


def close32(a, b):
    """Metric sums: a float metric times the float32 action-token count, so float32 precision."""
    torch.testing.assert_close(float(a), float(b), rtol=1e-6, atol=1e-12)


def _terms(**kw) -> PolicyTerms:
    logprobs = LOGP.clone().requires_grad_(True)
    base = dict(logprobs=logprobs, action_mask=MASK, advantages=ADV, rollout_logprobs=LOGP - 0.1)
    return PolicyTerms(**(base | kw))


def test_on_policy_ppo_is_minus_the_advantage_summed_over_action_tokens():
    t = _terms()
    out = PolicyObjective()(t)
    # ratio 1 (old = detached current): loss_t = -A_t; token_mean counts action tokens
    close(out.loss_sum, -(1.0 - 2.0 + 0.5 + 3.0))
    close(out.count, 4.0)
    out.loss_sum.backward()
    close(t.logprobs.grad, -ADV * MASK)  # d(-r A)/d log pi = -r A = -A at r = 1; 0 off the mask
    m = out.metrics
    close(m["clip_frac"], 0.0)
    close(m["ratio_mean"], 4.0)  # a mean over tokens, stored as a sum over the 4 tokens
    close(m["approx_kl"], 0.0)
    close(m["logprob_diff"], 4 * 0.1)  # |trainer - engine| per action token
    close(m["policy_loss"], -2.5)
    assert set(out.metric_counts) == set(m) - {"policy_loss"}  # policy_loss is over `count`
    assert all(float(c) == 4.0 for c in out.metric_counts.values())


def test_kl_and_entropy_terms_join_the_per_token_loss():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    t = _terms(ref_logprobs=LOGP + 0.2, entropy=entropy)
    out = PolicyObjective(kl_loss_estimator="k1", entropy_coef=0.01)(t, kl_coef=0.5)
    # + 0.5 * k1 = 0.5 * (log pi - log ref) = 0.5 * -0.2 per token; - 0.01 * H over H = 1 + 2 + 4 + 6
    close(out.loss_sum, -2.5 + 4 * (0.5 * -0.2) - 0.01 * 13.0)
    out.loss_sum.backward()
    close(t.logprobs.grad, (-ADV + 0.5) * MASK)  # the KL term's gradient is its coefficient (entropy is data)
    close32(out.metrics["kl_loss"], 4 * -0.2)
    close(out.metrics["entropy"], 13.0)


def test_entropy_without_a_coefficient_and_an_estimator_without_ref_change_nothing():
    entropy = torch.full((2, 3), 7.0, dtype=F64)
    out = PolicyObjective(kl_loss_estimator="k3")(_terms(entropy=entropy), kl_coef=1.0)
    close(out.loss_sum, -2.5)
    close(out.metrics["entropy"], 4 * 7.0)  # still reported
    assert "kl_loss" not in out.metrics


def test_a_stale_policy_is_clipped_where_the_advantage_is_positive():
    old = LOGP - 0.5  # ratio e^0.5 > 1 + 0.2 on every token
    out = PolicyObjective(policy_loss="ppo", eps_low=0.2)(_terms(old_logprobs=old))
    r = math.exp(0.5)
    # A > 0: -min(r A, 1.2 A) = -1.2 A (clipped); A = -2 < 0: -min(-2r, -2.4) = 2r (not clipped)
    close(out.loss_sum, -1.2 * (1.0 + 0.5 + 3.0) + 2 * r)
    close(out.metrics["clip_frac"], 3.0)  # 3 of 4 tokens, as a sum over the 4
    close32(out.metrics["ratio_mean"], 4 * r)


def test_sequence_mean_aggregation_counts_sequences():
    out = PolicyObjective(aggregation="seq_mean_token_mean")(_terms())
    close(out.loss_sum, (-1.0 + 2.0) / 2 + (-0.5 - 3.0) / 2)  # each row's token mean, summed
    close(out.count, 2.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_add_up_to_the_whole_batch(aggregation):
    old = LOGP - 0.3
    objective = PolicyObjective(aggregation=aggregation)
    whole = _terms(old_logprobs=old)
    out = objective(whole)
    (out.loss_sum / out.count).backward()
    rows = [slice(0, 1), slice(1, 2)]
    logprobs = LOGP.clone().requires_grad_(True)
    parts = [
        objective(
            PolicyTerms(
                logprobs=logprobs[r],
                action_mask=MASK[r],
                advantages=ADV[r],
                rollout_logprobs=(LOGP - 0.1)[r],
                old_logprobs=old[r],
            )
        )
        for r in rows
    ]
    total = sum(p.count for p in parts)
    (sum(p.loss_sum for p in parts) / total).backward()
    close(sum(p.loss_sum for p in parts) / total, out.loss_sum / out.count)
    close(logprobs.grad, whole.logprobs.grad)


def test_unknown_registry_names_list_the_choices():
    with pytest.raises(ValueError, match=r"policy_loss='nope'; choose one of ppo"):
        PolicyObjective(policy_loss="nope")
    with pytest.raises(ValueError, match=r"aggregation='mean'; choose one of token_mean"):
        PolicyObjective(aggregation="mean")
    with pytest.raises(ValueError, match=r"off_policy='x'; choose one of none"):
        PolicyObjective(off_policy="x")


def test_value_objective_is_the_clipped_value_loss_token_mean():
    values = torch.tensor([[1.0, 2.0, 9.0]], dtype=F64, requires_grad=True)
    terms = ValueTerms(
        values=values,
        old_values=torch.tensor([[0.5, 2.0, 0.0]], dtype=F64),
        returns=torch.tensor([[2.0, 1.0, 0.0]], dtype=F64),
        action_mask=torch.tensor([[True, True, False]]),
    )
    out = ValueObjective(clip_eps=0.2)(terms)
    # token 0: v_clip = 0.5 + 0.2 = 0.7, max((1 - 2)^2, (0.7 - 2)^2) = 1.69 (clipped); token 1: (2 - 1)^2 = 1
    close(out.loss_sum, 0.5 * 1.69 + 0.5 * 1.0)
    close(out.count, 2.0)
    close(out.metrics["value_clip_frac"], 1.0)  # 1 of 2 tokens, as a sum over the 2
    close(out.metrics["value_error"], 2.0)  # unclipped squared errors 1 + 1
    out.loss_sum.backward()
    # clipped token: the clipped branch has no gradient in v beyond the clip; unclipped: v - G = 1
    close(values.grad, torch.tensor([[0.0, 1.0, 0.0]], dtype=F64))
    unclipped = ValueObjective(clip_eps=None)(terms)
    close(unclipped.loss_sum, 0.5 * 1.0 + 0.5 * 1.0)


def test_policy_objective_reads_nothing_back_to_the_host():
    """On the meta device any host read (.item(), bool(), float(), .tolist()) raises: the whole objective
    (checks, PPO clip, k3 KL loss, entropy, TIS weights and every metric) must stay on the device."""
    meta = torch.device("meta")
    shape = (3, 5)
    terms = PolicyTerms(
        logprobs=torch.zeros(shape, device=meta, requires_grad=True),
        action_mask=torch.ones(shape, dtype=torch.bool, device=meta),
        advantages=torch.zeros(shape, device=meta),
        rollout_logprobs=torch.zeros(shape, device=meta),
        old_logprobs=torch.zeros(shape, device=meta),
        entropy=torch.zeros(shape, device=meta),
        ref_logprobs=torch.zeros(shape, device=meta),
    )
    obj = PolicyObjective(
        aggregation="seq_mean_token_mean",
        kl_loss_estimator="k3",
        entropy_coef=0.01,
        off_policy="tis",
        dual_clip=3.0,
    )
    out = obj(terms, kl_coef=0.1)
    assert out.loss_sum.device == meta
    assert {"clip_frac", "kl_loss", "entropy", "is_weight_mean", "policy_loss"} <= set(out.metrics)
    assert all(isinstance(v, torch.Tensor) and v.device == meta for v in out.metrics.values())
