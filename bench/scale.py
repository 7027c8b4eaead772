"""Data-parallel scaling: RL step time and SFT tokens/s on 1 vs N GPUs (strong: fixed global batch; weak:
fixed batch per GPU), peak memory per GPU, engine refresh time; and the 7B runs with a reference / a critic.

    python bench/scale.py rl  --shape qwen0.5b-char --gpus 1,2,4            # RL step, 1 GPU (local) vs N (ray)
    python bench/scale.py rl  --shape qwen0.5b-char --gpus 1,2,4 --weak     # 64 x 8 samples PER GPU
    python bench/scale.py sft --shape qwen0.5b --gpus 1,2,4 --weak          # 64 samples per GPU
    python bench/scale.py rl  --shape qwen7b-char --gpus 4 --algo grpo_ref --prompts 16 --samples 4 \
        --new-tokens 128 --budget 4096 --steps 3                            # GRPO + reference, 7B, 4 GPUs
    python bench/scale.py rl  --shape qwen7b-char --gpus 4 --algo ppo_critic --grad-ckpt ...  # PPO: critic + ref
    python bench/scale.py rl  --shape qwen1.5b-char --gpus 1,4 --steps 3 --ema 0.99  # EMA (sharded on 4)
    python bench/scale.py sft --shape tiny --gpus 1,2 --device cpu --steps 3 --batch 8  # CPU smoke (gloo)

Every run goes through the product's own entry points (`run_rl`, `run_sft`): 1 GPU is `dist.mode=local`
(what a one-GPU user runs: bf16 compute over fp32 masters), N GPUs is `dist.mode=ray` with N FSDP2 ranks
(engines colocated with the policy ranks). RL variants (--algo): grpo (policy only, no reference: the
scaling tables), grpo_ref (the grpo preset: k3 KL loss against a reference sharded over the policy's GPUs),
ppo_critic (the ppo preset: a critic trained with GAE and a reference, every role on the policy's GPUs).
Random weights of the named shape (relayrl's char tokenizer; the qwen* shapes keep the real 152k
vocabulary, the *-char ones use the tokenizer's ~100 tokens so that random samples end at EOS and lengths
vary). The first step is a warm-up and not timed.

RL: seconds per step (mean of the timed steps) and its parts (every timing/* metric), generated tokens/s,
`perf/peak_mem_gib` (policy rank 0's peak allocated CUDA memory over a step), `timing/engine_refresh` (after
each optimizer step: the all-gather of the shards into every rank's engine replica on N GPUs; the cast-copy
on 1 GPU). SFT: real tokens per second of the whole step (every rank) from the run's metrics, median of
timed steps. Strong: speed-up = time(first) / time(N), efficiency = speed-up x first GPUs / N. Weak:
efficiency = (throughput / GPUs) / (the first row's throughput / GPUs). Every row also has `gpu_used_gib`:
each GPU's peak memory used by all its processes together (policy, reference and critic actors), sampled
from nvidia-smi every 0.5 s.

The model is built and every case runs in a child process of its own group, killed after --case-timeout
seconds; cases that would start after --time-budget seconds are skipped. After every case the table is
written to <out>/scale_<tag>.json and the keyed results (kind/shape/gpus/batch/variant) to <out>/scale.json,
<out> = --out, else $OUT, else bench/results, so a failure or timeout keeps what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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


ALGOS = ("grpo", "grpo_ref", "ppo_critic")
"""RL variants: grpo (policy only, no reference: the scaling tables), grpo_ref (GRPO preset, k3 KL loss
against a reference colocated with the policy), ppo_critic (PPO preset: a critic trained with GAE, KL in the
reward against a reference; every role colocated on the policy's GPUs)."""


def _dist(cfg_dist, gpus: int, offload: bool, device: str, algo: str = "grpo"):
    if gpus <= 1:
        return replace(cfg_dist, mode="local")
    return replace(
        cfg_dist,
        mode="ray",
        num_cpus=max(2, 4 * gpus) if device == "cuda" else 2,
        gpus="yes" if device == "cuda" else "no",
        policy_num_gpus_per_node=gpus,
        ref_num_gpus_per_node=gpus if algo != "grpo" else 1,  # the roles it has, each over the policy's GPUs
        critic_num_gpus_per_node=gpus if algo == "ppo_critic" else 1,
        colocate_policy_ref=algo == "grpo_ref",
        colocate_all=algo == "ppo_critic",
        offload=offload,
        timeout_s=900,
    )


def _algo(algo_cfg, algo: str):
    if algo == "grpo_ref":
        return replace(algo_cfg, preset="grpo", kl_coef=0.001)
    if algo == "ppo_critic":
        return replace(algo_cfg, preset="ppo", kl_coef=0.01)
    return algo_cfg


def run_rl_case(args: argparse.Namespace, model: Path, gpus: int, out: Path) -> dict:
    """One RL run on `gpus` GPUs; with args.weak the prompts per step are args.prompts per GPU."""
    from relayrl.config.presets import tiny_cpu_config
    from relayrl.trainers.rl.loop import run_rl

    algo = getattr(args, "algo", "grpo")
    prompts = args.prompts * (gpus if getattr(args, "weak", False) else 1)
    cfg = tiny_cpu_config(str(model), str(out), steps=args.steps, reward=str(REWARD))
    cfg = replace(
        cfg,
        model=replace(
            cfg.model,
            dtype="bf16" if args.device == "cuda" else "fp32",
            gradient_checkpointing=getattr(args, "grad_ckpt", False),  # policy and critic
        ),
        train=replace(cfg.train, device=args.device),
        optim=replace(cfg.optim, lr=1e-6),
        task=replace(cfg.task, train_rows=max(2000, prompts * args.steps)),
        rollout=replace(
            cfg.rollout,
            prompts_per_step=prompts,
            n_samples=args.samples,
            max_new_tokens=args.new_tokens,
            max_len=64 + args.new_tokens,
        ),
        algo=replace(_algo(cfg.algo, algo), micro_batch_tokens=args.budget),
        ckpt=replace(cfg.ckpt, save_every=0),
        dist=_dist(cfg.dist, gpus, args.offload, args.device, algo),
        ema=getattr(args, "ema", 0.0),
    )
    t0 = time.perf_counter()
    result = run_rl(cfg)
    wall = time.perf_counter() - t0
    if result.exit_code != 0:
        raise RuntimeError(f"rl run failed: {result.message}")
    hist = result.history[1:] if len(result.history) > 1 else result.history
    parts = sorted({k.removeprefix("timing/") for h in hist for k in h if k.startswith("timing/")})
    parts += [
        p for p in ("generation", "experience", "update", "sync", "engine_refresh", "step") if p not in parts
    ]
    sec = {p: round(statistics.mean(h.get(f"timing/{p}", 0.0) for h in hist), 4) for p in parts}
    gen = statistics.mean(h["rollout/response_len"] * h["rollout/samples"] for h in hist)
    return {
        "algo": algo,
        "global_batch": prompts * args.samples,
        "seconds": sec,
        "gen_tokens_per_step": round(gen, 1),
        "step_gen_tokens_per_s": round(gen / sec["step"], 1),
        "throughput": round(gen / sec["step"], 1),
        "peak_mem_gib": round(max(h.get("perf/peak_mem_gib", 0.0) for h in result.history), 2),
        "response_len": round(statistics.mean(h["rollout/response_len"] for h in hist), 1),
        "wall_s": round(wall, 1),
        # start-up: the run's time outside its steps (launch, the roles' loads and sharding, engines, final export)
        "startup_s": round(wall - sum(h.get("timing/step", 0.0) for h in result.history), 1),
        "step_s_by_step": [h.get("timing/step", 0.0) for h in result.history],
        "losses": {k: [h[k] for h in result.history if k in h] for k in ("train/policy_loss", "critic/loss")},
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
    """One SFT run on `gpus` GPUs; with args.weak the batch is args.batch samples per GPU."""
    from relayrl.config.dist import DistConfig
    from relayrl.config.recipes import SFTConfig
    from relayrl.trainers.sft import run_sft

    batch = args.batch * (gpus if getattr(args, "weak", False) else 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = _sft_data(out.parent / f"sft{gpus}.jsonl", batch * (args.steps + 1), 64, 1000, 0)
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
            batch_size=batch,
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
        "global_batch": batch,
        "throughput": round(statistics.median(h["perf/tokens_per_s"] for h in hist), 1),
        "train_losses": [h["train/loss"] for h in result.history],
        "tokens_per_s": round(statistics.median(h["perf/tokens_per_s"] for h in hist), 1),
        "step_s": round(statistics.median(h["perf/step_s"] for h in hist), 4),
        "tokens_per_step": round(statistics.mean(h["perf/tokens_per_s"] * h["perf/step_s"] for h in hist), 1),
        "wall_s": round(wall, 1),
        # start-up: the run's time outside its steps (launch, the load and sharding, final export)
        "startup_s": round(wall - sum(h["perf/step_s"] for h in result.history), 1),
        "step_s_by_step": [h["perf/step_s"] for h in result.history],
        # per-rank balance and the driver's own work (medians; relayrl.trainers.recipe.rank_loads)
        **{
            k.split("/")[1]: round(statistics.median(h[k] for h in hist), 4)
            for k in (
                "timing/pack_s",
                "timing/put_s",
                "perf/rank_tokens_max",
                "perf/rank_tokens_min",
                "perf/rank_run_tokens_max",
                "perf/rank_passes_max",
            )
            if hist and all(k in h for h in hist)
        },
    }


# ------------------------------------------------------------------------------------------ orchestration
class GpuMemory:
    """Peak memory used on each GPU by ALL its processes (policy, reference, critic actors together), from
    nvidia-smi every 0.5 s while a case runs (short spikes between samples are missed); {} without it."""

    def __init__(self) -> None:
        self.peak: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.is_set():
            try:
                lines = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout.splitlines()
            except (OSError, subprocess.SubprocessError):
                return
            for line in lines:
                i, used = (x.strip() for x in line.split(","))
                self.peak[int(i)] = max(self.peak.get(int(i), 0.0), round(float(used) / 1024, 2))
            self._stop.wait(0.5)

    def __enter__(self) -> GpuMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)


def _card(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or 'x86'})"


def _child(args: argparse.Namespace) -> None:
    """One case (or the model build) in this process: the row (or an error) to args.case_row as JSON."""
    row_file = Path(args.case_row)
    try:
        if args.build_only:
            build_model(args.shape, Path(args.case_model))
            row: dict = {"built": args.case_model}
        else:
            g = int(args.gpus)
            case = run_rl_case if args.kind == "rl" else run_sft_case
            row = case(args, Path(args.case_model), g, Path(args.case_model).parent / f"run_{args.algo}_{g}")
            row.update(
                kind=args.kind, shape=args.shape, gpus=g, offload=args.offload, card=_card(args.device)
            )
            row.update(grad_ckpt=args.grad_ckpt, weak=args.weak)
    except BaseException as e:  # the parent reports it with the case; the traceback is in this log
        row_file.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}))
        raise
    row_file.write_text(json.dumps(row))


def _isolated(argv: list[str], row_file: Path, timeout_s: float) -> dict:
    """Run this script with `argv` in its own process group, killed after timeout_s; its row (or the error)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--case-row", str(row_file)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {
            "error": f"timed out after {timeout_s:.0f} s (killed)",
            "wall_s": round(time.perf_counter() - t0, 1),
        }
    finally:  # a timeout, or this process stopped (SIGTERM from an outer `timeout`, Ctrl-C): no orphan case
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the case's own group: its Ray cluster and actors too
            proc.wait()
    row = json.loads(row_file.read_text()) if row_file.is_file() else {}
    if code != 0 and "error" not in row:
        row["error"] = f"exit code {code}"
    return row


def _summarise(rows: list[dict], kind: str, weak: bool) -> None:
    """Speed-up and efficiency against the first completed row (the fewest GPUs) of the same RL variant."""
    done = [r for r in rows if "error" not in r and "skipped" not in r]
    for algo in sorted({r.get("algo", "") for r in done}):
        same = [r for r in done if r.get("algo", "") == algo]
        base = same[0]
        for r in same:
            if weak:  # throughput per GPU against the base's
                r["efficiency"] = round(
                    (r["throughput"] / r["gpus"]) / (base["throughput"] / base["gpus"]), 3
                )
                continue
            t, t0 = (
                (r["seconds"]["step"], base["seconds"]["step"])
                if kind == "rl"
                else (r["step_s"], base["step_s"])
            )
            r["speedup_vs_first"] = round(t0 / t, 3)
            r["efficiency"] = round(r["speedup_vs_first"] * base["gpus"] / r["gpus"], 3)


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    mode = "weak scaling (batch per GPU fixed)" if args.weak else "fixed global batch"
    print(f"\n{args.kind} {args.shape}, {mode}; efficiency vs the first row of each variant")
    for r in rows:
        if "error" in r or "skipped" in r:
            print(f"{r.get('gpus', '?'):>4} {r.get('algo', '')} {r.get('error') or r.get('skipped')}")
        elif args.kind == "rl":
            s = r["seconds"]
            print(
                f"{r['gpus']:>4} {r['algo']} batch {r['global_batch']:>5} step {s['step']:.3f} gen {s['generation']:.3f} "
                f"update {s['update']:.3f} refresh {s['engine_refresh']:.4f} tok/s {r['throughput']:.0f} "
                f"peak {r['peak_mem_gib']:.1f} GiB (GPU total {max(r['gpu_used_gib'].values(), default=0):.1f}) "
                f"eff {r.get('efficiency', 0):.2f}"
            )
        else:
            print(
                f"{r['gpus']:>4} batch {r['global_batch']:>5} tokens/s {r['tokens_per_s']:.0f} step "
                f"{r['step_s']:.3f} GPU total {max(r['gpu_used_gib'].values(), default=0):.1f} GiB "
                f"eff {r.get('efficiency', 0):.2f}"
            )


def _write(rows: list[dict], args: argparse.Namespace, out_dir: Path, tag: str) -> None:
    """The table as <out>/scale_<tag>.json, and the keyed results file <out>/scale.json updated in place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    table = {"argv": sys.argv[1:], "weak": args.weak, **stamp, "rows": rows}
    (out_dir / f"scale_{tag}.json").write_text(json.dumps(table, indent=1) + "\n")
    results_file = out_dir / "scale.json"
    results = json.loads(results_file.read_text()) if results_file.is_file() else {}
    for r in rows:  # keyed by the global batch and variant: a weak-scaling run must not replace a strong one
        if "error" in r or "skipped" in r:
            continue
        key = f"{r['kind']}/{r['shape']}/{r['gpus']}gpu/batch{r['global_batch']}{'/offload' if r['offload'] else ''}"
        key += f"/ema{args.ema}" if args.ema else ""
        key += "/grad_ckpt" if r.get("grad_ckpt") else ""
        key += f"/{r['algo']}" if r.get("algo", "grpo") != "grpo" else ""
        results[key] = {**r, **stamp}
    results_file.write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("kind", choices=["rl", "sft"])
    p.add_argument("--shape", default="qwen0.5b-char", choices=sorted(SHAPES))
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU counts to compare")
    p.add_argument("--weak", action="store_true", help="weak scaling: --prompts / --batch are per GPU")
    p.add_argument("--algo", default="grpo", help="RL: grpo, grpo_ref, ppo_critic, or several (comma)")
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    p.add_argument("--offload", action="store_true", help="FSDP2 CPU offload (dist.offload)")
    p.add_argument("--grad-ckpt", action="store_true", help="RL: gradient checkpointing (policy and critic)")
    p.add_argument("--ema", type=float, default=0.0, help="RL: EMA decay of the policy (sharded on N GPUs)")
    p.add_argument("--prompts", type=int, default=64, help="RL prompts per step (per GPU with --weak)")
    p.add_argument("--samples", type=int, default=8, help="RL samples per prompt")
    p.add_argument("--new-tokens", type=int, default=256, help="RL max new tokens")
    p.add_argument(
        "--batch", type=int, default=64, help="SFT samples per optimizer step (per GPU with --weak)"
    )
    p.add_argument("--budget", type=int, default=16384, help="tokens per micro-batch")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (gloo ranks)")
    p.add_argument("--out", default="", help="output folder (default $OUT, else bench/results)")
    p.add_argument("--tag", default="", help="name of the table file scale_<tag>.json")
    p.add_argument("--case-timeout", type=float, default=300, help="seconds before a case is killed")
    p.add_argument("--time-budget", type=float, default=1e9, help="seconds for all cases: later ones skipped")
    p.add_argument("--case-row", default="", help=argparse.SUPPRESS)  # internal: run one case, row to file
    p.add_argument("--case-model", default="", help=argparse.SUPPRESS)
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.kind == "sft" and args.budget <= 0:
        # RL reads 0 as "size micro-batches automatically"; SFT's train.max_tokens_per_micro_batch 0 means no
        # token budget, i.e. micro_batch_size (1 here) samples a micro-batch: a 10x slower step that looks valid.
        raise SystemExit(
            f"--budget {args.budget}: SFT needs a token budget per micro-batch (e.g. the default 16384); 0 is "
            "automatic sizing for rl only, and for sft would train one sample per micro-batch"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/scale.py needs CUDA GPUs (or --device cpu for a smoke run)")
    algos = args.algo.split(",")
    if any(a not in ALGOS for a in algos) or (args.kind == "sft" and algos != ["grpo"]):
        raise SystemExit(f"--algo: RL variants from {ALGOS} (comma-separated), got {args.algo!r}")
    if args.case_row:
        return _child(args)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: _isolated kills the running case
    t_start = time.monotonic()
    out_dir = Path(args.out or os.environ.get("OUT") or RESULTS.parent)
    variant = f"_{'_'.join(algos)}" if args.kind == "rl" else ""
    tag = args.tag or f"{args.kind}_{args.shape}{variant}{'_weak' if args.weak else ''}"
    rows: list[dict] = []
    # the model is built in a child, as every case runs in one: this process never holds a GPU
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        built = _isolated([*sys.argv[1:], "--build-only", "--case-model", str(model)], Path(tmp) / "build.json",
                          args.case_timeout)  # fmt: skip
        if "error" in built:
            raise SystemExit(f"bench/scale.py: building the {args.shape} model failed: {built['error']}")
        for algo, g in [(a, int(x)) for a in algos for x in args.gpus.split(",")]:
            left = args.time_budget - (time.monotonic() - t_start)
            if left < 60:
                rows.append(
                    {"gpus": g, "algo": algo, "skipped": f"time budget {args.time_budget:.0f} s spent"}
                )
                continue
            with GpuMemory() as mem:
                argv = [*sys.argv[1:], "--gpus", str(g), "--algo", algo, "--case-model", str(model)]
                row = _isolated(argv, Path(tmp) / f"row_{algo}_{g}.json", min(args.case_timeout, left))
            row.update(gpus=g, gpu_used_gib=mem.peak)
            if args.kind == "rl":
                row.setdefault("algo", algo)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _summarise(rows, args.kind, args.weak)
            _write(rows, args, out_dir, tag)  # after every case: a later failure keeps what ran
    _print_table(rows, args)
    print(f"wrote {out_dir / f'scale_{tag}.json'} and {out_dir / 'scale.json'}")


if __name__ == "__main__":
    main()
