"""relayrl/workers/critic.py: the CriticWorker in-process on one CPU rank, over the tiny model folder.

- A new critic has a zero value head: every value is exactly 0.
- values(batch) equal the value head applied by hand to an independent forward of each row alone,
  shifted by one (values[:, t] = V(x_<t) = score(hidden[t - 1])), 0 off the action mask, however the rows are
  micro-batched; a critic initialised from critic.model_path (a value-head folder) keeps that folder's head.
- update: the reported loss is the hand value loss 0.5 * mean (V - R)^2 over action tokens (values = old
  values, so no clipping), value_error its mean square, value_clip_frac 0; updates on the same batch move the
  values toward the returns (the squared error falls step after step); epochs x mini_batches steps.
- save / load round-trips the values and the optimizer state.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from relayrl.agents.base import Trajectory
from relayrl.config.components import ModelConfig, OptimConfig
from relayrl.data.records import PromptSample
from relayrl.models.tiny import save_tiny_reward_model
from relayrl.workers.base import Experience, SequenceBatch, collate
from relayrl.workers.critic import CriticSpec, CriticWorker


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only spin-wait on a busy 2-core machine (restored after each test)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _spec(path, **over) -> CriticSpec:
    optim = OptimConfig(lr=over.pop("lr", 1e-3), scheduler="constant", warmup_steps=0)
    return CriticSpec(model=ModelConfig(name_or_path=str(path)), optim=optim, device="cpu", **over)


def _batch(seed: int = 0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = (9, 12, 6)
    masks = [
        [False] * 4 + [True] * 5,
        [False] * 3 + [True] * 3 + [False] * 2 + [True] * 4,  # environment tokens between two actions
        [False] * 3 + [True] * 3,
    ]
    trajs = []
    for i, (n, m) in enumerate(zip(lengths, masks, strict=True)):
        ids = torch.randint(4, 90, (n,), generator=g).tolist()
        sample = PromptSample(index=i, prompt="", prompt_ids=ids[:2])
        trajs.append(Trajectory(sample=sample, token_ids=ids, action_mask=m, rollout_logprobs=[0.0] * n))
    return collate(trajs, pad_id=0)


def _by_hand(model: torch.nn.Module, batch: SequenceBatch) -> torch.Tensor:
    """[B, T]: score(hidden of token t - 1) at column t, 0 at column 0, past the row and off the mask."""
    out = torch.zeros(batch.input_ids.shape)
    with torch.no_grad():
        for i, n in enumerate(batch.lengths):
            hidden = model.model(input_ids=batch.input_ids[i, :n][None]).last_hidden_state[0]
            v = model.score(hidden)[:, 0].float()
            out[i, 1:n] = v[: n - 1]
    return torch.where(batch.action_mask, out, torch.zeros_like(out))


def _sq_err(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((values - returns)[mask] ** 2).mean())


def test_new_critic_values_are_zero(tiny_model_path):
    w = CriticWorker(_spec(tiny_model_path))
    v = w.values(_batch())
    assert v.shape == _batch().input_ids.shape and v.dtype == torch.float32
    assert (v == 0).all()


@pytest.mark.parametrize("budget", [4096, 8])
def test_values_equal_the_head_applied_by_hand(tiny_model_path, budget):
    w = CriticWorker(_spec(tiny_model_path, micro_batch_tokens=budget))
    with torch.no_grad():
        w.model.score.weight.normal_(generator=torch.Generator().manual_seed(3))
    batch = _batch()
    got = w.values(batch)
    want = _by_hand(w.model, batch)
    assert want.abs().max() > 1e-2  # the head is not zero any more: the comparison means something
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_critic_from_a_value_head_folder_keeps_its_head(tiny_model_path, tmp_path):
    rm = save_tiny_reward_model(tmp_path / "rm")
    w = CriticWorker(_spec(tiny_model_path, model_path=str(rm)))
    batch = _batch(1)
    independent = AutoModelForSequenceClassification.from_pretrained(rm)
    want = _by_hand(independent, batch)
    assert want.abs().max() > 1e-2
    torch.testing.assert_close(w.values(batch), want, rtol=1e-5, atol=1e-5)


def test_update_reports_the_hand_loss_and_moves_values_toward_returns(tiny_model_path):
    w = CriticWorker(_spec(tiny_model_path, lr=3e-3))
    batch = _batch()
    mask = batch.action_mask
    g = torch.Generator().manual_seed(4)
    returns = torch.where(mask, 1.0 + 0.5 * torch.randn(mask.shape, generator=g), 0.0)
    errors = []
    for step in range(3):
        old = w.values(batch)
        errors.append(_sq_err(old, returns, mask))
        exp = Experience(
            tokens=batch,
            advantages=torch.zeros(mask.shape),
            rewards=torch.zeros(3),
            values=old,
            returns=returns,
        )
        m = w.update(exp)
        if step == 0:
            assert m["critic/loss"] == pytest.approx(0.5 * errors[0], rel=1e-5)
            assert m["critic/value_error"] == pytest.approx(errors[0], rel=1e-5)
            assert m["critic/value_clip_frac"] == 0.0
            assert m["critic/grad_norm"] > 0
    errors.append(_sq_err(w.values(batch), returns, mask))
    assert all(b < a for a, b in pairwise(errors)), errors
    assert errors[-1] < 0.9 * errors[0], errors


def test_update_runs_epochs_times_mini_batches_steps(tiny_model_path):
    w = CriticWorker(_spec(tiny_model_path, epochs=2, mini_batches=3))
    batch = _batch()
    old = w.values(batch)
    returns = torch.where(batch.action_mask, 1.0, 0.0)
    exp = Experience(tokens=batch, advantages=old, rewards=torch.zeros(3), values=old, returns=returns)
    w.update(exp)
    assert {int(s["step"]) for s in w.train.optimizer.state.values()} == {6}


def test_save_load_round_trip(tiny_model_path, tmp_path):
    w = CriticWorker(_spec(tiny_model_path))
    batch = _batch()
    old = w.values(batch)
    returns = torch.where(batch.action_mask, 1.0, 0.0)
    w.update(Experience(tokens=batch, advantages=old, rewards=torch.zeros(3), values=old, returns=returns))
    w.save(str(tmp_path / "critic"))
    assert (tmp_path / "critic" / "worker_state.pt").is_file()

    w2 = CriticWorker(_spec(tiny_model_path))
    w2.load(str(tmp_path / "critic"))
    v1, v2 = w.values(batch), w2.values(batch)
    assert v1.abs().max() > 0
    assert torch.equal(v1, v2)
    s1 = w.train.optimizer.state_dict()["state"]
    s2 = w2.train.optimizer.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        assert torch.equal(s1[k]["exp_avg"], s2[k]["exp_avg"])
        assert torch.equal(s1[k]["exp_avg_sq"], s2[k]["exp_avg_sq"])
