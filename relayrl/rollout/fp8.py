"""FP8 rollout (`rollout.quantization fp8`): the native engine's projection weights in float8 e4m3, re-quantised on
the device at every weight refresh; the training side stays bf16 (its weights, its forward, its log-probs).

What is quantised. Every decoder layer's q/k/v, o, gate/up and down projections (plain `nn.Linear` only): the
engine keeps ONE fp8 copy per group (q/k/v as one [(H + 2 Hkv) D, hidden] matrix, gate/up as one [2 I, hidden]
matrix, o and down alone), so a layer is four fp8 GEMMs whatever the bf16 layout (fused or not,
native_fused.py). The embedding, the LM head, every RMSNorm, the rotary tables, the biases, the attention and
the sampler stay in the model dtype (bf16 on a GPU): the embedding is a gather (nothing to gain), the LM head's
logits feed the log-probs directly (its rounding would show in every token's log-prob, and it is one GEMM of
~30), norms are elementwise. A projection that is not a plain Linear (LoRA-wrapped, hooked, a tensor-parallel
row split) is left alone and called as it is (`FP8Runner.skipped` names them); on a GPU so is one whose sizes
are not multiples of 16 (torch._scaled_mm's constraint).

Scales. Weights: one fp32 scale per output channel (row), s_w[n] = max_k |W[n, k]| / 448, W_q = round_e4m3(W /
s_w). Activations: one scale per token (row of x), computed on the fly, s_x[m] = max_k |x[m, k]| / 448. The
product is y = (x_q @ W_q^T) * s_x[m] * s_w[n] (+ bias), accumulated in fp32 and written in bf16. Why
per-channel and not 128 x 128 blocks: it is what torch._scaled_mm runs natively on H100/H200 as one GEMM
("row-wise" scaling: scale_a [M, 1], scale_b [1, N], bf16 output) with no extra kernel; row-wise is the
recipe vLLM's dynamic FP8 and FBGEMM use for LLM serving (outliers live in activations, which per-token scales
absorb; weights are well conditioned per row); refreshing it is one row-max and one cast per matrix. 128 x 128
blocks (DeepSeek-V3's training recipe) bound a weight outlier's damage to its block, which matters more when
the weights are trained in fp8; for a bf16-trained policy the row-wise error is already at e4m3's rounding.

Rounding bound (tested): e4m3 keeps 3 mantissa bits, so an element in the normal range (|w / s| >= 2^-6)
round-trips with relative error <= 2^-4, and one below it (subnormal) with absolute error <= s * 2^-10.

Refresh. `FP8Runner.refresh_weights()` re-quantises every group from the bf16 weights as they are now (read
through the modules, so a re-laid-out or reloaded parameter is followed) INTO the fp8 buffers allocated at
start-up (`copy_`: same storage, so the engine's CUDA graphs stay valid). NativeEngine calls it at every
`load_weights` (rollout/native.py `_load`), which every weight transport ends with (distributed/weights/): the
shared-weights case included, where the optimizer step changed the bf16 weights in place.

Paths:
    GPU (compute capability >= 8.9: H100, H200, L40S, RTX 4090, ...): torch._scaled_mm(x_q, W_q.t(), s_x [M, 1],
        s_w [1, N], bias, out_dtype=bfloat16, use_fast_accum=FAST_ACCUM): CUTLASS's row-wise kernel with the
        scales and the bias in its epilogue; the per-token activation quantiser is one Triton kernel
        (fp8_kernels.py; the torch ops where triton does not import: `FP8Runner.quant_kernels` says which),
        bit for bit `quantize_rows`; the down projection's input is quantised together with silu(gate) * up
        (`silu_mul_quantize`, two chunked kernels); the refresh quantises each weight straight into the fp8
        buffers. Decode with the fused kernels (`FP8Runner.fused`: every layer's four projections in fp8, no
        MoE layer) runs `_decode_kernels` below: each residual add + RMSNorm writes the next projection's fp8
        input and scales (fp8_kernels.rms_norm_quantize), so q/k/v and gate/up need no quantiser launch and no
        bf16 normed row is written; each projection takes GEMM's choice (o and down "cublas": fp32
        accumulator, its row-wise scales and bias applied inside the next norm, no rescale launch; q/k/v
        "cublas" too, rescaled by fp8_kernels.rescale before the rotary kernel); the final norm stays in the
        model dtype for the LM head. Same bytes as the per-projection path with the same GEMMs (tested).
    CPU, or `emulate=True`: the same quantisation (fp8 tensors, the same scales), then dequantised and run as a
        plain F.linear in the model dtype: quantise-dequantise emulation, so CPU tests cover the rounding, the
        scales, the refresh and the config; the only difference from the GPU path is the GEMM's accumulation.
    A CUDA device below 8.9 raises `FP8Unsupported` (no fp8 tensor cores; torch._scaled_mm refuses).

Speed (the first GPU run, 7B at batch 256 on an H200, decoded 3x SLOWER than bf16; what changed): the
activation quantisers were torch.compile'd functions, which recompiled per grad mode / batch-1 / dtype and,
past torch's recompile limit, fell back to ~8 eager ops per call for the rest of the process (and a recompile
inside a CUDA graph capture fails that capture: its decode shape then runs without a graph); now Triton kernels
(fp8_kernels.py's doc). torch._scaled_mm's row-wise kernel without fast accumulation (promoting the fp32
accumulator every few k-blocks) is the slow CUTLASS schedule (pytorch/pytorch#147971, pytorch/ao#1325);
inference engines (vLLM's CUTLASS fp8 GEMMs, FBGEMM, torchao's fp8 inference) run the fast-accumulation
kernels, and so does this one (`FAST_ACCUM`; bench/fp8_rollout.py --gemm-check measures both: time and error
against an fp64 GEMM of the same operands). The bias rides in the GEMM's epilogue (one kernel, not two).
After those fixes (H200, 7B, batch 256): 1.25x bf16's tokens/s, decode 7.99 ms/step against 9.49, the step's
GPU time gemm 3.9 ms, quantisers 1.14 ms (4 launches a layer, 10 us on average), attention 0.75, the rest
(sampler, rotary) 1.4; the down projection's row-wise GEMM (47.6 us) lost to cuBLAS's per-tensor one (33.8 with
its rescale). Hence the fused decode above: 2 of 4 quantiser launches a layer folded into the norms, the
silu(gate) * up quantiser over column chunks (M x I / 1024 programs instead of M rows of 18944), q/k/v, o and down
through cuBLAS with the rescale folded into the next norm (bench/fp8_rollout.py's "fp8-unfused" engine is the
path before it).

Mismatch (the same run: mean |engine - trainer| 0.595 for fp8 against 0.050 for the bf16 engine, on random
7B weights): e4m3 keeps 3 mantissa bits against bf16's 7, so ONE fp8 GEMM's output is off by ~3.8% (relative
Frobenius, activations and weights each ~2.7%) where a bf16 GEMM's is ~0.29%, 13x, measured at 7B widths on a
CPU for every projection (tests/rollout/test_fp8.py pins it); the log-prob gap follows that ratio (12x) on a
random-weight model, which turns bf16's own rounding into 0.05 (5x a trained 0.5B's 0.0098), and shows on a CPU
too (4 random layers at 7B widths: 0.238 for fp8 emulation, 0.021 for bf16, against fp32): the gap is e4m3's
precision, not a scale bug. Row-wise scales are already the finest that run as one GEMM; what remains
is a correction (TIS, on by default) or keeping sensitive projections in bf16.

Memory: the fp8 copy is one byte per projection weight beside the bf16 weights the engine already reads (the
trainer's compute weights, or its own copy); it is not freed while the engine sleeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F

from relayrl.rollout import fp8_kernels
from relayrl.rollout.exact import ExactRunner
from relayrl.rollout.kernels import decode_attention, rms_norm, rope_kv_write
from relayrl.rollout.native_model import DecoderRunner, TensorFn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
"""Largest finite e4m3fn value."""
MIN_CAPABILITY = (8, 9)
"""Compute capability with fp8 tensor cores (Ada, Hopper and later)."""
QUANTIZATIONS = ("none", "fp8")
"""rollout.quantization's values."""
FAST_ACCUM = True
"""torch._scaled_mm's use_fast_accum on the GPU path (module doc, "Speed"); False: the fp32-promoting kernel."""
GEMM = {"qkv": "cublas", "o": "cublas", "gate_up": "cutlass", "down": "cublas"}
"""The GPU path's fp8 GEMM per projection: "cutlass" (torch._scaled_mm's row-wise kernel, the scales and bias in
its epilogue) or "cublas" (its per-tensor cuBLAS kernel with unit scales, fp32 out, then the row-wise scales:
in the next fused norm on the fused decode path, else fp8_kernels.rescale; up to CUBLAS_MAX_ROWS rows). Both
multiply the same fp8 operands and apply the same scales in fp32; only the accumulation order differs.
Per-GEMM us on an H200 at M = 1 / 32 / 256 (row-wise / cuBLAS + rescale kernel): q/k/v 11.7 / 12.0 / 12.5 vs
7.7 / 7.4 / 12.0; o 11.7 / 11.8 / 12.1 vs 6.6 / 7.0 / 10.4; gate/up 47.1 / 44.7 / 58.4 vs 39.3 / 44.1 / 74.5;
down 47.2 / 47.3 / 47.6 vs 23.7 / 25.5 / 33.8 (the row-wise kernel has a ~12 us floor and no split-K; gate/up's
fp32 output is 2x the bytes of its bf16 one). The name "cutlass" is historical: torch 2.11 runs the row-wise
kernel on sm90 as cuBLASLt's outer-vector-scaled one (`nvjet_*_ovscale` in the profile)."""
CUBLAS_MAX_ROWS = 512
""""cublas" runs up to this many rows (decode batches); more (prefill) take the row-wise GEMM: at M = 4096 on an
H200 cuBLAS + rescale lost (o 107 vs 75 us, down 489 vs 436: the fp32 output's extra pass)."""
FUSED = True
"""Decode through `FP8Runner._decode_fused` where it applies (module doc, "Paths"); False: the per-projection
quantisers (bench/fp8_rollout.py's "fp8-unfused")."""


class FP8Unsupported(RuntimeError):
    """rollout.quantization fp8 asked for on a device that cannot run fp8 GEMMs."""


def fp8_supported(device: torch.device) -> bool:
    """True on a CUDA device with compute capability >= 8.9 (fp8 tensor cores)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def check_device(device: torch.device) -> bool:
    """Whether `device` runs the real fp8 GEMMs (True) or the CPU emulation (False); raises FP8Unsupported on a
    CUDA device below compute capability 8.9, naming the card and the way out."""
    if device.type != "cuda":
        return False
    if not fp8_supported(device):
        name, cap = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        raise FP8Unsupported(
            f"rollout.quantization fp8 needs a GPU with fp8 tensor cores (compute capability >= 8.9: H100, H200, "
            f"L40S, RTX 4090); {device} is a {name} with capability {cap[0]}.{cap[1]}. Use --rollout.quantization "
            "none (bf16 rollout) on this card"
        )
    return True


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (x_q [..., K] float8_e4m3fn, scale [..., 1] fp32) with x ~ x_q * scale, one scale per row:
    max |row| / 448 (an all-zero row gets scale 1 and zeros). Both divisions are IEEE fp32 divisions on every
    device (fp8_kernels.py's kernel computes the same bytes): 448 is divided as a tensor, because CUDA torch
    turns a division by a Python scalar into a multiplication by its rounded reciprocal (1 ulp off)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in fp32, cast to `dtype`."""
    return (q.float() * scale).to(dtype)


Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""x [M, K] -> (x_q [M, K'] fp8, scale [M, 1] fp32): `quantize_rows`, `silu_mul_quantize` or their kernels."""


def silu_mul_quantize(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate/up rows gu [M, 2I] -> quantize_rows(silu(gate) * up): the down projection's input, quantised (one
    kernel on the GPU path, fp8_kernels.py, instead of silu, mul and the quantiser apart)."""
    inter = gu.shape[-1] // 2
    return quantize_rows(F.silu(gu[:, :inter]) * gu[:, inter:])


class FP8Linear:
    """One fp8 projection over the row blocks of one or more live bf16 Linears (their weights stacked in
    order: q/k/v, gate/up). Holds W_q [N, K] fp8 and s_w [N] fp32 (and, emulated, W_q * s_w in the model
    dtype); `refresh` re-quantises in place; calling it computes x @ W^T + bias as the module doc says.
    `quantizer`: the activations' (quantize_rows or its kernel); `kernels`: the refresh quantises through
    fp8_kernels.quantize_rows_into (no temporaries); `fast_accum`: torch._scaled_mm's use_fast_accum (None:
    FAST_ACCUM); `gemm`: "cutlass" (default) or "cublas" (GEMM's doc)."""

    def __init__(
        self,
        linears: Sequence[torch.nn.Linear],
        *,
        emulate: bool,
        quantizer: Quantizer = quantize_rows,
        kernels: bool = False,
        fast_accum: bool | None = None,
        gemm: str | None = None,
    ) -> None:
        self.linears = list(linears)
        self.emulate = emulate
        self.quantizer = quantizer
        self.kernels = kernels
        self.fast_accum = FAST_ACCUM if fast_accum is None else fast_accum
        self.gemm = gemm or "cutlass"
        if self.gemm not in ("cutlass", "cublas"):
            raise ValueError(f"FP8Linear: gemm={self.gemm!r}; choose 'cutlass' or 'cublas'")
        w0 = self.linears[0].weight
        self.dtype, self.device = w0.dtype, w0.device
        self.rows = [m.weight.shape[0] for m in self.linears]
        n, k = sum(self.rows), w0.shape[1]
        self.qweight = torch.empty((n, k), dtype=FP8, device=self.device)
        """W_q [N, K] float8_e4m3fn."""
        self.scale = torch.empty(n, dtype=torch.float32, device=self.device)
        """s_w [N]: one scale per output channel."""
        self.dequant = torch.empty((n, k), dtype=self.dtype, device=self.device) if emulate else None
        """Emulation only: W_q * s_w in the model dtype, the weight the emulated F.linear runs."""
        has_bias = [m.bias is not None for m in self.linears]
        self.bias: torch.Tensor | None = (
            torch.empty(n, dtype=self.dtype, device=self.device) if all(has_bias) else None
        )
        """The stacked biases (model dtype, not quantised), when every linear has one."""
        if any(has_bias) and not all(has_bias):
            raise ValueError("FP8Linear: the stacked linears must all have a bias or none")
        self.qweight_t = self.qweight.t()
        """W_q^T [K, N]: the column-major second operand torch._scaled_mm wants (a view)."""
        self.scale_row = self.scale[None, :]
        """s_w as [1, N] (a view): _scaled_mm's row-wise scale_b."""
        self.one = torch.ones((), dtype=torch.float32, device=self.device)
        """The unit per-tensor scale of the "cublas" GEMM."""
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-quantise from the linears' current weights into the same buffers."""
        row = 0
        for m, n in zip(self.linears, self.rows, strict=True):
            if self.kernels:  # one kernel per weight, straight into the buffers
                fp8_kernels.quantize_rows_into(
                    m.weight.detach(), self.qweight[row : row + n], self.scale[row : row + n]
                )
            else:
                q, s = quantize_rows(m.weight.detach())
                self.qweight[row : row + n].copy_(q)
                self.scale[row : row + n].copy_(s.view(-1))
            if self.bias is not None and m.bias is not None:
                self.bias[row : row + n].copy_(m.bias.detach())
            row += n
        if self.dequant is not None:
            self.dequant.copy_(dequantize(self.qweight, self.scale[:, None], self.dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        if self.dequant is not None:  # emulation: the same quantised operands, a plain GEMM
            xq, xs = quantize_rows(rows)
            out = F.linear(dequantize(xq, xs, x.dtype), self.dequant, self.bias)
        else:
            out = self.matmul(*self.quantizer(rows), x.dtype)
        return out.view(*shape, -1)

    def accumulate(
        self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None]:
        """`matmul` with the "cublas" GEMM's rescale left to the caller: (x @ W^T + bias in `dtype`, None) from
        the row-wise GEMM, or ("cublas" and M <= CUBLAS_MAX_ROWS) the fp32 accumulator x_q @ W_q^T with (s_x,
        s_w, bias) for fp8_kernels.rms_norm_quantize's `scales`."""
        if self.gemm == "cublas" and xq.shape[0] <= CUBLAS_MAX_ROWS:
            acc = torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]
                xq, self.qweight_t, scale_a=self.one, scale_b=self.one, out_dtype=torch.float32,
                use_fast_accum=self.fast_accum,
            )  # fmt: skip
            return acc, (xs, self.scale, self.bias)
        return torch._scaled_mm(  # pyright: ignore[reportPrivateImportUsage]  (torch's fp8 GEMM, row-wise)
            xq, self.qweight_t, scale_a=xs, scale_b=self.scale_row, bias=self.bias, out_dtype=dtype,
            use_fast_accum=self.fast_accum,
        ), None  # fmt: skip

    def matmul(self, xq: torch.Tensor, xs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(x_q [M, K] fp8, s_x [M, 1]) -> x @ W^T + bias [M, N] in `dtype` (bf16) by torch._scaled_mm, the
        scales and the bias applied in the GEMM's epilogue ("cublas", M <= CUBLAS_MAX_ROWS: by
        fp8_kernels.rescale after it)."""
        acc, scales = self.accumulate(xq, xs, dtype)
        return acc if scales is None else fp8_kernels.rescale(acc, *scales, dtype)


def build_runner(
    model: torch.nn.Module,
    max_len: int,
    decode_attention: str,
    exact: bool = False,
    quantization: str = "none",
    kernels: bool | None = False,
) -> DecoderRunner:
    """The native engine's forward: ExactRunner (rollout.exact), FP8Runner (quantization "fp8") or DecoderRunner
    (`kernels`: its fused decode kernels, rollout/kernels.py); a ValueError for an unknown quantization or exact
    mode with fp8 (exact mode's point is log-probs equal to the trainer's bf16 forward, which fp8 weights cannot
    give)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"native engine: quantization={quantization!r}; choose one of {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "fp8":
        if exact:
            raise ValueError(
                "native engine: exact=True with quantization='fp8' (exact mode needs the trainer's own weights)"
            )
        return FP8Runner(model, max_len, decode_attention, kernels=kernels)
    if exact:
        return ExactRunner(model, max_len)
    return DecoderRunner(model, max_len, decode_attention, kernels=kernels)


def _plain(module: object) -> bool:
    """A plain nn.Linear without hooks (a hooked or wrapped projection is called as it is)."""
    m = cast(torch.nn.Module, module)
    return type(module) is torch.nn.Linear and not (m._forward_hooks or m._forward_pre_hooks)


class FP8Runner(DecoderRunner):
    """DecoderRunner with fp8 projections (module doc): the same prefill / extend / decode (so NativeEngine and
    its CUDA graphs run it unchanged), each layer's q/k/v, o, gate/up and down through `FP8Linear`s;
    `refresh_weights` re-quantises them all."""

    def __init__(
        self,
        model: torch.nn.Module,
        max_len: int,
        decode_attention: str = "auto",
        *,
        emulate: bool | None = None,
        quant_kernels: bool = True,
        kernels: bool | None = False,
        fast_accum: bool | None = None,
    ) -> None:
        """`emulate`: quantise-dequantise instead of fp8 GEMMs (None: on a CPU; a CUDA device below 8.9
        raises FP8Unsupported); `quant_kernels`: the GPU path's quantisers as fp8_kernels.py's Triton kernels
        where triton runs (else the torch functions); `kernels`: DecoderRunner's fused decode kernels around
        the projections (rollout/kernels.py); `fast_accum`: torch._scaled_mm's use_fast_accum (None:
        FAST_ACCUM)."""
        super().__init__(model, max_len, decode_attention, kernels=kernels)
        real = check_device(self.device)
        self.emulate = (not real) if emulate is None else emulate
        self.fast_accum = FAST_ACCUM if fast_accum is None else fast_accum
        self.quant_kernels = quant_kernels and not self.emulate and fp8_kernels.usable(self.device)
        """The activation quantisers and the refresh run fp8_kernels.py's Triton kernels."""
        quantizer = fp8_kernels.quantize_rows if self.quant_kernels else quantize_rows
        self.silu_quantize = fp8_kernels.silu_mul_quantize if self.quant_kernels else silu_mul_quantize
        self.skipped: list[str] = []
        """Projections left in the model dtype (not plain Linears, or sizes that fp8 GEMMs refuse)."""
        self.fp8_qkv: list[FP8Linear | None] = []
        self.fp8_o: list[FP8Linear | None] = []
        self.fp8_gate_up: list[FP8Linear | None] = []
        self.fp8_down: list[FP8Linear | None] = []
        for li, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            groups = (
                (self.fp8_qkv, "q/k/v", "qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
                (self.fp8_o, "o_proj", "o", [attn.o_proj]),
                (
                    self.fp8_gate_up,
                    "gate/up",
                    "gate_up",
                    [getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)],
                ),
                (self.fp8_down, "down_proj", "down", [getattr(mlp, "down_proj", None)]),
            )
            for out, name, key, mods in groups:
                out.append(self._make(f"layer {li} {name}", mods, quantizer, GEMM[key]))
        gated = type(getattr(self.layers[0].mlp, "act_fn", None)).__name__ in ("SiLUActivation", "SiLU")
        if not gated:  # another MLP: leave it whole (its projections are not called one by one here)
            self.skipped += [f"layer {li} mlp" for li, g in enumerate(self.fp8_gate_up) if g is not None]
            self.fp8_gate_up = [None] * len(self.layers)
            self.fp8_down = [None] * len(self.layers)
        self.mlps = [self._mlp_fn(li) for li in range(len(self.layers))]
        self.projs = [
            (*p[:3], o if o is not None else p[3]) for p, o in zip(self.projs, self.fp8_o, strict=True)
        ]
        self.quantized = sum(
            g is not None for g in (*self.fp8_qkv, *self.fp8_o, *self.fp8_gate_up, *self.fp8_down)
        )
        """fp8 GEMMs per forward (4 per layer when every projection is a plain Linear)."""
        every = all(None not in g for g in (self.fp8_qkv, self.fp8_o, self.fp8_gate_up, self.fp8_down))
        self.fused = FUSED and self.kernels and self.quant_kernels and every and not self.moe_layers
        """Decode runs `_decode_fused` (every layer's four projections in fp8, the fused kernels on)."""

    def _make(self, name: str, mods: list, quantizer: Quantizer, gemm: str) -> FP8Linear | None:
        if not all(_plain(m) for m in mods):
            self.skipped.append(name)
            return None
        linears = cast(list[torch.nn.Linear], mods)
        sizes = [linears[0].weight.shape[1], *(m.weight.shape[0] for m in linears)]
        if not self.emulate and any(s % 16 for s in sizes):
            self.skipped.append(f"{name} (sizes {sizes} not multiples of 16)")
            return None
        return FP8Linear(
            linears,
            emulate=self.emulate,
            quantizer=quantizer,
            kernels=self.quant_kernels,
            fast_accum=self.fast_accum,
            gemm=gemm,
        )

    def _mlp_fn(self, li: int) -> TensorFn:
        gate_up, down = self.fp8_gate_up[li], self.fp8_down[li]
        if gate_up is None:
            return self.mlps[li]
        down_fn: TensorFn = (
            down if down is not None else cast(torch.nn.Module, getattr(self.layers[li].mlp, "down_proj"))  # noqa: B009
        )
        inter = sum(gate_up.rows) // 2
        if down is not None and not self.emulate:  # silu(gate) * up and down's quantiser: one kernel

            def fused(x: torch.Tensor) -> torch.Tensor:
                gu = gate_up(x)
                out = down.matmul(*self.silu_quantize(gu.reshape(-1, 2 * inter)), gu.dtype)
                return out.view(*gu.shape[:-1], -1)

            return fused

        def mlp(x: torch.Tensor) -> torch.Tensor:
            gu = gate_up(x)
            h = F.silu(gu[..., :inter])
            h *= gu[..., inter:]
            return down_fn(h)

        return mlp

    def _project_qkv(self, li: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.fp8_qkv[li]
        if qkv is None:
            return super()._project_qkv(li, h)
        q_rows, k_rows, v_rows = qkv.rows
        q, k, v = qkv(h).split((q_rows, k_rows, v_rows), dim=-1)
        return q, k, v

    def _o_proj(self, li: int, x: torch.Tensor) -> torch.Tensor:
        return self.projs[li][3](x)

    def _mlp(self, li: int, x: torch.Tensor) -> torch.Tensor:
        return self.mlps[li](x)

    def _decode_kernels(
        self, tok: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_len: int
    ) -> torch.Tensor:
        """DecoderRunner's fused decode with each RMSNorm emitting the next projection's fp8 input and scales
        (fp8_kernels.rms_norm_quantize: no bf16 normed row, no quantiser launch for q/k/v and gate/up), and the
        "cublas" GEMMs' (o, down: GEMM) row-wise scales applied inside the next norm; the same bytes as the
        per-projection path with the same GEMMs (tested). Off (`fused`): DecoderRunner's loop."""
        if not self.fused:
            return super()._decode_kernels(tok, pos, k_cache, v_cache, kv_len)
        bs, norms, dt = tok.shape[0], self.norm_params, self.dtype
        hq, hs, x = fp8_kernels.rms_norm_quantize(self.body.embed_tokens(tok), *norms[0])
        for li in range(len(self.layers)):
            qkv, o_proj = cast(FP8Linear, self.fp8_qkv[li]), cast(FP8Linear, self.fp8_o[li])
            gate_up, down = cast(FP8Linear, self.fp8_gate_up[li]), cast(FP8Linear, self.fp8_down[li])
            q, k, v = qkv.matmul(hq, hs, dt).split(qkv.rows, dim=-1)
            q, k, v = self._heads(li, q, k, v, (bs,))
            q = rope_kv_write(q, k, v, self.cos, self.sin, pos, k_cache[li], v_cache[li])
            o = decode_attention(q, k_cache[li], v_cache[li], pos, self.scale, kv_len)
            delta, scales = o_proj.accumulate(*o_proj.quantizer(o.view(bs, -1)), dt)
            hq, hs, x = fp8_kernels.rms_norm_quantize(delta, *norms[2 * li + 1], residual=x, scales=scales)
            hq, hs = self.silu_quantize(gate_up.matmul(hq, hs, dt))
            delta, scales = down.accumulate(hq, hs, dt)
            if li + 1 == len(self.layers):  # the final norm: the LM head's input stays in the model dtype
                delta = delta if scales is None else fp8_kernels.rescale(delta, *scales, dt)
                return self.model.lm_head(rms_norm(delta, *norms[-1], residual=x)[0])
            hq, hs, x = fp8_kernels.rms_norm_quantize(delta, *norms[2 * li + 2], residual=x, scales=scales)
        raise AssertionError("a decoder without layers")

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Re-quantise every fp8 projection from the current bf16 weights (in place)."""
        for group in (self.fp8_qkv, self.fp8_o, self.fp8_gate_up, self.fp8_down):
            for lin in group:
                if lin is not None:
                    lin.refresh()

    def fp8_linears(self) -> list[FP8Linear]:
        """Every fp8 projection, layer by layer."""
        groups = (self.fp8_qkv, self.fp8_o, self.fp8_gate_up, self.fp8_down)
        return [lin for layer in zip(*groups, strict=True) for lin in layer if lin is not None]
