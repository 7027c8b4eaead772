"""Data-parallel scaling: RL step time and SFT tokens/s on 1 vs N GPUs (fixed global batch), peak memory per
GPU, engine refresh time; and the memory run of a 7B-shaped GRPO policy sharded over the GPUs.

    python bench/scale.py rl  --shape qwen0.5b-char --gpus 1,2         # RL step, 1 GPU (local) vs 2 (ray)
    python bench/scale.py sft --shape qwen0.5b --gpus 1,2              # SFT tokens/s
    python bench/scale.py rl  --shape qwen7b --gpus 2 --offload --steps 3 --prompts 16 --samples 4
    python bench/scale.py rl  --shape qwen1.5b-char --gpus 1,4 --steps 3 --ema 0.99  # EMA (sharded on 4)

Every run goes through the product's own entry points (`run_rl`, `run_sft`): 1 GPU is `dist.mode=local`
(what a one-GPU user runs: bf16 compute over fp32 masters), N GPUs is `dist.mode=ray` with N FSDP2 ranks
(policy only for RL: GRPO, no reference, engines colocated with the ranks). Random weights of the named shape
(relayrl's char tokenizer; the qwen* shapes keep the real 152k vocabulary, the *-char ones use the tokenizer's
~100 tokens so that random samples end at EOS and lengths vary). The first step is a warm-up and not timed.

RL: seconds per step (mean of the timed steps) and its parts, generated tokens/s, `perf/peak_mem_gib` (rank
0's peak allocated CUDA memory over a step), `timing/engine_refresh` (after each optimizer step: the
all-gather of the shards into every rank's engine replica on N GPUs; the cast-copy on 1 GPU).
SFT: real tokens per second of the whole step (every rank) from the run's metrics, median of timed steps.
Speed-up = time(1 GPU) / time(N GPUs) at the same global batch.

Prints a table and writes bench/results/scale.json (entries keyed by kind/shape/gpus, updated in place).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scale.json"
REWARD = ROOT / "tests" / "trainers" / "data" / "digit_reward.py"

SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "qwen0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936),
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936),
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064),
}  # fmt: skip
for _name in ("qwen0.5b", "qwen1.5b", "qwen7b"):
    SHAPES[f"{_name}-char"] = {k: v for k, v in SHAPES[_name].items() if k != "vocab_size"}


def build_model(shape: str, folder: Path) -> Path:
    """A random Qwen2 of `shape` (bf16 weights, initialised on the GPU when there is one) + the char tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    overrides = dict(SHAPES[shape])
    config = Qwen2Config(
        vocab_size=overrides.pop("vocab_size", len(tok)),
        max_position_embeddings=4096,
        tie_word_embeddings=shape.startswith(("qwen0.5b", "qwen1.5b")),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **overrides,
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM._from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    return folder


def _dist(cfg_dist, gpus: int, offload: bool, device: str):
    if gpus <= 1:
        return replace(cfg_dist, mode="local")
    return replace(
        cfg_dist,
        mode="ray",
        num_cpus=max(2, 4 * gpus) if device == "cuda" else 2,
        gpus="yes" if device == "cuda" else "no",
        policy_num_gpus_per_node=gpus,
        offload=offload,
        timeout_s=900,
    )


def run_rl_case(args: argparse.Namespace, model: Path, gpus: int, out: Path) -> dict:
    from relayrl.config.presets import tiny_cpu_config
    from relayrl.trainers.rl.loop import run_rl

    cfg = tiny_cpu_config(str(model), str(out), steps=args.steps, reward=str(REWARD))
    cfg = replace(
        cfg,
        model=replace(cfg.model, dtype="bf16" if args.device == "cuda" else "fp32"),
        train=replace(cfg.train, device=args.device),
        optim=replace(cfg.optim, lr=1e-6),
        task=replace(cfg.task, train_rows=2000),
        rollout=replace(
            cfg.rollout,
            prompts_per_step=args.prompts,
            n_samples=args.samples,
            max_new_tokens=args.new_tokens,
            max_len=64 + args.new_tokens,
        ),
        algo=replace(cfg.algo, micro_batch_tokens=args.budget),
        ckpt=replace(cfg.ckpt, save_every=0),
        dist=_dist(cfg.dist, gpus, args.offload, args.device),
        ema=getattr(args, "ema", 0.0),
    )
    t0 = time.perf_counter()
    result = run_rl(cfg)
    wall = time.perf_counter() - t0
    if result.exit_code != 0:
        raise RuntimeError(f"rl run failed: {result.message}")
    hist = result.history[1:] if len(result.history) > 1 else result.history
    parts = ("generation", "experience", "update", "sync", "engine_refresh", "step")
    sec = {p: round(statistics.mean(h.get(f"timing/{p}", 0.0) for h in hist), 4) for p in parts}
    gen = statistics.mean(h["rollout/response_len"] * h["rollout/samples"] for h in hist)
    return {
        "seconds": sec,
        "gen_tokens_per_step": round(gen, 1),
        "step_gen_tokens_per_s": round(gen / sec["step"], 1),
        "peak_mem_gib": round(max(h.get("perf/peak_mem_gib", 0.0) for h in result.history), 2),
        "response_len": round(statistics.mean(h["rollout/response_len"] for h in hist), 1),
        "wall_s": round(wall, 1),
        "step_s_by_step": [h.get("timing/step", 0.0) for h in result.history],
    }


def _sft_data(path: Path, rows: int, lo: int, hi: int, seed: int) -> Path:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 "
    with path.open("w") as f:
        for _ in range(rows):
            n = rng.randint(lo, hi)
            text = "".join(rng.choice(alphabet) for _ in range(n))
            f.write(json.dumps({"input": text[: n // 4], "output": text[n // 4 :]}) + "\n")
    return path


def run_sft_case(args: argparse.Namespace, model: Path, gpus: int, out: Path) -> dict:
    from relayrl.config.dist import DistConfig
    from relayrl.config.recipes import SFTConfig
    from relayrl.trainers.sft import run_sft

    data = _sft_data(out.parent / "sft.jsonl", args.batch * (args.steps + 1), 64, 1000, 0)
    cfg = SFTConfig()
    d = DistConfig(
        mode="ray" if gpus > 1 else "local",
        num_cpus=max(2, 4 * gpus) if args.device == "cuda" else 2,
        gpus="yes" if args.device == "cuda" else "no",
        num_gpus_per_node=gpus,
        offload=args.offload,
        timeout_s=900,
    )
    cfg = replace(
        cfg,
        model=replace(cfg.model, name_or_path=str(model), dtype="bf16" if args.device == "cuda" else "fp32"),
        data=replace(cfg.data, datasets=[str(data)], max_len=1100, eval_split_ratio=0.0),
        train=replace(
            cfg.train,
            batch_size=args.batch,
            micro_batch_size=1,
            max_tokens_per_micro_batch=args.budget,
            packing=True,
            max_steps=args.steps,
            device=args.device,
            output_dir=str(out),
        ),
        ckpt=replace(cfg.ckpt, save_every=0),
        logger=replace(cfg.logger, progress_bar=False),
        dist=d,
    )
    t0 = time.perf_counter()
    result = run_sft(cfg)
    wall = time.perf_counter() - t0
    hist = result.history[1:]
    return {
        "tokens_per_s": round(statistics.median(h["perf/tokens_per_s"] for h in hist), 1),
        "step_s": round(statistics.median(h["perf/step_s"] for h in hist), 4),
        "tokens_per_step": round(statistics.mean(h["perf/tokens_per_s"] * h["perf/step_s"] for h in hist), 1),
        "wall_s": round(wall, 1),
        "step_s_by_step": [h["perf/step_s"] for h in result.history],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["rl", "sft"])
    p.add_argument("--shape", default="qwen0.5b-char", choices=sorted(SHAPES))
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU counts to compare")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    p.add_argument("--offload", action="store_true", help="FSDP2 CPU offload (dist.offload)")
    p.add_argument("--ema", type=float, default=0.0, help="RL: EMA decay of the policy (sharded on N GPUs)")
    p.add_argument("--prompts", type=int, default=64, help="RL prompts per step")
    p.add_argument("--samples", type=int, default=8, help="RL samples per prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="RL max new tokens")
    p.add_argument("--batch", type=int, default=64, help="SFT samples per optimizer step")
    p.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (gloo ranks)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/scale.py needs CUDA GPUs (or --device cpu for a smoke run)")
    counts = [int(g) for g in args.gpus.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.shape, Path(tmp) / "model")
        for g in counts:
            case = run_rl_case if args.kind == "rl" else run_sft_case
            row = {
                "kind": args.kind,
                "shape": args.shape,
                "gpus": g,
                "offload": args.offload,
                **case(args, model, g, Path(tmp) / f"run{g}"),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            gc.collect()  # the 1-GPU run lives in this process: give its cached GPU memory back
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    base = rows[0]
    for r in rows:
        t, t0 = (
            (r["seconds"]["step"], base["seconds"]["step"])
            if args.kind == "rl"
            else (r["step_s"], base["step_s"])
        )
        r["speedup_vs_first"] = round(t0 / t, 3)
    card = (
        torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu ({platform.processor() or 'x86'})"
    )
    print(f"\n{args.kind} {args.shape} on {card}, fixed global batch; speed-up vs {base['gpus']} GPU(s)")
    if args.kind == "rl":
        print(
            f"{'gpus':>4} {'step s':>8} {'gen s':>8} {'update s':>9} {'refresh s':>10} {'peak GiB':>9} {'speed-up':>9}"
        )
        for r in rows:
            s = r["seconds"]
            print(
                f"{r['gpus']:>4} {s['step']:>8.3f} {s['generation']:>8.3f} {s['update']:>9.3f} "
                f"{s['engine_refresh']:>10.4f} {r['peak_mem_gib']:>9.2f} {r['speedup_vs_first']:>9.2f}"
            )
    else:
        print(f"{'gpus':>4} {'tokens/s':>10} {'step s':>8} {'speed-up':>9}")
        for r in rows:
            print(
                f"{r['gpus']:>4} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.3f} {r['speedup_vs_first']:>9.2f}"
            )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    stamp = {
        "card": card,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    batch = args.prompts * args.samples if args.kind == "rl" else args.batch
    for r in rows:  # keyed by the global batch too: a weak-scaling run must not replace a strong-scaling one
        r["global_batch"] = batch
        key = f"{r['kind']}/{r['shape']}/{r['gpus']}gpu/batch{batch}{'/offload' if r['offload'] else ''}"
        key += f"/ema{args.ema}" if args.ema else ""  # an EMA run must not replace the plain one
        results[key] = {**r, **stamp}
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
