"""FP8 rollout on a GPU with fp8 tensor cores (marked `gpu`; skipped without CUDA, and below compute capability
8.9): the torch._scaled_mm path against the CPU-tested emulation on the same quantised operands, the engine on
a bf16 model against the trainer's bf16 forward, the refresh, and an RL run with the fp8 engine.

Bounds: real vs emulated GEMM on the same fp8 operands differ only by accumulation order and the bf16 output
rounding (relative Frobenius error <= 1e-2, fast or slow accumulation); fp8 vs the bf16 GEMM by two e4m3
roundings (<= 0.08, as the CPU test; at 7B widths in [0.02, 0.05]); the Triton quantiser (fp8_kernels.py) equals
fp8.quantize_rows byte for byte on bf16 rows, and silu(gate) * up's in >= 99.9% of bytes with every other one
step away (the kernel's exp is an approximation); the tiny model's engine log-probs vs the trainer's bf16
forward: mean |diff| < 0.05, with every CUDA graph captured and no torch.compile."""

from __future__ import annotations

import importlib.metadata
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from relayrl.config.presets import tiny_cpu_config
from relayrl.models import forward
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, fp8_kernels, generate_all
from relayrl.rollout.fp8 import FP8Linear, FP8Runner, fp8_supported, quantize_rows, silu_mul_quantize
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


@pytest.mark.parametrize(("fast_accum", "gemm"), [(True, "cutlass"), (False, "cutlass"), (True, "cublas")])
def test_scaled_mm_at_7b_widths(fast_accum, gemm):
    """q/k/v (4608 x 3584, bias) and down (3584 x 18944) at decode and prefill row counts, through each GEMM
    backend (fp8.GEMM): the real GEMM against the emulation (<= 1e-2) and against the exact product of the bf16
    operands ([0.02, 0.05])."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for k, sizes, bias in ((3584, (3584, 512, 512), True), (18944, (3584,), False)):
        lins = [torch.nn.Linear(k, n, bias=bias, device="cuda", dtype=torch.bfloat16) for n in sizes]
        with torch.no_grad():
            for m in lins:
                m.weight.normal_(0, 0.02, generator=gen)
                if bias:
                    m.bias.normal_(0, 0.02, generator=gen)
        real = FP8Linear(lins, emulate=False, quantizer=fp8_kernels.quantize_rows, kernels=True,
                         fast_accum=fast_accum, gemm=gemm)  # fmt: skip
        emulated = FP8Linear(lins, emulate=True)
        assert torch.equal(real.scale, emulated.scale)
        w = torch.cat([m.weight for m in lins]).float()
        b = torch.cat([m.bias for m in lins]).float() if bias else None
        for rows in (1, 256, 4096):
            x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
            got = real(x)
            assert _rel(got, emulated(x)) <= 1e-2, (k, rows)
            exact = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
            assert 0.02 < _rel(got, exact) < 0.05, (k, rows)


def _triton_version() -> str:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _quant_diff(x, q, s, want_q, want_s) -> str:
    """What differs between a kernel's (q, s) and the torch function's: byte count, scale rel diff, the first
    differing entries (input, x / s in fp64, both bytes as e4m3 values)."""
    qb, wb = q.view(torch.uint8), want_q.view(torch.uint8)
    bad = (qb != wb).nonzero().tolist()
    rel = float(((s - want_s).abs() / want_s).max())
    rows_s = int((s != want_s).sum())
    xor = (qb ^ wb)[qb != wb]
    kinds = {
        "sign only (0x80)": int((xor == 0x80).sum()),
        "one step": int(((qb.int() - wb.int()).abs() == 1).sum()),
    }
    parts = [f"{len(bad)} of {qb.numel()} bytes differ in {len({r for r, _ in bad})} rows ({kinds}); scale "
             f"differs in {rows_s} rows (max rel diff {rel:.3g}); triton {_triton_version()}"]  # fmt: skip
    for r, c in bad[:6]:
        v = float(x[r, c].float()) / float(want_s[r, 0])
        parts.append(f"[{r},{c}] x={float(x[r, c].float())!r} x/s={v!r} kernel 0x{int(qb[r, c]):02x}="
                     f"{float(q[r, c].float())!r} torch 0x{int(wb[r, c]):02x}={float(want_q[r, c].float())!r}")  # fmt: skip
    return "; ".join(parts)


def test_quantiser_kernels_match_the_torch_functions_on_bf16(monkeypatch):
    """Byte-equal; on a failure the message says which m, how many bytes / scales differ and shows the first
    differing entries, and whether the two-pass kernel path (ONE_PASS off) agrees, which isolates that path."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    for m in (1, 256, 4096):
        x = torch.randn(m, 3584, device="cuda", generator=gen).to(torch.bfloat16)
        x[0, 5] = 300.0  # an outlier
        q, s = fp8_kernels.quantize_rows(x)
        want_q, want_s = quantize_rows(x)
        ok = torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
        if not ok:
            with monkeypatch.context() as mp:
                mp.setattr(fp8_kernels, "ONE_PASS_MAX", 0)  # the two-pass path on the same rows
                q2, s2 = fp8_kernels.quantize_rows(x)
            print(f"m={m} one-pass kernel vs torch: {_quant_diff(x, q, s, want_q, want_s)}")
            print(f"m={m} two-pass kernel vs torch: {_quant_diff(x, q2, s2, want_q, want_s)}")
        assert ok, f"m={m}: {_quant_diff(x, q, s, want_q, want_s)}"
        gu = (torch.randn(m, 2 * 18944, device="cuda", generator=gen) * 1.2).to(torch.bfloat16)
        q, s = fp8_kernels.silu_mul_quantize(gu)
        want_q, want_s = silu_mul_quantize(gu)
        same = q.view(torch.uint8) == want_q.view(torch.uint8)
        steps = (q.view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
        share, rel = float(same.float().mean()), float(((s - want_s).abs() / want_s).max())
        print(f"m={m} silu*up quantiser: equal bytes {share:.5f}, max byte step {int(steps.max())}, "
              f"scale max rel diff {rel:.3g}")  # fmt: skip
        assert share >= 0.999 and int(steps.max()) <= 1, (
            f"m={m}: equal bytes {share}, steps {int(steps.max())}"
        )
        assert rel <= 2**-7  # one bf16 step of the row max at most


def test_engine_on_a_bf16_model_stays_close_to_the_trainer_and_refreshes(tiny_model, tiny_tokenizer):
    model = tiny_model.to("cuda", torch.bfloat16).eval()
    prompts = [tiny_tokenizer(t)["input_ids"] for t in ["12+34=", "hello world", "a", "The quick brown fox"]]
    engine = build_engine("native", model, tiny_tokenizer, max_slots=16, max_seq_len=96, eos_token_id=[],
                          quantization="fp8")  # fmt: skip
    assert isinstance(engine, NativeEngine)
    try:
        runner = engine.runner
        assert isinstance(runner, FP8Runner) and not runner.emulate and not runner.skipped
        assert runner.quant_kernels and runner.fused and engine.graphs is not None
        failed = [k for k, g in engine.graphs.graphs.items() if g is None]
        print(
            f"quantiser kernels: {runner.quant_kernels}; graphs {len(engine.graphs.graphs)}, failed {failed}"
        )
        assert not failed  # a failed capture would run that decode shape without a graph
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


def test_fused_decode_equals_the_per_projection_path_on_bf16(tiny_model):
    """The fused decode (norms emitting fp8 inputs, o / down through cuBLAS with the scales in the next norm)
    against the per-projection path with the same GEMMs, in bf16 on the card. Equal on a CPU (the interpreter,
    test_fp8_kernels.py); compiled, the fused norm reads an fp32 accumulator where the unfused one reads bf16,
    so Triton may lay the row out (and sum its squares) in another order: an rstd one ulp off may move a bf16
    or e4m3 rounding. Bound: relative error <= 1e-2 (the per-GEMM e4m3 error is ~4e-2)."""
    # the engine's construction (fp8.build_runner with NativeEngine's fused_kernels=None): the fused decode
    # kernels on where triton runs; FP8Runner's own default (kernels=False) is the plain-ops path
    runner = FP8Runner(tiny_model.to("cuda", torch.bfloat16).eval(), 64, kernels=None)
    assert runner.kernels and runner.fused, (runner.kernels, runner.quant_kernels, runner.skipped)
    gen = torch.Generator().manual_seed(7)
    bs = 5
    tok = torch.randint(0, tiny_model.config.vocab_size, (bs,), generator=gen).cuda()
    pos = torch.tensor([0, 3, 9, 30, 63], device="cuda")
    k0 = torch.randn(runner.cache_shape(bs), generator=gen).to("cuda", torch.bfloat16)
    out = []
    for fused in (True, False):
        runner.fused = fused
        with torch.no_grad():
            out.append(runner.decode(tok, pos, k0.clone(), k0.clone(), 64, torch.arange(bs, device="cuda")))
    equal = float((out[0] == out[1]).float().mean())
    print(f"fused vs per-projection decode: rel err {_rel(out[0], out[1]):.3g}, equal logits {equal:.4f}")
    assert _rel(out[0], out[1]) <= 1e-2


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
