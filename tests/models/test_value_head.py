"""Value-head models: per-token values, RM scores, and the AutoModelForSequenceClassification round trip."""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification

from relayrl.config.components import LoraConfig, ModelConfig
from relayrl.models.loading import load_tokenizer
from relayrl.models.value_head import (
    build_value_model,
    last_token_index,
    padded_values,
    save_value_model,
    sequence_scores,
)

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0], [0, 11, 12, 13]])  # right- and left-padded rows (pad 0)
MASK = (IDS != 0).long()


def test_critic_head_starts_at_zero(tiny_model_path):
    critic = build_value_model(ModelConfig(name_or_path=str(tiny_model_path)), init="zeros")
    assert critic.score.weight.shape == (1, 64) and critic.score.bias is None
    values = padded_values(critic, IDS, MASK)
    assert values.shape == (3, 4) and values.dtype == torch.float32
    assert torch.equal(values, torch.zeros(3, 4))


def test_last_token_index_left_and_right_padding():
    assert last_token_index(MASK).tolist() == [3, 1, 3]


def test_rm_roundtrip_through_auto_sequence_classification(tmp_path, tiny_model_path):
    tok = load_tokenizer(str(tiny_model_path))
    rm = build_value_model(ModelConfig(name_or_path=str(tiny_model_path)), init="normal")
    std = float(rm.score.weight.detach().std())
    assert 0.05 < std < 0.25  # N(0, 1/sqrt(65) = 0.124)
    values = padded_values(rm, IDS, MASK)
    scores = sequence_scores(rm, IDS, MASK)
    assert torch.equal(scores, torch.stack([values[0, 3], values[1, 1], values[2, 3]]))
    save_value_model(rm, tok, tmp_path / "rm")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == 0
    torch.testing.assert_close(
        hf(input_ids=IDS, attention_mask=MASK).logits.squeeze(-1), scores, atol=1e-6, rtol=1e-6
    )
    # loading the saved value-head folder keeps its head (no re-init)
    again = build_value_model(ModelConfig(name_or_path=str(tmp_path / "rm")), init="zeros")
    torch.testing.assert_close(sequence_scores(again, IDS, MASK), scores, atol=0, rtol=0)


def test_critic_values_of_a_micro_batch_equal_each_sequence_alone(tiny_model_path):
    """The workers' critic forward (length-bucketed rows, causal, no mask) gives each sequence the values
    it gets alone, shifted to the token alignment values[t] = V(x_<t) (column 0 is 0)."""
    from relayrl.workers.base import SequenceBatch
    from relayrl.workers.model_ops import critic_values

    rm = build_value_model(ModelConfig(name_or_path=str(tiny_model_path)), init="normal")
    seqs = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    ids = torch.zeros((3, 4), dtype=torch.long)
    attn = torch.zeros((3, 4), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = True
    batch = SequenceBatch(
        input_ids=ids, attention_mask=attn, action_mask=attn, rollout_logprobs=torch.zeros(3, 4)
    )
    with torch.no_grad():
        got = critic_values(rm, batch, [0, 1, 2], "padded")
        for i, s in enumerate(seqs):
            single = padded_values(rm, torch.tensor([s]))[0]
            torch.testing.assert_close(got[i, 1 : len(s)], single[:-1], atol=1e-5, rtol=1e-5)
            assert got[i, 0] == 0 and torch.all(got[i, len(s) :] == 0)


def test_lora_critic_trains_score_and_merges(tmp_path, tiny_model_path):
    cfg = ModelConfig(name_or_path=str(tiny_model_path), lora=LoraConfig(rank=4))
    critic = build_value_model(cfg, init="normal")
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("score" in n for n in trainable)
    expect = sequence_scores(critic, IDS, MASK)
    save_value_model(critic, load_tokenizer(str(tiny_model_path)), tmp_path / "critic")
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "critic")
    torch.testing.assert_close(
        hf(input_ids=IDS, attention_mask=MASK).logits.squeeze(-1), expect, atol=1e-5, rtol=1e-5
    )
