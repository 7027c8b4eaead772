"""FP8 rollout (relayrl/rollout/fp8.py) on a CPU, through its emulation path (the same fp8 tensors and scales,
dequantised GEMMs): the quantisation's error bound and scales, the refresh at every load_weights, and the
engine's log-probs against the trainer's full-precision forward.

Bounds used (module doc of fp8.py): e4m3 has 3 mantissa bits, so an element w of a row with scale s = max|row|
/ 448 round-trips with |deq - w| <= |w| * 2^-4 when |w| / s >= 2^-6 (normal range) and <= s * 2^-10 below it
(subnormal step 2^-9, half of it); the bound is also shown to be tight (some element's error is > half of it).
"""

from __future__ import annotations

import pytest
import torch

from relayrl.models import forward
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, fp8, fp8_kernels, generate_all
from relayrl.rollout.fp8 import (
    FP8,
    FP8Linear,
    FP8Runner,
    FP8Unsupported,
    check_device,
    dequantize,
    quantize_rows,
)
from relayrl.rollout.native import NativeEngine


def _rows_with_spread(gen: torch.Generator) -> torch.Tensor:
    """[6, 256] rows of very different magnitudes: an outlier row, a tiny row, a zero row."""
    w = torch.randn(6, 256, generator=gen) * torch.tensor([1.0, 1e-3, 50.0, 0.02, 1.0, 0.0])[:, None]
    w[0, 7] = 40.0  # an outlier: the rest of row 0 falls partly in the subnormal range
    return w


def test_round_trip_error_is_within_e4m3_rounding_and_scales_are_per_row():
    w = _rows_with_spread(torch.Generator().manual_seed(0))
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    amax = w.abs().amax(dim=1, keepdim=True)
    # one scale per output channel: max |row| / 448 (a zero row: 1), and each row's largest element hits +-448
    assert torch.equal(scale[:5], amax[:5] / 448.0) and scale[5].item() == 1.0
    assert torch.equal(q[:5].float().abs().amax(dim=1), torch.full((5,), 448.0))
    deq = dequantize(q, scale, torch.float32)
    err = (deq - w).abs()
    normal = (w.abs() / scale) >= 2.0**-6
    bound = torch.where(normal, w.abs() * 2.0**-4, scale * 2.0**-10)
    assert bool((err <= bound * (1 + 1e-6)).all())  # 1e-6: fp32 rounding of w / s and q * s
    assert bool((err > 0.5 * bound).any())  # the bound is reached, not vacuous
    assert bool((~normal[0]).any()) and torch.equal(deq[5], torch.zeros(256))


def test_fp8_linear_stacks_projections_and_quantises_tokens():
    gen = torch.Generator().manual_seed(1)
    lins = [torch.nn.Linear(64, n, bias=True) for n in (64, 32, 32)]  # q / k / v with biases
    with torch.no_grad():
        for m in lins:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
            m.bias.copy_(torch.randn(m.bias.shape, generator=gen))
    fp8 = FP8Linear(lins, emulate=True)
    assert fp8.qweight.shape == (128, 64) and fp8.qweight.dtype == FP8
    w = torch.cat([m.weight for m in lins]).detach()
    qw, sw = quantize_rows(w)
    assert torch.equal(fp8.qweight.view(torch.uint8), qw.view(torch.uint8)) and torch.equal(
        fp8.scale, sw[:, 0]
    )
    x = torch.randn(3, 5, 64, generator=gen)
    qx, sx = quantize_rows(x.reshape(-1, 64))
    b = torch.cat([m.bias for m in lins]).detach()
    want = torch.nn.functional.linear(dequantize(qx, sx, torch.float32), dequantize(qw, sw, torch.float32), b)
    got = fp8(x)
    assert got.shape == (3, 5, 128) and torch.equal(got.view(-1, 128), want)
    exact = torch.nn.functional.linear(x, w, b)
    rel = float((got - exact).norm() / exact.norm())
    assert 1e-3 < rel < 0.08  # two e4m3 roundings (<= 2^-4 each, ~2^-6 typical): a few percent, never 0


def test_scaled_mm_path_matches_the_emulation_where_this_torch_runs_it_on_cpu():
    """The GPU code path (torch._scaled_mm, row-wise scales, bf16 out) on the same fp8 operands as the emulation:
    torch 2.13's CPU build runs it (oneDNN), so its call signature and layouts are checked here; relative error
    <= 1e-2 (accumulation order and the bf16 output rounding only). Skipped where the CPU build lacks it."""
    gen = torch.Generator().manual_seed(2)
    lins = [torch.nn.Linear(64, n, bias=True).to(torch.bfloat16) for n in (64, 32, 32)]
    with torch.no_grad():
        for m in lins:
            m.weight.copy_(torch.randn(m.weight.shape, generator=gen))
    real, emulated = FP8Linear(lins, emulate=False), FP8Linear(lins, emulate=True)
    for rows in (1, 7, 33):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        try:
            got = real(x)
        except (NotImplementedError, RuntimeError) as e:
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
        want = emulated(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 128)
        assert float((got.float() - want.float()).norm() / want.float().norm()) <= 1e-2


def test_engine_runs_the_scaled_mm_path_end_to_end_on_cpu(tiny_model, tiny_tokenizer, prompts, monkeypatch):
    """The engine's GPU code path (FP8Linear with torch._scaled_mm; no CUDA graphs) through prefill, decode and a
    refresh, on a bf16 model on this CPU build (pretending the device has fp8 GEMMs; the quantisers the torch
    functions, the down projection's input quantised with silu(gate) * up in one function).
    Bound: mean |engine - bf16 trainer| log-prob < 0.02 (measured ~0.004)."""
    monkeypatch.setattr(fp8, "check_device", lambda device: True)
    monkeypatch.setattr(fp8_kernels, "usable", lambda device: False)  # Triton's interpreter mishandles bf16
    model = tiny_model.eval().to(torch.bfloat16)
    engine = _engine(model, tiny_tokenizer, "fp8")
    try:
        assert isinstance(engine.runner, FP8Runner) and not engine.runner.emulate
        try:
            results = generate_all(engine, _requests(prompts))
        except (NotImplementedError, RuntimeError) as e:
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
        assert _mean_absdiff(model, prompts, results)[0] < 0.02
        engine.load_weights(None, version=1)
        assert generate_all(engine, _requests(prompts))[0].completions[0].token_ids == (
            results[0].completions[0].token_ids
        )  # same weights re-quantised: the same samples
    finally:
        engine.close()


def _engine(model, tok, quantization, slots=16) -> NativeEngine:
    engine = build_engine(
        "native", model, tok, max_slots=slots, max_seq_len=96, eos_token_id=[], driver="loop",
        quantization=quantization,
    )  # fmt: skip
    assert isinstance(engine, NativeEngine)
    return engine


def _requests(prompts, temperature=1.0, n=2, new=16):
    return [
        GenerationRequest(
            prompt_ids=p, params=SamplingParams(n=n, temperature=temperature, max_new_tokens=new, seed=i)
        )
        for i, p in enumerate(prompts)
    ]


def test_engine_quantises_every_projection_and_keeps_embedding_head_norms(tiny_model, tiny_tokenizer):
    engine = _engine(tiny_model.eval(), tiny_tokenizer, "fp8")
    try:
        runner = engine.runner
        assert isinstance(runner, FP8Runner) and runner.emulate and not runner.skipped
        assert runner.quantized == 4 * len(runner.layers)  # q/k/v, o, gate/up, down per layer
        lins = runner.fp8_linears()
        hidden, inter = tiny_model.config.hidden_size, tiny_model.config.intermediate_size
        assert [tuple(f.qweight.shape) for f in lins[:4]] == [
            (hidden + 2 * (hidden // 2), hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)
        ]  # fmt: skip
        # embedding, LM head and norms are the model's own fp32 parameters, untouched
        assert all(p.dtype == torch.float32 for p in tiny_model.parameters())
    finally:
        engine.close()


def test_refresh_requantises_after_a_weight_update(lively_model, tiny_tokenizer, prompts):
    model = lively_model
    engine = _engine(model, tiny_tokenizer, "fp8")
    try:
        runner = engine.runner
        assert isinstance(runner, FP8Runner)
        qkv = runner.fp8_qkv[0]
        assert qkv is not None
        ptr, before = qkv.qweight.data_ptr(), qkv.qweight.clone()
        first = generate_all(engine, _requests(prompts))
        with torch.no_grad():  # an "optimizer step" on the shared weights, in place
            for p in model.parameters():
                if p.dim() == 2:
                    p.mul_(1.5).add_(0.05)
        assert torch.equal(qkv.qweight.view(torch.uint8), before.view(torch.uint8))  # not yet seen
        engine.load_weights(None, version=1)
        attn = model.model.layers[0].self_attn
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
        qw, sw = quantize_rows(w)
        assert torch.equal(qkv.qweight.view(torch.uint8), qw.view(torch.uint8))
        assert torch.equal(qkv.scale, sw[:, 0]) and qkv.qweight.data_ptr() == ptr  # in place
        for lin in runner.fp8_linears():  # every projection holds the new weights
            new = torch.cat([m.weight for m in lin.linears]).detach()
            assert lin.dequant is not None and torch.equal(
                lin.dequant, dequantize(*quantize_rows(new), torch.float32)
            )
        second = generate_all(engine, _requests(prompts))
        assert [c.logprobs for r in first for c in r.completions] != [
            c.logprobs for r in second for c in r.completions
        ]
    finally:
        engine.close()


def _mean_absdiff(model, prompts, results) -> tuple[float, float]:
    """(mean, max) |engine - trainer| over every sampled token; the trainer's forward in the model's dtype."""
    seqs, spans, engine_lps = [], [], []
    for i, res in enumerate(results):
        for c in res.completions:
            seqs.append(torch.tensor(prompts[i] + c.token_ids))
            spans.append((len(prompts[i]), len(prompts[i]) + len(c.token_ids)))
            engine_lps.append(torch.tensor(c.logprobs))
    with torch.no_grad():
        lp, _ = forward.token_logprobs(model, seqs, "padded", temperature=1.0)
    flat = forward.split_flat(lp, [len(s) for s in seqs])
    d = torch.cat([(row[a:b] - e).abs() for row, (a, b), e in zip(flat, spans, engine_lps, strict=True)])
    return float(d.mean()), float(d.max())


def test_fp8_logprobs_and_samples_stay_close_to_full_precision(tiny_model, tiny_tokenizer, prompts):
    """The default-initialised tiny model (hidden 64, 2 layers), 5 prompts x 4 samples x 16 tokens, T = 1, the
    same seeds (so the same uniforms draw every token). Measured: fp8 mean |diff| ~0.005, max ~0.023; the fp32
    engine ~1e-7; 19 of 20 samples identical. Bounds: fp8 mean in (1e-3, 0.02) (above 1e-3: the fp8 weights are
    really used), max < 0.1; >= 16 of the 20 samples identical token for token."""
    model = tiny_model.eval()
    full, fp8 = _engine(model, tiny_tokenizer, "none"), _engine(model, tiny_tokenizer, "fp8")
    try:
        res_full = generate_all(full, _requests(prompts, n=4))
        res8 = generate_all(fp8, _requests(prompts, n=4))
        assert _mean_absdiff(model, prompts, res_full)[0] < 1e-5
        mean8, max8 = _mean_absdiff(model, prompts, res8)
        assert 1e-3 < mean8 < 0.02 and max8 < 0.1
        same = [
            a.token_ids == b.token_ids
            for ra, rb in zip(res_full, res8, strict=True)
            for a, b in zip(ra.completions, rb.completions, strict=True)
        ]
        assert len(same) == 20 and sum(same) >= 16
    finally:
        full.close()
        fp8.close()


def test_fp8_on_a_gpu_without_fp8_tensor_cores_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(
        FP8Unsupported, match=r"capability >= 8\.9.*A100 with capability 8\.0.*quantization none"
    ):
        check_device(torch.device("cuda", 0))
    assert check_device(torch.device("cpu")) is False  # a CPU emulates


def test_unknown_quantization_and_exact_with_fp8_are_refused(tiny_model, tiny_tokenizer):
    with pytest.raises(ValueError, match="quantization='int4'"):
        _engine(tiny_model, tiny_tokenizer, "int4")
    with pytest.raises(ValueError, match="exact=True with quantization='fp8'"):
        build_engine("native", tiny_model, tiny_tokenizer, max_slots=2, exact=True, quantization="fp8")
