"""Exact on-policy mode on a GPU, in the RL trainer's setup on a Qwen2-0.5B-shaped random model: the engine runs
a bf16 copy with CUDA graphs; the trainer runs fp32 master weights under bf16 autocast through the exact
layout. Sampled-token log-probs must be bit-equal (torch.equal), across two batch compositions; the default
mode's mismatch is reported beside it (it is not zero). Skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.models import forward
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def models():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        master = Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in master.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    return master, copy.deepcopy(master).to(torch.bfloat16)


def _run(engine_model, prompts, order, slots, exact=True):
    engine = build_engine(
        "native", engine_model, None, max_slots=slots, max_seq_len=320, eos_token_id=[], exact=exact
    )
    reqs = [
        GenerationRequest(prompt_ids=prompts[i], params=SamplingParams(n=4, max_new_tokens=40, seed=i))
        for i in order
    ]
    try:
        return dict(zip(order, generate_all(engine, reqs), strict=True))
    finally:
        engine.close()


def _diffs(master, prompts, results, layout):
    seqs, spans, eng = [], [], []
    for i, res in results.items():
        for c in res.completions:
            seqs.append(torch.tensor(prompts[i] + c.token_ids))
            spans.append((len(prompts[i]), len(prompts[i]) + len(c.token_ids)))
            eng.append(torch.tensor(c.logprobs))
    forward.prepare_model(master, layout)
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        lp, _ = forward.token_logprobs(master, seqs, layout)
    flat = forward.split_flat(lp.float().cpu(), [len(s) for s in seqs])
    return [row[a:b] - e for row, (a, b), e in zip(flat, spans, eng, strict=True)]


def test_engine_and_trainer_logprobs_are_bit_equal_in_bf16(models):
    master, engine_model = models
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 151936, (n,), generator=gen).tolist() for n in (5, 17, 64, 130, 250, 33)]
    every = _run(engine_model, prompts, list(range(6)), slots=24)
    diffs = _diffs(master, prompts, every, "exact")
    worst = max(float(d.abs().max()) for d in diffs)
    assert worst == 0.0, f"exact mode: max |engine - trainer| = {worst}"
    few = _run(engine_model, prompts, [4, 1], slots=8)  # other decode batch sizes, prefill widths, graphs
    for i, res in few.items():
        for a, b in zip(every[i].completions, res.completions, strict=True):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    default = _diffs(
        master,
        prompts,
        _run(engine_model, prompts, list(range(6)), 24, exact=False),
        forward.choose_layout(master, "cuda"),
    )
    print("default-mode max |diff|", max(float(d.abs().max()) for d in default))
