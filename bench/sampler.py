"""The rollout sampler alone: sampling.sample_tokens' Triton kernel ("new") against the torch ops ("old",
sampling.sample_tokens_ref) at a 7B decode step's shape, and the sampler's GPU time inside an engine.

    python bench/sampler.py                           # [256, 151936] bf16 on the GPU: us per call, agreement
    TRITON_INTERPRET=1 python bench/sampler.py --batch 8 --vocab 9000 --draws 64 --device cpu   # CPU smoke

`micro`: logits [batch, vocab] bf16 (random rows, flat to peaked), temperatures in [0.2, 1.6] with every
16th row greedy, mode "sample". GPU microseconds per call (CUDA events, median of 20 after warm-up) of each
sampler eager and as a CUDA graph replay (how the engine runs it), and the share of equal tokens over
--draws draws (steps of fresh uniforms), with the max |log-prob diff| of equal tokens.
`engine_sampler_us(engine)`: the GPU time of the sampler an engine's decode step runs (its SlotState.sample at
its largest graph batch over random logits of its vocabulary), as a CUDA graph replay.
Writes $OUT/sampler.json (OUT unset: bench/results/sampler.json) when run as a script; bench/fp8_rollout.py
imports both (--sampler-bench, --sampler).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from fp8_check import graph_step_ms  # noqa: E402

from relayrl.rollout.sampling import sample_tokens, sample_tokens_ref, uniform  # noqa: E402

Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _inputs(batch: int, vocab: int, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = torch.rand(batch, 1, device=device, generator=gen) * 6 + 0.5
    logits = (torch.randn(batch, vocab, device=device, generator=gen) * scale).to(torch.bfloat16)
    temp = torch.rand(batch, device=device, generator=gen) * 1.4 + 0.2
    temp[::16] = 0.0
    ones = torch.ones(batch, device=device)
    return logits, temp, ones, torch.zeros(batch, dtype=torch.long, device=device)


def gpu_us(run: Callable[[], object], reps: int = 20) -> float:
    """Median GPU microseconds of `run` (CUDA events), after 3 warm-up calls (fp8_check.graph_step_ms)."""
    return graph_step_ms(run, reps) * 1e3


def graph_us(fn: Sampler, args: tuple) -> float:
    """GPU microseconds of one replay of `fn(*args)` captured as a CUDA graph."""
    for _ in range(2):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    return gpu_us(graph.replay)


def micro(batch: int = 256, vocab: int = 151_936, draws: int = 102_400, device: str = "cuda") -> dict:
    """The module doc's micro-benchmark; returns its row."""
    logits, temp, top_p, top_k = _inputs(batch, vocab, device)
    seeds = torch.arange(batch, device=device) * 7919 + 13
    u = uniform(seeds, torch.zeros_like(seeds))
    row: dict = dict(batch=batch, vocab=vocab, dtype="bf16")
    samplers: dict[str, Sampler] = {"new": sample_tokens, "old": sample_tokens_ref}
    if device.startswith("cuda"):
        for name, fn in samplers.items():
            args = (logits, temp, top_p, top_k, u, "sample")
            row[f"{name}_eager_us"] = round(gpu_us(lambda fn=fn, args=args: fn(*args)), 1)
            row[f"{name}_graph_us"] = round(graph_us(fn, args), 1)
            g_args = (logits, temp, top_p, top_k, u, "greedy")
            row[f"{name}_greedy_us"] = round(gpu_us(lambda fn=fn, g_args=g_args: fn(*g_args)), 1)
        row["speedup_graph"] = round(row["old_graph_us"] / row["new_graph_us"], 2)
    same = total = 0
    worst_lp = 0.0
    t0 = time.perf_counter()
    for step in range((draws + batch - 1) // batch):
        u = uniform(seeds, torch.full_like(seeds, step + 1))
        tok, lp = sample_tokens(logits, temp, top_p, top_k, u, "sample", fast=True)
        ref, ref_lp = sample_tokens_ref(logits, temp, top_p, top_k, u, "sample")
        eq = tok == ref
        same += int(eq.sum())
        total += batch
        worst_lp = max(worst_lp, float((lp - ref_lp)[eq].abs().max()))
    row.update(draws=total, equal_tokens=same, equal_share=round(same / total, 6),
               logprob_absdiff_max=worst_lp, agreement_s=round(time.perf_counter() - t0, 1))  # fmt: skip
    return row


def micro_line(row: dict) -> str:
    return (
        f"sampler [{row['batch']}, {row['vocab']}] bf16: new {row.get('new_eager_us')} us eager / "
        f"{row.get('new_graph_us')} us graph (greedy {row.get('new_greedy_us')}), old {row.get('old_eager_us')} / "
        f"{row.get('old_graph_us')} (greedy {row.get('old_greedy_us')}), {row.get('speedup_graph')}x; tokens "
        f"equal {row['equal_tokens']} of {row['draws']} ({row['equal_share']}), max |logprob diff| "
        f"{row['logprob_absdiff_max']:.2e}"
    )


def engine_sampler_us(engine) -> float:
    """GPU us of the engine's own sampler (state.sample: what its decode graphs captured) at its largest graph
    batch over random logits of its vocabulary, mode "sample", as a CUDA graph replay."""
    state = engine.state
    bs = max(engine.graph_batch_sizes)
    vocab = int(engine.model.get_output_embeddings().weight.shape[0])
    logits, temp, top_p, top_k = _inputs(bs, vocab, str(engine.device))
    u = uniform(
        torch.arange(bs, device=engine.device), torch.zeros(bs, dtype=torch.long, device=engine.device)
    )
    with torch.no_grad():
        return round(graph_us(state.sample, (logits, temp, top_p, top_k, u, "sample")), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--draws", type=int, default=102_400)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    if not args.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error(
            "a CPU run needs TRITON_INTERPRET=1 in the environment (Triton's interpreter runs the kernel)"
        )
    row = micro(args.batch, args.vocab, args.draws, args.device)
    print(micro_line(row), flush=True)
    path = Path(args.out)
    path = path if path.suffix == ".json" else path / "sampler.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
