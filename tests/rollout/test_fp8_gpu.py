"""FP8 rollout on a GPU with fp8 tensor cores (marked `gpu`; skipped without CUDA, and below compute capability
8.9): the torch._scaled_mm path against the CPU-tested emulation on the same quantised operands, the engine on
a bf16 model against the trainer's bf16 forward, the refresh, and an RL run with the fp8 engine.

Bounds: real vs emulated GEMM on the same fp8 operands differ only by accumulation order and the bf16 output
rounding (relative Frobenius error <= 1e-2); fp8 vs the bf16 GEMM by two e4m3 roundings (<= 0.08, as the CPU
test); the tiny model's engine log-probs vs the trainer's bf16 forward: mean |diff| < 0.05."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.config.presets import tiny_cpu_config
from relayrl.models import forward
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all
from relayrl.rollout.fp8 import FP8Linear, FP8Runner, fp8_supported, quantize_rows
from relayrl.rollout.native import NativeEngine
from relayrl.trainers.rl.loop import RLTrainer
from relayrl.workers.policy import PolicyWorker

DIGITS = str(Path(__file__).parents[1] / "trainers" / "data" / "digit_reward.py")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not fp8_supported(torch.device("cuda")),
        reason="needs a GPU with fp8 tensor cores (compute capability >= 8.9)",
    ),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_scaled_mm_matches_the_emulation_on_the_same_operands():
    gen = torch.Generator(device="cuda").manual_seed(0)
    lins = [torch.nn.Linear(512, n, bias=True, device="cuda", dtype=torch.bfloat16) for n in (512, 128, 128)]
    with torch.no_grad():
        for m in lins:
            m.weight.normal_(0, 0.02, generator=gen)
            m.bias.normal_(0, 0.02, generator=gen)
    real, emulated = FP8Linear(lins, emulate=False), FP8Linear(lins, emulate=True)
    assert torch.equal(real.scale, emulated.scale)
    for rows in (1, 7, 256, 1000):  # decode batch sizes and a prefill
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
        got, want = real(x), emulated(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 768)
        assert _rel(got, want) <= 1e-2
        w = torch.cat([m.weight for m in lins])
        b = torch.cat([m.bias for m in lins])
        assert 1e-3 < _rel(got, torch.nn.functional.linear(x, w, b)) < 0.08


def test_engine_on_a_bf16_model_stays_close_to_the_trainer_and_refreshes(tiny_model, tiny_tokenizer):
    model = tiny_model.to("cuda", torch.bfloat16).eval()
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ["12+34=", "hello world", "a", "The quick brown fox"]]
    engine = build_engine("native", model, tiny_tokenizer, max_slots=16, max_seq_len=96, eos_token_id=[],
                          quantization="fp8")  # fmt: skip
    assert isinstance(engine, NativeEngine)
    try:
        runner = engine.runner
        assert isinstance(runner, FP8Runner) and not runner.emulate and not runner.skipped
        print(f"activation quantiser compiled: {runner.compiled}; CUDA graphs: {engine.cuda_graphs}")
        reqs = [
            GenerationRequest(prompt_ids=p, params=SamplingParams(n=4, max_new_tokens=24, seed=i))
            for i, p in enumerate(prompts)
        ]
        results = generate_all(engine, reqs)
        seqs, spans, lps = [], [], []
        for p, r in zip(prompts, results, strict=True):
            for c in r.completions:
                seqs.append(torch.tensor(p + c.token_ids, device="cuda"))
                spans.append((len(p), len(p) + len(c.token_ids)))
                lps.append(torch.tensor(c.logprobs))
        layout = forward.choose_layout(model, "cuda")
        forward.prepare_model(model, layout)
        with torch.no_grad():
            lp, _ = forward.token_logprobs(model, seqs, layout, temperature=1.0)
        flat = forward.split_flat(lp.float().cpu(), [len(s) for s in seqs])
        diff = torch.cat([(row[a:b] - e).abs() for row, (a, b), e in zip(flat, spans, lps, strict=True)])
        print(
            f"fp8 engine vs bf16 trainer: mean |diff| {float(diff.mean()):.4g}, max {float(diff.max()):.4g}"
        )
        assert float(diff.mean()) < 0.05
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
        engine.load_weights(None, version=1)
        down = runner.fp8_down[0]
        assert down is not None
        q, s = quantize_rows(model.model.layers[0].mlp.down_proj.weight.detach())
        assert torch.equal(down.qweight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            down.scale, s[:, 0]
        )
        generate_all(engine, reqs)  # the captured graphs run on the refreshed buffers
    finally:
        engine.close()


def test_rl_run_with_the_fp8_engine(tiny_model_path, tmp_path):
    cfg = tiny_cpu_config(str(tiny_model_path), str(tmp_path / "run"), steps=3, reward=DIGITS)
    cfg = replace(
        cfg,
        train=replace(cfg.train, device="cuda"),
        rollout=replace(cfg.rollout, quantization="fp8"),
        algo=replace(cfg.algo, kl_mode="reward", kl_coef=0.01),
    )
    trainer = RLTrainer(cfg)
    canary = {}
    original_close = trainer.roles.close

    def close_after_canary():
        canary["diff"] = trainer.roles.policy.call(PolicyWorker.weight_canary)
        original_close()

    trainer.roles.close = close_after_canary
    result = trainer.fit()
    assert result.exit_code == 0 and canary["diff"] == 0.0  # the bf16 weights the fp8 copy comes from
    for h in result.history:
        print({k: round(v, 5) for k, v in h.items() if k.startswith("mismatch/")})
        assert 0.0 < h["mismatch/logprob_absdiff_mean"] < 0.05
        assert "train/is_weight_mean" in h  # TIS on by default with fp8
