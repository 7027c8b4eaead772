"""Vision-language models (docs/vlm.md): the tiny Qwen2-VL, images in the data, the image hook of the one
forward, the frozen vision tower and what is synced to the engine, the hf engine with images, environment
images joining the next turn, images in reward functions, and the errors for bad input."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from relayrl.agents.base import AgentInstanceBase
from relayrl.agents.executors import MultiTurnExecutor
from relayrl.agents.rewards.func import RewardFuncSource
from relayrl.config.components import DataConfig, ModelConfig
from relayrl.data.batches import sft_batch
from relayrl.data.build import build_prompt_data, build_sft_data
from relayrl.data.images import load_vision
from relayrl.data.loading import DataError
from relayrl.distributed.weights.local import LocalWeights
from relayrl.models.forward import choose_layout, token_logprobs
from relayrl.models.loading import load_model_and_tokenizer
from relayrl.models.tiny_vlm import save_tiny_vlm
from relayrl.models.vlm import images_for, vision_parameter_names
from relayrl.rollout.base import GenerationRequest, SamplingParams
from relayrl.rollout.build import build_engine
from relayrl.rollout.hf import HFEngine
from relayrl.rollout.media import vision_token_ids
from relayrl.tasks.image_digit import draw_digit, png_data_uri
from relayrl.trainers.sft import next_token_loss


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture()
def vlm(vlm_path):
    return load_model_and_tokenizer(ModelConfig(name_or_path=str(vlm_path)))


def _png(path: Path, digit: str = "3", colour: int = 0) -> Path:
    Image.fromarray(draw_digit(digit, 7, 4, colour)).save(path)
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_with_image_markers_expand_to_the_processor_token_count(tmp_path, vlm):
    _, tok = vlm
    _png(tmp_path / "a.png")
    _png(tmp_path / "b.png", "7")
    chat = {"messages": [{"role": "user", "content": "<image> and <image>?"}, {"role": "assistant", "content": "37"}],
            "images": ["a.png", "b.png"]}  # fmt: skip
    plain = {"input": "digit?", "output": "3", "images": "a.png"}  # no marker: the image goes first
    data = _jsonl(tmp_path / "d.jsonl", [chat, plain])
    samples, _, _ = build_sft_data(DataConfig(datasets=[str(data)]), tok, log=lambda _: None)
    vision = load_vision(tok)
    assert vision is not None
    pad = vision.image_token_id
    first, second = samples
    assert first.images is not None and first.images.count == 2 and first.images.num_tokens() == [9, 9]
    assert first.input_ids.count(pad) == 18 and second.input_ids.count(pad) == 9
    assert first.images.sources == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    # the image tokens are never targets; the answer is
    assert not any(m for i, m in zip(first.input_ids, first.loss_mask, strict=True) if i == pad)
    assert (
        tok.decode([i for i, m in zip(first.input_ids, first.loss_mask, strict=True) if m]) == "37<|im_end|>"
    )
    # the plain row: the vision frame then the text, in that order
    text = tok.decode(second.input_ids)
    assert text.startswith("<|vision_start|>" + "<|image_pad|>" * 9 + "<|vision_end|>digit?")
    prompts, _, _ = build_prompt_data(DataConfig(datasets=[str(data)]), tok, log=lambda _: None)
    assert prompts[1].images is not None and prompts[1].prompt_ids.count(pad) == 9


def test_bad_image_inputs_are_clear_errors(tmp_path, vlm, tiny_tokenizer, tiny_model_path):
    _, tok = vlm
    missing = _jsonl(tmp_path / "m.jsonl", [{"input": "<image>x", "output": "1", "images": "nope.png"}])
    with pytest.raises(DataError, match=r"m\.jsonl, line 1: images\[0\]: image file 'nope\.png' not found"):
        build_sft_data(DataConfig(datasets=[str(missing)]), tok, log=lambda _: None)
    _png(tmp_path / "a.png")
    extra = _jsonl(tmp_path / "e.jsonl", [{"input": "<image><image>x", "output": "1", "images": "a.png"}])
    with pytest.raises(DataError, match=r"e\.jsonl, line 1: .*2 '<image>' marker\(s\) but 1 image"):
        build_sft_data(DataConfig(datasets=[str(extra)]), tok, log=lambda _: None)
    url = _jsonl(
        tmp_path / "u.jsonl", [{"input": "<image>x", "output": "1", "images": "http://x.invalid/a.png"}]
    )
    with pytest.raises(DataError, match=r"u\.jsonl, line 1: .*cannot be fetched offline.*local path"):
        build_sft_data(DataConfig(datasets=[str(url)]), tok, log=lambda _: None)
    from relayrl.models.loading import load_tokenizer

    text_tok = load_tokenizer(str(tiny_model_path))  # a text model's folder: no image processor
    with pytest.raises(DataError, match="text-only model"):
        build_sft_data(DataConfig(datasets=[str(missing)]), text_tok, log=lambda _: None)


def test_images_reach_the_forward_and_change_the_logprobs(tmp_path, vlm):
    model, tok = vlm
    assert choose_layout(model, "cpu") == "padded"
    rows = [
        {"input": "<image>digit?", "output": d, "images": png_data_uri(draw_digit(d, 7, 4, 0))} for d in "18"
    ]
    samples, _, _ = build_sft_data(DataConfig(datasets=[str(_jsonl(tmp_path / "d.jsonl", rows))]), tok,
                                   log=lambda _: None)  # fmt: skip
    same = [torch.tensor(samples[0].input_ids)] * 2  # one token sequence, two different pictures
    with torch.no_grad(), images_for([samples[0].images, samples[1].images]):
        lp, _ = token_logprobs(model, same, "padded")
    a, b = lp.view(2, -1)
    assert not torch.equal(a, b)  # the picture changes the next-token distribution
    with torch.no_grad(), images_for([samples[0].images]):  # alone == in a batch (padded rows)
        alone, _ = token_logprobs(model, same[:1], "padded")
    torch.testing.assert_close(alone, a, rtol=1e-5, atol=1e-5)  # fp32, different padding widths: 1e-5
    with pytest.raises(ValueError, match="image-pad tokens without their images"):
        token_logprobs(model, same[:1], "padded")  # pad tokens without their image: never silently text


def test_vision_tower_frozen_by_default_unchanged_by_a_step_and_never_synced(tmp_path, vlm_path):
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(vlm_path)))
    vision = set(vision_parameter_names(model))
    assert vision and all(n.startswith("model.visual.") for n in vision)
    params = dict(model.named_parameters())
    assert not any(params[n].requires_grad for n in vision)
    assert all(p.requires_grad for n, p in params.items() if n not in vision)
    before = {n: p.detach().clone() for n, p in params.items()}
    rows = [{"input": "<image>digit?", "output": "4", "images": png_data_uri(draw_digit("4", 7, 4, 1))}]
    samples, _, _ = build_sft_data(DataConfig(datasets=[str(_jsonl(tmp_path / "d.jsonl", rows))]), tok,
                                   log=lambda _: None)  # fmt: skip
    out = next_token_loss(model, sft_batch(samples, "padded"))
    (out.loss_sum / out.count).backward()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    opt.step()
    changed = {n for n, p in params.items() if not torch.equal(p, before[n])}
    assert changed and not changed & vision  # the text side moved, the tower did not
    streamed = dict(LocalWeights(model, dtype=torch.float32, stream=True).engine_tensors() or [])
    assert set(streamed) == set(params) - vision  # only trained parameters go to the engine
    trained, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(vlm_path), freeze_vision_tower=False))
    assert all(p.requires_grad for p in trained.parameters())


def test_hf_engine_generates_from_images_and_native_refuses(tmp_path, vlm):
    model, tok = vlm
    rows = [{"input": "<image>digit?", "images": png_data_uri(draw_digit(d, 7, 4, 0))} for d in "05"]
    prompts, _, _ = build_prompt_data(DataConfig(datasets=[str(_jsonl(tmp_path / "p.jsonl", rows))]), tok,
                                      log=lambda _: None)  # fmt: skip
    engine = HFEngine(model, tok, driver="loop")
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=4)

    async def run() -> list:
        reqs = [GenerationRequest(prompt_ids=p.prompt_ids, params=params, images=p.images) for p in prompts]
        return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))

    try:
        together = asyncio.run(run())
        assert engine.generate_calls == 1  # both prompts (2 images, 4 rows) in one generate call
        alone = asyncio.run(engine.generate(GenerationRequest(prompt_ids=prompts[1].prompt_ids, params=params,
                                                              images=prompts[1].images)))  # fmt: skip
    finally:
        engine.close()
    assert together[1].completions[0].token_ids == alone.completions[0].token_ids
    vision_ids = set(vision_token_ids(model))
    assert len(vision_ids) == 4  # never sampled: image / video pads, vision start / end
    assert not any(t in vision_ids for r in together for c in r.completions for t in c.token_ids)
    with pytest.raises(ValueError, match=r"native does not run vision-language models.*hf"):
        build_engine("native", model, tok)


class _ShowAgent(AgentInstanceBase):
    """Turn 1 answers; the environment shows a picture; turn 2 answers again."""

    async def step(self, states, **kwargs):
        if "<image>" in states["observation_text"] or states.get("turn_done"):
            return {"rewards": 1.0, "done": True}
        img = Image.fromarray(draw_digit("2", 7, 4, 2))
        return {
            "rewards": 0.0,
            "done": False,
            "environment_feedback": "look: <image>",
            "environment_images": [img],
        }


def test_environment_images_join_the_next_turn_and_reach_the_reward(tmp_path, vlm):
    model, tok = vlm
    rows = [{"input": "<image>digit?", "images": png_data_uri(draw_digit("9", 7, 4, 0))}]
    prompts, _, _ = build_prompt_data(DataConfig(datasets=[str(_jsonl(tmp_path / "p.jsonl", rows))]), tok,
                                      log=lambda _: None)  # fmt: skip
    engine = HFEngine(model, tok, driver="loop")
    seen: list = []
    original = engine.generate

    async def spy(request):
        seen.append(request)
        return await original(request)

    engine.generate = spy  # type: ignore[method-assign]
    ex = MultiTurnExecutor(_ShowAgent, engine, tok, max_turns=2)
    try:
        (traj,) = asyncio.run(ex.execute(prompts[0], SamplingParams(n=1, temperature=0.0, max_new_tokens=3)))
    finally:
        engine.close()
    assert traj.status == "ok", traj.error
    pad = load_vision(tok).image_token_id  # pyright: ignore[reportOptionalMemberAccess]
    assert len(seen) == 2 and seen[0].images.count == 1 and seen[1].images.count == 2
    assert seen[1].prompt_ids.count(pad) == 18 and traj.token_ids.count(pad) == 18
    assert traj.images is not None and traj.images.count == 2 and traj.images.sources == ["inline", "inline"]
    feedback = [t for t, m in zip(traj.token_ids, traj.action_mask, strict=True) if not m][
        len(prompts[0].prompt_ids) :
    ]
    assert tok.decode(feedback).startswith("look: <|vision_start|>")

    got = {}

    def reward_func(queries, prompts, labels, images, image_paths):
        got.update(images=images, paths=image_paths)
        return [float(len(im)) for im in images]

    asyncio.run(RewardFuncSource(reward_func).score([traj]))
    assert got["paths"] == [["inline", "inline"]] and len(got["images"][0]) == 2 and traj.reward == 2.0
