"""relayrl/workers/reference.py: the frozen ReferenceWorker in-process on one CPU rank.

- Its log-probs equal an independent forward's log_softmax(logits / T) at the sampling temperature T, 0 off
  the action mask, however the rows are micro-batched; it holds no trainable parameter.
- Before any update they equal the policy's (the same weights; with LoRA too, whose adapters start at zero);
  after policy updates they stay exactly what they were while the policy's move.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from relayrl.agents.base import Trajectory
from relayrl.config.components import LoraConfig
from relayrl.config.presets import tiny_cpu_config
from relayrl.data.records import PromptSample
from relayrl.trainers.rl.validate import validate_rl
from relayrl.workers.base import Experience, SequenceBatch, collate
from relayrl.workers.policy import PolicySpec, PolicyWorker
from relayrl.workers.reference import ReferenceSpec, ReferenceWorker


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only spin-wait on a busy 2-core machine (restored after each test)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(seed: int = 0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = (9, 12, 6, 10)
    trajs = []
    for i, n in enumerate(lengths):
        ids = torch.randint(4, 90, (n,), generator=g).tolist()
        mask = [False] * 3 + [True] * (n - 3)
        if n == 12:
            mask[6:8] = [False, False]  # environment tokens
        sample = PromptSample(index=i, prompt="", prompt_ids=ids[:3])
        trajs.append(Trajectory(sample=sample, token_ids=ids, action_mask=mask, rollout_logprobs=[0.0] * n))
    return collate(trajs, pad_id=0)


def _policy(path, out, temperature: float, lora: int = 0) -> PolicyWorker:
    cfg = validate_rl(tiny_cpu_config(str(path), str(out)))
    model = replace(cfg.model, lora=LoraConfig(rank=lora, alpha=2 * lora or 16))
    return PolicyWorker(
        PolicySpec(
            model=model,
            optim=cfg.optim,
            algo=cfg.algo,
            rollout=replace(cfg.rollout, temperature=temperature, prompts_per_step=1, n_samples=1),
            eval=cfg.eval,
            device="cpu",
        )
    )


@pytest.mark.parametrize(("temperature", "budget"), [(1.0, 4096), (0.6, 10)])
def test_logprobs_equal_an_independent_forward(tiny_model_path, temperature, budget):
    ref = ReferenceWorker(
        ReferenceSpec(
            model=validate_rl(tiny_cpu_config(str(tiny_model_path), "unused")).model,
            temperature=temperature,
            micro_batch_tokens=budget,
            device="cpu",
        )
    )
    assert not any(p.requires_grad for p in ref.model.parameters())
    batch = _batch()
    got = ref.logprobs(batch)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    want = torch.zeros(batch.input_ids.shape)
    with torch.no_grad():
        for i, n in enumerate(batch.lengths):
            row = batch.input_ids[i, :n]
            logp = torch.log_softmax(fresh(input_ids=row[None]).logits[0, :-1].float() / temperature, -1)
            want[i, 1:n] = logp.gather(1, row[1:, None]).squeeze(1)
    want = torch.where(batch.action_mask, want, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[~batch.action_mask] == 0).all()


@pytest.mark.parametrize("lora", [0, 4])
def test_reference_equals_policy_before_and_stays_fixed_after_updates(tiny_model_path, tmp_path, lora):
    temperature = 0.8
    policy = _policy(tiny_model_path, tmp_path, temperature, lora=lora)
    ref = ReferenceWorker(
        ReferenceSpec(model=policy.spec.model, temperature=temperature, micro_batch_tokens=16, device="cpu")
    )
    assert not any("lora_" in n for n, _ in ref.model.named_parameters())
    batch = _batch(1)
    before = ref.logprobs(batch)
    torch.testing.assert_close(before, policy.logprobs(batch), rtol=1e-6, atol=1e-6)

    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        adv = torch.where(batch.action_mask, torch.randn(batch.input_ids.shape, generator=g), 0.0)
        policy.update(Experience(tokens=batch, advantages=adv, rewards=torch.zeros(4)), kl_coef=0.0)

    assert torch.equal(ref.logprobs(batch), before)  # the reference never moves
    moved = (policy.logprobs(batch) - before).abs().max()
    assert moved > 1e-3  # while the policy did: the equality above could have failed
