"""bench/moe.py's "layer" phase: one decode step's mixture-of-experts blocks alone, in a CUDA graph, through the
torch path (native_moe: fp32 router, softmax / top-k, grouped GEMMs) and the fused Triton kernels
(rollout/moe_kernels.py), the experts alone each way, and the kernels' tile configs (SWEEP): microseconds per
layer and the expert weights' read bandwidth, plus the kernels' bf16 difference from the torch path."""

from __future__ import annotations

import time
from typing import Any

import torch

from relayrl.rollout import moe_kernels as MK
from relayrl.rollout import native_moe as NM


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_graph(fn, reps: int = 10) -> float:
    """Seconds per call of fn() (a whole decode step's worth of work), captured in a CUDA graph."""
    fn()  # compiles the Triton kernels
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    sync()
    return (time.perf_counter() - t0) / reps


SWEEP = {
    "gate_up": [(64, 128, 4, 3), (32, 128, 4, 4), (64, 64, 4, 4), (128, 128, 8, 2), (64, 256, 4, 2)],
    "down": [(128, 128, 4, 3), (64, 128, 4, 4), (256, 128, 8, 2), (128, 64, 4, 4), (64, 256, 4, 2)],
}
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) tried per kernel, the other at its default (BLOCK_M 16)."""


@torch.no_grad()
def layer_bench(model, args) -> dict[str, Any]:
    blocks = [layer.mlp for layer in model.model.layers if NM.is_sparse_block(layer.mlp)]
    spec = NM.router_spec(model.config)
    gen = torch.Generator(device=args.device).manual_seed(3)
    x = torch.randn((args.prompts, model.config.hidden_size), generator=gen, device=args.device)
    x = x.to(model.model.embed_tokens.weight.dtype)
    routes = []
    for b in blocks:  # each layer's own routing of x (the experts-only timings reuse it)
        routes.append(NM.select_experts(NM.router_logits(x, b.gate.weight), spec))
    weight_bytes = sum(b.experts.gate_up_proj.nbytes + b.experts.down_proj.nbytes for b in blocks)
    hit = sum(int(torch.unique(idx).numel()) for _, idx in routes) / len(blocks)
    out: dict[str, Any] = dict(tokens=args.prompts, layers=len(blocks), experts_hit_per_layer=hit,
                               expert_weight_gb=weight_bytes / 1e9)  # fmt: skip

    def record(name: str, fn) -> None:
        try:
            secs = time_graph(fn)
            out[name] = dict(
                us_per_layer=secs / len(blocks) * 1e6, weight_tb_per_s=weight_bytes / secs / 1e12
            )
        except Exception as err:  # one failing variant keeps the others
            out[name] = dict(failed=f"{type(err).__name__}: {err}"[:500])

    fwd = {k: [NM.MoEForward(b, spec, kernels=k) for b in blocks] for k in (False, True)}
    out["kernel_layers"] = sum(f.kernels for f in fwd[True])
    ref, got = fwd[False][0](x).float(), fwd[True][0](x).float()  # the kernels against the torch path
    out["block_rel_l2_diff"] = float((got - ref).norm() / ref.norm())
    out["block_max_abs_diff"] = float((got - ref).abs().max())
    out["routes_equal"] = bool(torch.equal(fwd[False][0].last_idx, fwd[True][0].last_idx))  # pyright: ignore[reportArgumentType]
    record("block_torch", lambda: [f(x) for f in fwd[False]])
    record("block_kernels", lambda: [f(x) for f in fwd[True]])
    record("experts_torch", lambda: [NM.experts_forward(x, i, w, b.experts)
                                     for b, (w, i) in zip(blocks, routes, strict=True)])  # fmt: skip

    def experts_kernels(config=None):
        return lambda: [MK.fused_experts(x, i, w, b.experts.gate_up_proj, b.experts.down_proj, config)
                        for b, (w, i) in zip(blocks, routes, strict=True)]  # fmt: skip

    record("experts_kernels", experts_kernels())
    if args.sweep:
        for kernel, options in SWEEP.items():
            for bn, bk, warps, stages in options:
                cfg = {k: dict(v) for k, v in MK.CONFIG.items()}
                cfg[kernel] = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
                record(f"sweep_{kernel}_n{bn}_k{bk}_w{warps}_s{stages}", experts_kernels(cfg))
    return out
