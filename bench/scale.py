"""Data-parallel scaling: RL step time and SFT tokens/s on 1 vs N GPUs (strong: fixed global batch; weak:
fixed batch per GPU), peak memory per GPU, engine refresh time; and the 7B runs with a reference / a critic.

    python bench/scale.py rl  --shape qwen0.5b-char --gpus 1,2,4            # RL step, 1 GPU (local) vs N (ray)
    python bench/scale.py rl  --shape qwen0.5b-char --gpus 1,2,4 --weak     # 64 x 8 samples PER GPU
    python bench/scale.py sft --shape qwen0.5b --gpus 1,2,4 --weak          # 64 samples per GPU
    python bench/scale.py rl  --shape qwen7b-char --gpus 4 --algo grpo_ref --prompts 16 --samples 4 \
        --new-tokens 128 --budget 4096 --case-min 200                       # GRPO + reference, 7B, 4 GPUs
    python bench/scale.py rl  --shape qwen7b-char --gpus 4 --algo ppo_critic --grad-ckpt ...  # PPO: critic + ref
    python bench/scale.py rl  --shape qwen1.5b-char --gpus 1,4 --ema 0.99          # EMA (sharded on 4)
    python bench/scale.py sft --shape tiny --gpus 1,2 --device cpu --steps 3 --batch 8  # CPU smoke (gloo)

Every run goes through the product's own entry points (`run_rl`, `run_sft`): 1 GPU is `dist.mode=local`
(what a one-GPU user runs: bf16 compute over fp32 masters), N GPUs is `dist.mode=ray` with N FSDP2 ranks
(engines colocated with the policy ranks). RL variants (--algo): grpo (policy only, no reference: the
scaling tables), grpo_ref (the grpo preset: k3 KL loss against a reference sharded over the policy's GPUs),
ppo_critic (the ppo preset: a critic trained with GAE and a reference, every role on the policy's GPUs).
Random weights of the named shape (relayrl's char tokenizer; the qwen* shapes keep the real 152k
vocabulary, the *-char ones use the tokenizer's ~100 tokens so that random samples end at EOS and lengths
vary). The first step is a warm-up and not timed.

Every figure is the MEDIAN over the timed steps (the first is a warm-up; --steps 6 gives 5 timed), with
`step_s_min` (the fastest step) and `step_s_spread` ((slowest - fastest) / median) beside it; rows are made
from the run folder's metrics.jsonl (bench/scale_plan.py). RL: `seconds` per part (every timing/* metric),
generated tokens/s (`throughput`), `perf/peak_mem_gib` (policy rank 0's peak allocated CUDA memory over a
step), `timing/engine_refresh` (after each optimizer step: the all-gather of the shards into every rank's
engine replica on N GPUs; the cast-copy on 1 GPU). SFT: real tokens per second of the whole step (every
rank). Strong: speed-up = median step(fewest GPUs) / median step(N), efficiency = speed-up x fewest / N.
Weak: efficiency = (median throughput / GPUs) / (the fewest-GPU row's median throughput / GPUs). Every row
also has `gpu_used_gib`: each GPU's peak memory used by all its processes together (policy, reference and
critic actors), sampled from nvidia-smi every 0.5 s; `startup_s`: the case's launch to its first step.

The runs write no final checkpoint or final/ export (`ckpt.save_final false`): the end-of-run save is not
timed and not waited for. `--time-save` turns it on and reports it alone (`save_s`: the last step's metrics
row to the newest file of the checkpoint and the export; `after_steps_s`: to the run's return, shutdown too).

Cases and time: the model is built and every case runs in a child process of its own group. Cases run
largest GPU count first; each may run until --case-timeout, or until the end of its share of --time-budget
(what is left minus --case-min seconds kept for each later case); a case whose share is below --case-min is
not started ("skipped"). A killed case whose run folder holds timed steps still gives its row, `partial: true`
with `partial_reason` (what killed it, the time budget share or --case-timeout, and when: start-up, mid-run,
or after all steps); `killed` says which. After a kill the next case waits (<= 20 s) until the GPUs are
released. After every case the table is written to <out>/scale_<tag>.json (rows by GPU count) and the keyed
results (kind/shape/gpus/batch/variant) to <out>/scale.json, <out> = --out,
else $OUT, else bench/results, so a failure, a timeout or SIGTERM keeps what ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from scale_plan import (  # bench/ is on sys.path as a script
    WARMUP,
    GpuMemory,
    Interrupted,
    NoTimedStep,
    Slot,
    case_slot,
    default_case_min,
    killed_reason,
    raise_interrupted,
    read_metrics,
    rl_row,
    run_killable,
    run_order,
    save_seconds,
    sft_row,
    wait_gpus_released,
)

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


def _dist(cfg_dist, gpus: int, offload: bool, device: str, algo: str = "grpo", replicate: bool = False):
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
        replicate=replicate,
        timeout_s=900,
    )


def _algo(algo_cfg, algo: str):
    if algo == "grpo_ref":
        return replace(algo_cfg, preset="grpo", kl_coef=0.001)
    if algo == "ppo_critic":
        return replace(algo_cfg, preset="ppo", kl_coef=0.01)
    return algo_cfg


def run_rl_case(args: argparse.Namespace, model: Path, gpus: int, out: Path) -> dict:
    """One RL run on `gpus` GPUs (with args.weak args.prompts per GPU); its row from the run's metrics."""
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
        ckpt=replace(cfg.ckpt, save_every=0, save_final=getattr(args, "time_save", False)),
        dist=_dist(cfg.dist, gpus, args.offload, args.device, algo, getattr(args, "replicate", False)),
        ema=getattr(args, "ema", 0.0),
    )
    launched = getattr(args, "case_launched", 0.0) or time.time()
    result = run_rl(cfg)
    if result.exit_code != 0:
        raise RuntimeError(f"rl run failed: {result.message}")
    row = {"algo": algo, "global_batch": prompts * args.samples}
    return {**row, **_ended(rl_row(read_metrics(out), launched=launched), out, launched, args)}


def _ended(row: dict, out: Path, launched: float, args: argparse.Namespace) -> dict:
    """A finished case's wall time, its time after the last step (with --time-save, the save on its own)."""
    history = read_metrics(out)
    row["wall_s"] = round(time.time() - launched, 1)
    row["after_steps_s"] = round(time.time() - history[-1]["time"], 1)  # save/export (if any) + shutdown
    if getattr(args, "time_save", False):
        row["save_s"] = save_seconds(out, history)
    return row


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
        replicate=gpus > 1 and getattr(args, "replicate", False),
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
        ckpt=replace(cfg.ckpt, save_every=0, save_final=getattr(args, "time_save", False)),
        logger=replace(cfg.logger, progress_bar=False),
        dist=d,
    )
    launched = getattr(args, "case_launched", 0.0) or time.time()
    result = run_sft(cfg)
    if result.exit_code != 0:
        raise RuntimeError(f"sft run stopped with exit code {result.exit_code}")
    return {
        "global_batch": batch,
        **_ended(sft_row(read_metrics(out), launched=launched), out, launched, args),
    }


# ------------------------------------------------------------------------------------------ orchestration
def _card(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or 'x86'})"


def _identity(args: argparse.Namespace, algo: str, gpus: int) -> dict:
    """What names a case's row (the parent knows it without the child: a killed case's row has it too)."""
    per_gpu = gpus if args.weak else 1
    batch = args.prompts * per_gpu * args.samples if args.kind == "rl" else args.batch * per_gpu
    row = dict(kind=args.kind, shape=args.shape, gpus=gpus, global_batch=batch, offload=args.offload)
    row["replicate"] = bool(getattr(args, "replicate", False)) and gpus > 1
    row.update(grad_ckpt=args.grad_ckpt, weak=args.weak, steps_asked=args.steps)
    return {**row, "algo": algo} if args.kind == "rl" else row


def _run_dir(model: Path, algo: str, gpus: int) -> Path:
    return model.parent / f"run_{algo}_{gpus}"


def _child(args: argparse.Namespace) -> None:
    """One case (or the model build) in this process: the row (or an error) to args.case_row as JSON."""
    row_file = Path(args.case_row)
    try:
        if args.build_only:
            build_model(args.shape, Path(args.case_model))
            row: dict = {"built": args.case_model}
        else:
            row_file.write_text(json.dumps({"card": _card(args.device)}))  # kept if the case is killed
            g = int(args.gpus)
            case = run_rl_case if args.kind == "rl" else run_sft_case
            row = case(args, Path(args.case_model), g, _run_dir(Path(args.case_model), args.algo, g))
            row.update(_identity(args, args.algo, g), card=_card(args.device))
    except BaseException as e:  # the parent reports it with the case; the traceback is in this log
        row_file.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}))
        raise
    row_file.write_text(json.dumps(row))


def recover_row(
    args: argparse.Namespace,
    algo: str,
    gpus: int,
    run_dir: Path,
    child: dict,
    slot: Slot | None,
    ran_s: float,
    launched: float,
) -> dict:
    """The row of a killed case (`slot` None: the bench was interrupted) from the steps its run folder's
    metrics.jsonl holds: `partial` with the reason when any step was timed, else an error saying when it
    was killed (start-up, mid-run, or after its last step) and by what (its time budget share or the timeout)."""
    history = read_metrics(run_dir)
    reason = killed_reason(slot, ran_s, len(history), args.steps)
    row = {**_identity(args, algo, gpus), "card": child.get("card", ""), "wall_s": round(ran_s, 1)}
    row["killed"] = slot.bound if slot is not None else "interrupted"
    try:
        stats = (rl_row if args.kind == "rl" else sft_row)(history, launched=launched)
    except NoTimedStep as e:
        return {**row, "error": f"{reason}; {e}", "steps_done": len(history)}
    return {**row, **stats, "partial": True, "partial_reason": reason}


def _case(args: argparse.Namespace, algo: str, gpus: int, model: Path, slot: Slot, tmp: Path) -> dict:
    """One case in a child process, killed at the end of its slot; its row (recovered when killed)."""
    launched = time.time()
    argv = [*sys.argv[1:], "--gpus", str(gpus), "--algo", algo, "--case-model", str(model)]
    argv += ["--case-launched", f"{launched:.3f}", "--case-row", str(tmp / f"row_{algo}_{gpus}.json")]
    child, stopped = run_killable([sys.executable, str(Path(__file__).resolve()), *argv], Path(argv[-1]),
                                  slot.seconds)  # fmt: skip
    if stopped is None:  # finished, or failed on its own (the error is in the row)
        return {**_identity(args, algo, gpus), **child}
    ran_s = time.time() - launched
    kept = None if stopped == "interrupted" else slot
    row = recover_row(args, algo, gpus, _run_dir(model, algo, gpus), child, kept, ran_s, launched)
    if kept is not None:  # the next case must not start while the killed one's actors still hold the GPUs
        row["gpu_release_wait_s"] = wait_gpus_released()
    return row


def _summarise(rows: list[dict], kind: str, weak: bool) -> None:
    """Speed-up and efficiency against the completed row with the fewest GPUs of the same RL variant, from
    the rows' MEDIANS (median step seconds; weak: median throughput per GPU)."""
    done = [r for r in rows if "error" not in r and "skipped" not in r]
    for algo in sorted({r.get("algo", "") for r in done}):
        same = sorted((r for r in done if r.get("algo", "") == algo), key=lambda r: r["gpus"])
        base = same[0]
        for r in same:
            if weak:  # throughput per GPU against the base's
                r["efficiency"] = round(
                    (r["throughput"] / r["gpus"]) / (base["throughput"] / base["gpus"]), 3
                )
                continue
            r["speedup_vs_first"] = round(base["step_s"] / r["step_s"], 3)
            r["efficiency"] = round(r["speedup_vs_first"] * base["gpus"] / r["gpus"], 3)


def _print_table(rows: list[dict], args: argparse.Namespace) -> None:
    mode = "weak scaling (batch per GPU fixed)" if args.weak else "fixed global batch"
    print(f"\n{args.kind} {args.shape}, {mode}; medians of the timed steps (min, spread); efficiency from the "
          "medians vs the fewest-GPU row of each variant")  # fmt: skip
    for r in sorted(rows, key=lambda r: (r.get("algo", ""), r.get("gpus", 0))):
        head = f"{r.get('gpus', '?'):>4} {r.get('algo', '')}"
        if "error" in r or "skipped" in r:
            print(f"{head} {r.get('error') or r.get('skipped')}")
            continue
        step = f"step {r['step_s']:.3f} (min {r['step_s_min']:.3f}, spread {r['step_s_spread']:.0%}, n {r['steps_timed']})"
        gpu = f"GPU total {max(r.get('gpu_used_gib', {}).values(), default=0):.1f} GiB"
        tail = f"eff {r.get('efficiency', 0):.2f}" + (
            f" PARTIAL: {r['partial_reason']}" if r.get("partial") else ""
        )
        if args.kind == "rl":
            s = r["seconds"]
            print(f"{head} batch {r['global_batch']:>5} {step} gen {s['generation']:.3f} update {s['update']:.3f} "
                  f"refresh {s['engine_refresh']:.4f} tok/s {r['throughput']:.0f} peak {r['peak_mem_gib']:.1f} GiB "
                  f"({gpu}) {tail}")  # fmt: skip
        else:
            print(f"{head} batch {r['global_batch']:>5} tokens/s {r['tokens_per_s']:.0f} {step} {gpu} {tail}")


def _write(rows: list[dict], args: argparse.Namespace, out_dir: Path, tag: str) -> None:
    """The table as <out>/scale_<tag>.json, and the keyed results file <out>/scale.json updated in place."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = {"host": platform.node(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    rows = sorted(
        rows, key=lambda r: (r.get("algo", ""), r.get("gpus", 0))
    )  # run largest first, shown smallest
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
    p.add_argument("--steps", type=int, default=6, help=f"steps per run (the first {WARMUP} a warm-up)")
    p.add_argument("--offload", action="store_true", help="FSDP2 CPU offload (dist.offload)")
    p.add_argument(
        "--replicate",
        action="store_true",
        help="several GPUs hold the whole model each (dist.replicate), no FSDP2",
    )
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
    p.add_argument(
        "--time-budget", type=float, default=1e9, help="seconds for the whole table (see --case-min)"
    )
    p.add_argument(
        "--case-min", type=float, default=0.0,
        help="seconds a case needs at least: a case is started only if the budget left can give it this much "
        "and keep as much for every later case (0: 30 + 10 x GPUs on cuda, 15 + 5 x ranks on cpu)",
    )  # fmt: skip
    p.add_argument(
        "--time-save", action="store_true",
        help="runs write their final checkpoint and final/ export (off: they end after the last step) and "
        "the row has save_s (the end-of-run save alone) and after_steps_s",
    )  # fmt: skip
    p.add_argument("--case-row", default="", help=argparse.SUPPRESS)  # internal: run one case, row to file
    p.add_argument("--case-model", default="", help=argparse.SUPPRESS)
    p.add_argument("--case-launched", type=float, default=0.0, help=argparse.SUPPRESS)
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
    if args.steps <= WARMUP:
        raise SystemExit(
            f"--steps {args.steps}: at least {WARMUP + 1} (the first {WARMUP} is not timed); 6 gives 5 timed"
        )
    if args.case_row:
        return _child(args)
    signal.signal(signal.SIGTERM, raise_interrupted)  # the running case is killed, its row recovered
    t_start = time.monotonic()
    out_dir = Path(args.out or os.environ.get("OUT") or RESULTS.parent)
    variant = f"_{'_'.join(algos)}" if args.kind == "rl" else ""
    tag = args.tag or f"{args.kind}_{args.shape}{variant}{'_weak' if args.weak else ''}"
    rows: list[dict] = []
    order = [(a, g) for a in algos for g in run_order([int(x) for x in args.gpus.split(",")])]
    needs = [args.case_min or default_case_min(g, args.device) for _, g in order]
    # the model is built in a child, as every case runs in one: this process never holds a GPU
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--build-only", "--case-model",
               str(model), "--case-row", str(Path(tmp) / "build.json")]  # fmt: skip
        built, stopped = run_killable(cmd, Path(tmp) / "build.json", min(args.case_timeout, args.time_budget))
        if stopped or "error" in built:
            raise SystemExit(
                f"bench/scale.py: building the {args.shape} model failed: {built.get('error', stopped)}"
            )
        try:
            for i, (algo, g) in enumerate(order):
                left = args.time_budget - (time.monotonic() - t_start)
                slot = case_slot(left, args.case_timeout, needs[i], needs[i + 1 :])
                if isinstance(slot, str):
                    row = {**_identity(args, algo, g), "skipped": slot}
                else:
                    with GpuMemory() as mem:
                        row = _case(args, algo, g, model, slot, Path(tmp))
                    row["gpu_used_gib"] = mem.peak
                rows.append(row)
                print(json.dumps(row), flush=True)
                _summarise(rows, args.kind, args.weak)
                _write(rows, args, out_dir, tag)  # after every case: a later failure keeps what ran
                if row.get("killed") == "interrupted":
                    raise Interrupted
        except Interrupted:
            _print_table(rows, args)
            raise SystemExit(143) from None
    _print_table(rows, args)
    print(f"wrote {out_dir / f'scale_{tag}.json'} and {out_dir / 'scale.json'}")


if __name__ == "__main__":
    main()
