"""A PPO critic for a vision-language model (relayrl.models.vlm_value): the tiny Qwen2-VL with relayrl's value
head, driven by the CriticWorker in-process on one CPU rank.

- Its values depend on the picture: the same tokens with two different pictures get different values (the
  image hook adds each row's pixels to the trunk), and the vision tower is frozen (only decoder and head train).
- Updates on one batch move the values toward the returns (the squared error falls step after step).
- A saved critic folder (the VLM's own files plus `score.weight`) gives a critic with the same values.
"""

from __future__ import annotations

import json
from itertools import pairwise
from typing import cast

import pytest
import torch

from relayrl.agents.base import Trajectory
from relayrl.config.components import DataConfig, ModelConfig, OptimConfig
from relayrl.data.build import build_sft_data
from relayrl.data.records import PromptSample
from relayrl.models.loading import load_model_and_tokenizer
from relayrl.models.tiny_vlm import save_tiny_vlm
from relayrl.models.vlm import vision_parameter_names
from relayrl.tasks.image_digit import draw_digit, png_data_uri
from relayrl.workers.base import Experience, SequenceBatch, collate
from relayrl.workers.critic import CriticSpec, CriticWorker


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only spin-wait on a busy 2-core machine (restored after each test)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm_critic") / "model")


def _spec(path, **over) -> CriticSpec:
    optim = OptimConfig(lr=over.pop("lr", 1e-3), scheduler="constant", warmup_steps=0)
    return CriticSpec(model=ModelConfig(name_or_path=str(path)), optim=optim, device="cpu", **over)


def _batch(path, tmp_path) -> SequenceBatch:
    """Two rows with the same tokens (`<image>digit?` + answer) and different pictures (a 1 and an 8)."""
    _, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(path)))
    rows = [
        {"input": "<image>digit?", "output": "1", "images": png_data_uri(draw_digit(d, 7, 4, 0))}
        for d in "18"
    ]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples, _, _ = build_sft_data(DataConfig(datasets=[str(data)]), tok, log=lambda _: None)
    ids = list(samples[0].input_ids)
    mask = [False] * (len(ids) - 2) + [True] * 2
    trajs = [
        Trajectory(
            sample=PromptSample(index=i, prompt="", prompt_ids=ids[:-2]),
            token_ids=ids,
            action_mask=mask,
            rollout_logprobs=[0.0] * len(ids),
            images=s.images,
        )
        for i, s in enumerate(samples)
    ]
    return collate(trajs, pad_id=tok.pad_token_id)


def test_vlm_critic_values_depend_on_the_picture_and_the_vision_tower_is_frozen(vlm_path, tmp_path):
    w = CriticWorker(_spec(vlm_path))
    batch = _batch(vlm_path, tmp_path)
    assert torch.equal(batch.input_ids[0], batch.input_ids[1])  # the rows differ only in their pictures
    assert (w.values(batch) == 0).all()  # a new critic's head is zero
    head = cast(torch.nn.Linear, w.model.get_submodule("score"))  # the value head the VLM critic carries
    with torch.no_grad():
        head.weight.normal_(generator=torch.Generator().manual_seed(3))
    v = w.values(batch)
    m = batch.action_mask
    assert v[m].abs().min() > 1e-3
    assert (v[0] - v[1])[m[0]].abs().max() > 1e-3  # the picture changes the value
    vision = set(vision_parameter_names(w.model))
    assert vision and all(not p.requires_grad for n, p in w.model.named_parameters() if n in vision)
    assert head.weight.requires_grad


def test_vlm_critic_loss_falls_and_its_folder_round_trips(vlm_path, tmp_path):
    w = CriticWorker(_spec(vlm_path, lr=1e-3))
    batch = _batch(vlm_path, tmp_path)
    mask = batch.action_mask
    returns = torch.where(mask, torch.tensor([[1.0], [-1.0]]).expand(mask.shape), 0.0)  # reads the picture
    vision = {
        n: p.detach().clone()
        for n, p in w.model.named_parameters()
        if n in set(vision_parameter_names(w.model))
    }
    errors, losses = [], []
    for _ in range(4):
        old = w.values(batch)
        errors.append(float(((old - returns)[mask] ** 2).mean()))
        exp = Experience(tokens=batch, advantages=torch.zeros(mask.shape), rewards=torch.zeros(2), values=old,
                         returns=returns)  # fmt: skip
        losses.append(w.update(exp)["critic/loss"])
    errors.append(float(((w.values(batch) - returns)[mask] ** 2).mean()))
    print("VLM critic squared error by update:", [round(e, 3) for e in errors])
    assert losses[0] == pytest.approx(0.5 * errors[0], rel=1e-5)  # the value loss of this batch
    assert all(b < a for a, b in pairwise(errors)), errors
    assert errors[-1] < 0.9 * errors[0], errors
    assert all(torch.equal(p, vision[n]) for n, p in w.model.named_parameters() if n in vision)  # frozen
    w.save(str(tmp_path / "critic"))
    again = CriticWorker(_spec(vlm_path, model_path=str(tmp_path / "critic")))
    torch.testing.assert_close(again.values(batch), w.values(batch), rtol=0, atol=0)
