"""RL step benchmark: the per-step time breakdown (generation, experience, update, sync) and tokens/s.

    .venv/bin/python bench/rl_step.py                                  # tiny model on CPU (the demo's shape)
    .venv/bin/python bench/rl_step.py --device cuda --shape qwen0.5b   # Qwen2.5-0.5B-shaped random model, bf16

    python bench/rl_step.py --device cuda --shape qwen0.5b-char --mode async --engine-device cuda:1   # 2 GPUs
    python bench/rl_step.py --device cuda --shape qwen0.5b-char --dist-mode ray --num-engines 1   # engine actor

Ray mode (--dist-mode ray): the policy over --policy-gpus ranks and --num-engines separate engine actors of
--engine-tp GPUs each (0: engines colocated with the policy's ranks). Idle shares (of the step time; only
with separate engines or --engine-device, else None): in sync mode the trainer's GPUs idle while the engines generate (timing/generation) and separate engines idle for
the rest of the step; in async mode the trainer idles only while it waits for a batch (timing/generation is
that wait) and the engines idle for the step time not spent producing (timing/rollout_produce).

Runs `relayrl rl`'s own loop (local mode, native engine unless --engine, GRPO, no reference) for a few steps on random
weights with a cheap reward (fraction of digit characters, tests/trainers/data/digit_reward.py), drops the
first (warm-up) step, and prints the mean of the remaining steps. Writes bench/results/rl_step.json
(one entry per device/shape, updated in place).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REWARD = ROOT / "tests" / "trainers" / "data" / "digit_reward.py"
RESULTS = ROOT / "bench" / "results" / "rl_step.json"
PARTS = ("generation", "experience", "update", "sync", "engine_refresh", "step")

SHAPES = {
    # name: (Qwen2Config overrides, dtype, prompts per step, samples per prompt, max new tokens, micro-batch
    # tokens). Micro-batches run per-sequence attention (varlen on a GPU, length buckets on a CPU), so the
    # budget only bounds activation memory.
    "tiny": (
        dict(
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "fp32",
        32,
        8,
        6,
        4096,
    ),
    "qwen0.5b": (
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
        "bf16",
        64,
        8,
        256,
        16384,
    ),
}
SHAPES["qwen7b"] = (  # Qwen2.5-7B's shape (untied embeddings are tied here, as in every shape of this file)
    dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),
    *SHAPES["qwen0.5b"][1:],
)
# the same bodies with the char tokenizer's ~100-token vocabulary: random weights then end samples at EOS
for _name in ("qwen0.5b", "qwen7b"):
    SHAPES[f"{_name}-char"] = (
        {k: v for k, v in SHAPES[_name][0].items() if k != "vocab_size"},
        *SHAPES[_name][1:],
    )


def build_model(shape: str, folder: Path) -> Path:
    """A random Qwen2 of the given shape + the tiny char tokenizer, saved as an HF folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    overrides, dtype, *_ = SHAPES[shape]
    overrides = dict(overrides)  # a copy: popping from the table itself made a second call in one process
    config = Qwen2Config(  # build the shape with the tokenizer's ~100-row vocabulary instead
        vocab_size=overrides.pop("vocab_size", len(tok)),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **overrides,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run(
    device: str,
    shape: str,
    steps: int,
    micro_tokens_override: int = 0,
    *,
    mode: str = "sync",
    max_staleness: int = 1,
    engine: str = "native",
    engine_device: str = "",
    off_policy: str = "",
    warmup: int = 1,
    dist_mode: str = "local",
    num_engines: int = 0,
    engine_tp: int = 1,
    policy_gpus: int = 1,
    policy_nodes: int = 1,
    ray_address: str = "",
    exact: bool = False,
    offload: bool = False,
    model_dir: str = "",
    engine_sleep: str = "auto",
    offload_optimizer_in_rollout: bool = False,
    engine_copy: str = "auto",
    gradient_checkpointing: bool = False,
    replicate: bool = False,
) -> dict:
    from relayrl.config.presets import tiny_cpu_config
    from relayrl.trainers.rl.loop import run_rl

    _, dtype, prompts, n, new_tokens, micro_tokens = SHAPES[shape]
    micro_tokens = micro_tokens_override or micro_tokens
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(model_dir) if model_dir else build_model(shape, Path(tmp) / "model")  # or a built one
        cfg = tiny_cpu_config(str(model), str(Path(tmp) / "run"), steps=steps, reward=str(REWARD))
        cfg = replace(
            cfg,
            model=replace(cfg.model, dtype=dtype, gradient_checkpointing=gradient_checkpointing),
            train=replace(cfg.train, device=device, async_train=mode == "async", max_staleness=max_staleness),
            optim=replace(cfg.optim, lr=1e-5),
            task=replace(cfg.task, train_rows=2000),
            rollout=replace(
                cfg.rollout,
                prompts_per_step=prompts,
                n_samples=n,
                max_new_tokens=new_tokens,
                max_len=64 + new_tokens,
                engine=engine,
                engine_device=engine_device,
                exact=exact,
                engine_copy=engine_copy,
            ),
            algo=replace(cfg.algo, micro_batch_tokens=micro_tokens, off_policy=off_policy),
            ckpt=replace(cfg.ckpt, save_final=False),  # steps timed; the final save not waited for
            dist=replace(
                cfg.dist,
                mode=dist_mode,
                num_cpus=max(2, (os.cpu_count() or 2) // 2),
                num_engines=num_engines,
                engine_tp=engine_tp,
                policy_num_gpus_per_node=policy_gpus,
                policy_num_nodes=policy_nodes,
                ray_address=ray_address,
                offload=offload,
                engine_sleep=engine_sleep,  # type: ignore[arg-type]  # DistConfig checks the choice
                offload_optimizer_in_rollout=offload_optimizer_in_rollout,
                replicate=replicate,
            ),
        )
        t0 = time.perf_counter()
        result = run_rl(cfg)
        wall = time.perf_counter() - t0
        nodes = _ray_nodes() if dist_mode == "ray" else None
    if result.exit_code != 0:
        raise SystemExit(f"rl run failed: {result.message}")
    hist = result.history[warmup:] if len(result.history) > warmup else result.history
    mean = {p: statistics.mean(h.get(f"timing/{p}", 0.0) for h in hist) for p in PARTS}
    gen_tokens = statistics.mean(h["rollout/response_len"] * h["rollout/samples"] for h in hist)
    extra = {
        k: round(statistics.mean(h[k] for h in hist), 5)
        for k in sorted(hist[0])
        if k.startswith(("async/", "mismatch/")) and all(k in h for h in hist)
    }
    samples = statistics.mean(h["rollout/samples"] for h in hist)
    produce = statistics.mean(h.get("timing/rollout_produce", h["timing/generation"]) for h in hist)
    separate = bool(
        num_engines or engine_device
    )  # colocated engines: the trainer's GPU is the one generating
    idle = {  # shares of the step (see the module doc); None where the engines share the trainer's GPUs
        "idle_trainer": round(mean["generation"] / mean["step"], 3) if separate else None,
        "idle_engines": round(max(0.0, 1 - produce / mean["step"]), 3) if separate else None,
    }
    return {
        "device": device if device == "cpu" else torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count() if device == "cuda" else 0,
        "mode": mode,
        "engine": engine,
        "engine_device": engine_device or device,
        "max_staleness": max_staleness if mode == "async" else None,
        "dist_mode": dist_mode,
        "policy_gpus": policy_gpus,
        "policy_nodes": policy_nodes,
        "ray_nodes": nodes,
        "num_engines": num_engines,
        "engine_tp": engine_tp,
        **idle,
        "shape": shape,
        "dtype": dtype,
        "prompts_x_samples": f"{prompts}x{n}",
        "max_new_tokens": new_tokens,
        "micro_batch_tokens": micro_tokens,
        "steps_timed": len(hist),
        "seconds": {p: round(v, 4) for p, v in mean.items()},
        "gen_tokens_per_step": round(gen_tokens, 1),
        # async: timing/generation is the trainer's wait; the producer's own time is timing/rollout_produce
        "gen_tokens_per_s": round(
            gen_tokens
            / statistics.mean(h.get("timing/rollout_produce", h["timing/generation"]) for h in hist),
            1,
        ),
        "train_tokens_per_s": round(statistics.mean(h["perf/train_tokens_per_s"] for h in hist), 1),
        "step_tokens_per_s": round(gen_tokens / mean["step"], 1),
        "samples_per_s": round(samples / mean["step"], 2),
        "peak_mem_gib": round(max(h.get("perf/peak_mem_gib", 0.0) for h in hist), 2),
        "per_step": [  # every step, warm-up included: step seconds and generated tokens
            {
                "step": round(h["timing/step"], 4),
                "gen_tokens": h["rollout/response_len"] * h["rollout/samples"],
            }
            for h in result.history
        ],
        **extra,
        "wall_s": round(wall, 1),
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _ray_nodes() -> int | None:
    """Alive nodes of the Ray cluster the run joined (still connected afterwards); None when the run started
    its own local cluster, which it has shut down by now."""
    import ray

    if not ray.is_initialized():
        return None
    return sum(1 for n in ray.nodes() if n.get("Alive"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=6, help="steps to run (the first is not timed)")
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="override the shape's token budget")
    parser.add_argument(
        "--mode", default="sync", choices=["sync", "async"], help="train.async_train off / on"
    )
    parser.add_argument("--max-staleness", type=int, default=1, help="async: train.max_staleness")
    parser.add_argument("--engine", default="native", help="rollout.engine: native | vllm | hf")
    parser.add_argument("--engine-device", default="", help="rollout.engine_device (e.g. cuda:1)")
    parser.add_argument("--off-policy", default="", help="algo.off_policy (tis forces the old-log-prob pass)")
    parser.add_argument("--warmup", type=int, default=1, help="leading steps left out of the means")
    parser.add_argument("--key", default="", help="results key suffix (default: mode, engine, engine device)")
    parser.add_argument("--dist-mode", default="local", choices=["local", "ray"], help="dist.mode")
    parser.add_argument("--num-engines", type=int, default=0, help="ray: dist.num_engines (separate engines)")
    parser.add_argument("--engine-tp", type=int, default=1, help="ray: dist.engine_tp (GPUs per engine)")
    parser.add_argument("--policy-gpus", type=int, default=1, help="ray: dist.policy_num_gpus_per_node")
    parser.add_argument("--policy-nodes", type=int, default=1, help="ray: dist.policy_num_nodes")
    parser.add_argument("--ray-address", default="", help="ray: join this cluster (dist.ray_address)")
    parser.add_argument("--exact", action="store_true", help="rollout.exact (results key suffix /exact)")
    parser.add_argument(
        "--engine-copy",
        default="auto",
        choices=["auto", "yes", "no"],
        help="rollout.engine_copy (results key suffix /copy-<value> unless auto)",
    )
    parser.add_argument("--offload", action="store_true", help="dist.offload (FSDP2 CPU offload, ray mode)")
    parser.add_argument("--grad-ckpt", action="store_true", help="model.gradient_checkpointing")
    parser.add_argument("--replicate", action="store_true", help="dist.replicate (ray mode, whole models)")
    args = parser.parse_args()
    row = run(
        args.device,
        args.shape,
        args.steps,
        args.micro_batch_tokens,
        mode=args.mode,
        max_staleness=args.max_staleness,
        engine=args.engine,
        engine_device=args.engine_device,
        off_policy=args.off_policy,
        warmup=args.warmup,
        dist_mode=args.dist_mode,
        num_engines=args.num_engines,
        engine_tp=args.engine_tp,
        policy_gpus=args.policy_gpus,
        policy_nodes=args.policy_nodes,
        ray_address=args.ray_address,
        exact=args.exact,
        offload=args.offload,
        engine_copy=args.engine_copy,
        gradient_checkpointing=args.grad_ckpt,
        replicate=args.replicate,
    )
    print(
        f"\nRL step, {row['shape']} ({row['dtype']}) on {row['device']}, {row['prompts_x_samples']} samples, "
        f"<= {row['max_new_tokens']} new tokens, mean of {row['steps_timed']} steps"
    )
    print(f"{'part':<12}{'seconds':>10}{'share':>8}")
    for p in PARTS:
        share = row["seconds"][p] / row["seconds"]["step"] * 100
        print(f"{p:<12}{row['seconds'][p]:>10.3f}{share:>7.0f}%")
    print(f"generated tokens/s {row['gen_tokens_per_s']:.0f}  (per step {row['gen_tokens_per_step']:.0f})")
    print(f"train tokens/s     {row['train_tokens_per_s']:.0f}")
    print(
        f"end-to-end generated tokens/s {row['step_tokens_per_s']:.0f}; samples/s {row['samples_per_s']:.2f}"
    )
    print(f"idle share: trainer {row['idle_trainer']}, engines {row['idle_engines']}")
    for k, v in row.items():
        if k.startswith(("async/", "mismatch/")):
            print(f"{k:<34}{v:>12.5f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    key = f"{args.device}/{args.shape}"
    if (
        args.mode != "sync"
        or args.engine != "native"
        or args.engine_device
        or args.key
        or args.dist_mode != "local"
    ):
        key += "/" + (
            args.key
            or f"{args.mode}-{args.engine}"
            + (f"-{args.engine_device}" if args.engine_device else "")
            + (
                f"-ray-p{args.policy_gpus}-e{args.num_engines}x{args.engine_tp}"
                if args.dist_mode == "ray"
                else ""
            )
        )
    key += "/exact" if args.exact else ""
    key += f"/copy-{args.engine_copy}" if args.engine_copy != "auto" else ""
    results[key] = row
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
