"""Throughput of the one-model trainers on one device: sft, rm, prm, dpo (reference precomputed and on the fly),
kto and kd, each through its own entry point (`run_sft`, `run_rm`, ...) on the same random model shape and
synthetic data of the same lengths.

    python bench/preference.py                                   # qwen0.5b shape on the GPU, every trainer
    python bench/preference.py --shape tiny --device cpu --steps 2 --batch 4    # a CPU smoke run

Model: a random Qwen2 of the shape (bench/scale.py's shapes: the real 152k vocabulary for qwen*, relayrl's char
tokenizer for the text), bf16 compute over fp32 masters on a GPU. Data: random text of 64-1000 tokens per
sequence, a quarter of it prompt (pairs: two responses for one prompt; PRM: a placeholder every ~50 tokens with
random labels; KTO: random desirable labels). KD's teacher is a second random model of the same shape. The
first step is a warm-up; tokens/s is the median over the other steps of the step's real tokens (both sides
of a pair; KTO's KL sequences and the frozen model's forwards are extra work not counted as tokens) divided
by the step's wall time. Peak memory: the process's max allocated CUDA memory during the run.

`generate` (with --gpus 1) is `relayrl generate` on the same prompts: 4 samples each, up to 256 new tokens,
no reward; its tokens/s is generated tokens over the generation time (loading and engine start excluded).

Prints a table and writes bench/results/preference.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results" / "preference.json"
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def write_data(folder: Path, rows: int, seed: int = 0) -> dict[str, Path]:
    """Synthetic files of every format: sft, pairs, unpaired, steps."""
    rng = random.Random(seed)
    files = {k: folder / f"{k}.jsonl" for k in ("sft", "pairs", "unpaired", "steps")}
    with (
        files["sft"].open("w") as sft,
        files["pairs"].open("w") as pairs,
        files["unpaired"].open("w") as unpaired,
        files["steps"].open("w") as steps,
    ):
        for _ in range(rows):
            n = rng.randint(64, 1000)
            prompt, a, b = _text(rng, n // 4), _text(rng, n - n // 4), _text(rng, n - n // 4)
            sft.write(json.dumps({"input": prompt, "output": a}) + "\n")
            pairs.write(json.dumps({"input": prompt, "chosen": a, "rejected": b}) + "\n")
            unpaired.write(json.dumps({"input": prompt, "output": a, "label": rng.random() < 0.5}) + "\n")
            chunks = [a[i : i + 50].replace(";", "") for i in range(0, len(a), 50)]
            text = prompt + "".join(c + ";" for c in chunks)
            steps.write(json.dumps({"input": text, "label": [rng.random() < 0.5 for _ in chunks]}) + "\n")
    return files


def _common(cfg, model: Path, data: Path, args: argparse.Namespace, out: Path):
    from relayrl.config.dist import DistConfig

    return replace(
        cfg,
        model=replace(cfg.model, name_or_path=str(model), dtype="bf16" if args.device == "cuda" else "fp32"),
        data=replace(cfg.data, datasets=[str(data)], max_len=2100, eval_split_ratio=0.0),
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
        ckpt=replace(cfg.ckpt, save_every=0, save_hf_model=True),
        logger=replace(cfg.logger, progress_bar=False),
        dist=DistConfig(
            mode="ray" if args.gpus > 1 else "local",
            num_cpus=max(2, 4 * args.gpus),
            gpus="yes" if args.device == "cuda" else "no",
            num_gpus_per_node=args.gpus,
            timeout_s=900,
        ),
    )


def cases(model: Path, teacher: Path, files: dict[str, Path], args: argparse.Namespace, tmp: Path):
    """name -> (run function, config) for every trainer."""
    from relayrl.config.recipes import (
        DPOConfig,
        DPOSection,
        KDConfig,
        KDSection,
        KTOConfig,
        PRMConfig,
        PRMSection,
        RMConfig,
        SFTConfig,
    )
    from relayrl.trainers.dpo import run_dpo
    from relayrl.trainers.kd import run_kd
    from relayrl.trainers.kto import run_kto
    from relayrl.trainers.prm import run_prm
    from relayrl.trainers.rm import run_rm
    from relayrl.trainers.sft import run_sft

    def c(cfg, data, name):
        return _common(cfg, model, files[data], args, tmp / name)

    return {
        "sft": (run_sft, c(SFTConfig(), "sft", "sft")),
        "rm": (run_rm, c(RMConfig(), "pairs", "rm")),
        "prm": (
            run_prm,
            c(PRMConfig(prm=PRMSection(placeholder=";", reward_tokens=["a", "b"])), "steps", "prm"),
        ),
        "dpo": (run_dpo, c(DPOConfig(), "pairs", "dpo")),
        "dpo_on_the_fly": (run_dpo, c(DPOConfig(dpo=DPOSection(ref_mode="on_the_fly")), "pairs", "dpo2")),
        "kto": (run_kto, c(KTOConfig(), "unpaired", "kto")),
        "kd": (run_kd, c(KDConfig(kd=KDSection(teacher=str(teacher))), "sft", "kd")),
    }


def run_generate_case(model: Path, files: dict[str, Path], args: argparse.Namespace, tmp: Path) -> dict:
    """`relayrl generate` on the SFT file's prompts: 4 samples each, up to 256 new tokens, no reward."""
    from relayrl.apps.generate import run_generate
    from relayrl.config.components import DataConfig, ModelConfig
    from relayrl.config.generate import GenerateConfig
    from relayrl.config.rl import RolloutConfig

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg = GenerateConfig(
        model=ModelConfig(name_or_path=str(model), dtype="bf16" if args.device == "cuda" else "fp32"),
        data=DataConfig(datasets=[str(files["sft"])], max_len=2100),
        rollout=RolloutConfig(n_samples=4, max_new_tokens=256, max_len=2400, prompts_per_step=args.batch * 4),
        output=str(tmp / "generated.jsonl"),
        device=args.device,
    )
    t0 = time.perf_counter()
    result = run_generate(cfg)
    return {
        "tokens_per_s": round(result.tokens_per_s, 1),
        "step_s": round(result.seconds, 4),
        "tokens_per_step": float(result.new_tokens),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else 0.0,
        "wall_s": round(time.perf_counter() - t0, 1),
        "loss_first": 0.0,
        "loss_last": 0.0,
    }


def run_case(fn, cfg) -> dict:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = fn(cfg)
    wall = time.perf_counter() - t0
    hist = result.history[1:] or result.history
    return {
        "tokens_per_s": round(statistics.median(h["perf/tokens_per_s"] for h in hist), 1),
        "step_s": round(statistics.median(h["perf/step_s"] for h in hist), 4),
        "tokens_per_step": round(statistics.mean(h["perf/tokens_per_s"] * h["perf/step_s"] for h in hist), 1),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
        if torch.cuda.is_available()
        else 0.0,
        "wall_s": round(wall, 1),
        "loss_first": round(result.history[0]["train/loss"], 4),
        "loss_last": round(result.history[-1]["train/loss"], 4),
    }


def main() -> None:
    from scale import SHAPES, build_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen0.5b", choices=sorted(SHAPES))
    p.add_argument("--only", default="", help="comma-separated trainers (default: all)")
    p.add_argument("--steps", type=int, default=4, help="steps per trainer (the first is a warm-up)")
    p.add_argument("--batch", type=int, default=32, help="samples (pairs) per optimizer step")
    p.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpus", type=int, default=1, help="ranks (> 1: dist.mode ray, FSDP2 shards)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/preference.py needs a CUDA GPU (or --device cpu for a smoke run)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        model = build_model(args.shape, t / "model")
        torch.manual_seed(1)
        teacher = build_model(args.shape, t / "teacher")
        files = write_data(t, args.batch * (args.steps + 1))
        todo = cases(model, teacher, files, args, t)
        names = [n for n in args.only.split(",") if n] or [*todo, "generate"]
        for name in names:
            if name == "generate":  # one process: the engine on this device
                measured = run_generate_case(model, files, args, t)
            else:
                fn, cfg = todo[name]
                measured = run_case(fn, cfg)
            row = {"trainer": name, "shape": args.shape, "gpus": args.gpus, **measured}
            rows.append(row)
            print(json.dumps(row), flush=True)
    card = (
        torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu ({platform.processor() or 'x86'})"
    )
    print(
        f"\none-model trainers, {args.shape} on {card}: {args.batch} samples / step, budget {args.budget} tokens"
    )
    print(
        f"{'trainer':>15} {'tokens/s':>10} {'step s':>8} {'tokens/step':>12} {'peak GiB':>9} {'loss first->last':>18}"
    )
    for r in rows:
        print(
            f"{r['trainer']:>15} {r['tokens_per_s']:>10.0f} {r['step_s']:>8.3f} {r['tokens_per_step']:>12.0f} "
            f"{r['peak_mem_gib']:>9.2f} {r['loss_first']:>8.4f} -> {r['loss_last']:.4f}"
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    stamp = {
        "card": card,
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    key = f"{args.shape}/gpus{args.gpus}"
    results[key] = {"shape": args.shape, "batch": args.batch, "budget": args.budget, **stamp, "rows": rows}
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
