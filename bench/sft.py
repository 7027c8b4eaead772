"""SFT training throughput of the shared training core (tokens/s, MFU), by attention layout.

Every layout trains on the SAME optimizer steps (same samples per step, lengths uniform in [min, max]) through
the real `TrainStep` (bf16 compute weights over fp32 master weights on a GPU, fused AdamW, clipping) and the SFT loss
(chunked log-probs), so the only difference is how a step's samples run through the model:

    auto      what `relayrl sft` does: relayrl.models.forward.choose_layout (varlen on a GPU: one packed row
              per token-budget micro-batch, per-sample attention through cu_seqlens; padded on a CPU:
              length-bucketed right-padded rows, causal attention, no mask)
    padded    --micro-batch consecutive samples per pass, right-padded to the longest (no bucketing)
    dense     the previous packed path: one row per budget micro-batch, positions restarting per sample,
              transformers' sdpa with a dense block-causal [N, N] mask (quadratic in the pack)

tokens/s: median over timed steps of real (non-padding) tokens / step time, after --warmup untimed steps;
layouts take turns step by step, so a shared machine's load hits them alike. MFU: model FLOPs per second /
the card's measured bf16 matmul peak (a timed 8192^3 GEMM in the same process; --peak-tflops to override).
Model FLOPs per step = 6 x (matmul parameters incl. the LM head) x real tokens + causal attention
6 x layers x (heads x head_dim) x sum_i L_i^2 (forward QK^T and AV over the causal half, x3 for backward).

    python bench/sft.py                                   # CPU, tiny Qwen2 (hidden 64, 2 layers)
    python bench/sft.py --device cuda --shape qwen0.5b    # Qwen2.5-0.5B shape, lengths 64-1024
    python bench/sft.py --device cuda --shape qwen1.5b    # Qwen2.5-1.5B shape

Prints a table and writes bench/results/sft.json (one entry per device/shape, updated in place).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from relayrl.config.components import OptimConfig
from relayrl.data.batches import SFTBatch
from relayrl.models.forward import choose_layout, prepare_model
from relayrl.trainers.sft import next_token_loss, sft_micro_batches
from relayrl.training.precision import resolve_precision
from relayrl.training.setup import build_train_step
from relayrl.training.step import LossOutput

SHAPES = {
    # name: Qwen2Config overrides (vocab 0 = the tiny char tokenizer's)
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=0),
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936),
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936),
}  # fmt: skip
LAYOUTS = ("auto", "padded", "dense")


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]


def build_model(shape: str, max_len: int, device: torch.device) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.models.tiny import build_tiny_tokenizer

    o = dict(SHAPES[shape])
    vocab = o.pop("vocab_size") or len(build_tiny_tokenizer())
    config = Qwen2Config(
        vocab_size=vocab, max_position_embeddings=max(2048, max_len), tie_word_embeddings=True, **o
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(device)  # fp32 master weights


def make_steps(args: argparse.Namespace, vocab: int) -> list[list[Sample]]:
    """Random token samples, lengths uniform in [min_len, max_len], loss on the second half."""
    g = torch.Generator().manual_seed(args.seed)
    steps = []
    for _ in range(args.warmup + args.steps):
        batch = []
        for _ in range(args.batch_size):
            n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
            ids = torch.randint(4, vocab, (n,), generator=g).tolist()
            batch.append(Sample(ids, [i >= n // 2 for i in range(n)]))
        steps.append(batch)
    return steps


def dense_mask_loss(model: torch.nn.Module, batch: SFTBatch) -> LossOutput:
    """The previous packed path: one row, restarting positions, transformers' own (dense) block mask."""
    from relayrl.models.logprobs import head_logprobs

    ids = torch.cat(batch.input_ids)[None].to(model.device)
    pos = torch.cat([torch.arange(len(s)) for s in batch.input_ids])[None].to(model.device)
    hidden = model.model(input_ids=ids, position_ids=pos, use_cache=False).last_hidden_state[0]
    targets = torch.cat(batch.targets).to(model.device)
    starts = torch.tensor([0, *[len(s) for s in batch.input_ids]]).cumsum(0)[:-1].to(model.device)
    targets[starts] = False
    lp, _ = head_logprobs(hidden[:-1], model.lm_head.weight, ids[0, 1:])
    keep = targets[1:]
    return LossOutput(loss_sum=-torch.where(keep, lp, 0.0).sum(), count=keep.sum().float())


def flops_per_step(model: torch.nn.Module, batch: list[Sample]) -> float:
    cfg = model.config
    matmul_params = sum(p.numel() for p in model.parameters())  # tied: the embedding counts once, as the head
    lengths = [len(s.input_ids) for s in batch]
    attn_dim = cfg.num_attention_heads * (
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    )
    attn = 6 * cfg.num_hidden_layers * attn_dim * sum(n * n for n in lengths)
    return 6 * matmul_params * sum(lengths) + attn


def measured_peak_tflops(device: torch.device) -> float:
    """bf16 dense matmul peak of this card, measured (median of 10 timed 8192^3 GEMMs)."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * 8192**3 / statistics.median(times) / 1e12


def micro_batches(
    name: str, batch: list[Sample], args: argparse.Namespace, auto_layout: str
) -> list[SFTBatch]:
    if name == "auto":
        return sft_micro_batches(
            batch, layout=auto_layout, packing=True, max_tokens_per_micro_batch=args.budget
        )
    if name == "padded":
        return sft_micro_batches(batch, layout="padded", packing=False, micro_batch_size=args.micro_batch)
    return sft_micro_batches(batch, layout="varlen", packing=True, max_tokens_per_micro_batch=args.budget)


def run_all(args: argparse.Namespace, device: torch.device) -> tuple[list[dict], str, float]:
    """Each step is run by every layout in turn; each layout has its own identical model and optimizer."""
    precision = resolve_precision("auto", device)
    models = {name: build_model(args.shape, args.max_len, device) for name in args.layouts}
    auto_layout = choose_layout(models[args.layouts[0]], device)
    for name, m in models.items():
        prepare_model(m, auto_layout if name == "auto" else "padded")
    steps = make_steps(args, vocab=models[args.layouts[0]].config.vocab_size)
    optim = OptimConfig(lr=1e-5, warmup_steps=0, scheduler="constant", max_grad_norm=1.0)
    train = {
        name: build_train_step(m, optim, len(steps), precision=precision, device=device)
        for name, m in models.items()
    }
    acc = {
        n: {"rates": [], "flops": [], "tokens": 0, "seconds": 0.0, "passes": 0, "losses": []} for n in models
    }
    peak_mem = dict.fromkeys(models, 0.0)
    for i, batch in enumerate(steps):
        for name in models:
            mbs = micro_batches(name, batch, args, auto_layout)
            loss_fn = dense_mask_loss if name == "dense" else next_token_loss
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = train[name].step(mbs, loss_fn)
            if device.type == "cuda":
                torch.cuda.synchronize()
                peak_mem[name] = max(peak_mem[name], torch.cuda.max_memory_allocated() / 2**30)
            dt = time.perf_counter() - t0
            a = acc[name]
            a["losses"].append(out.loss)
            if i >= args.warmup:
                a["seconds"] += dt
                a["rates"].append(out.tokens / dt)
                a["flops"].append(flops_per_step(models[name], batch) / dt)
                a["tokens"] += out.tokens
                a["passes"] += len(mbs)
    peak = args.peak_tflops or measured_peak_tflops(device)
    rows = []
    for name, a in acc.items():
        tflops = statistics.median(a["flops"]) / 1e12
        rows.append(
            {
                "layout": name if name != "auto" else f"auto ({auto_layout})",
                "tokens_per_s": statistics.median(a["rates"]),
                "model_tflops": tflops,
                "mfu": tflops / peak if peak else None,
                "passes_per_step": a["passes"] / args.steps,
                "peak_mem_gib": peak_mem[name] if device.type == "cuda" else None,
                "first_loss": a["losses"][0],
                "last_loss": a["losses"][-1],
            }
        )
    return rows, precision, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of auto,padded,dense")
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per layout")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--batch-size", type=int, default=0, help="samples per optimizer step (0: 16 CPU, 32 GPU)")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per pass (padded layout)")
    p.add_argument("--budget", type=int, default=0, help="tokens per micro-batch (0: 1024 CPU, 16384 GPU)")
    p.add_argument("--min-len", type=int, default=0, help="0: 16 CPU, 64 GPU")
    p.add_argument("--max-len", type=int, default=0, help="0: 256 CPU, 1024 GPU")
    p.add_argument("--peak-tflops", type=float, default=0.0, help="card peak for MFU (0: measure)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "sft.json"))
    args = p.parse_args()
    gpu = args.device == "cuda"
    args.batch_size = args.batch_size or (32 if gpu else 16)
    args.budget = args.budget or (16384 if gpu else 1024)
    args.min_len = args.min_len or (64 if gpu else 16)
    args.max_len = args.max_len or (1024 if gpu else 256)
    args.layouts = [x for x in args.layouts.split(",") if x]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows, precision, peak = run_all(args, device)
    name = torch.cuda.get_device_name(device) if gpu else platform.processor() or "cpu"
    print(f"\nSFT {args.shape} on {name} ({precision}), {args.batch_size} samples/step, lengths "
          f"{args.min_len}-{args.max_len}, budget {args.budget}, peak {peak:.0f} TFLOP/s (measured)")  # fmt: skip
    print(
        f"{'layout':<16} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'passes':>7} {'mem GiB':>8} {'loss':>14}"
    )
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(
            f"{r['layout']:<16} {r['tokens_per_s']:>10.0f} {r['model_tflops']:>8.1f} {mfu:>6} "
            f"{r['passes_per_step']:>7.1f} {mem:>8} {r['first_loss']:>6.3f}->{r['last_loss']:.3f}"
        )
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    if "bench" in results:  # the previous single-entry format
        results = {}
    results[f"{args.device}/{args.shape}"] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device_name": name,
        "precision": precision,
        "peak_tflops": peak,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "args": vars(args),
        "results": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
