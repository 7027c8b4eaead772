"""Exact on-policy mode (rollout.exact): the engine-vs-trainer log-prob mismatch and the cost per phase, exact
against the default mode, on the same prompts and weights.

    .venv/bin/python bench/exact_mode.py                                # tiny Qwen2 on the CPU (fp32)
    python bench/exact_mode.py --device cuda --shape qwen0.5b           # 0.5B-shaped random Qwen2 on a GPU

On a GPU the setup is the RL trainer's: the engine runs a bf16 copy of the weights (CUDA graphs), the trainer
fp32 master weights under bf16 autocast (default mode: the varlen layout; exact: the exact layout). Phases,
each timed after a warm-up run (CUDA synchronised):
  generation   the native engine over prompts x n samples (random prompt ids, no EOS: every sample runs
               max_new_tokens), seconds and generated tokens/s
  logprobs     the trainer's no-grad log-prob pass over every sequence (micro-batches of --micro-seqs)
  train        forward + backward of the same pass with entropy (the update's forward)
(CPU: process CPU seconds, the best of two runs after a warm-up; GPU: wall seconds likewise.) Mismatch over
the sampled tokens: mean / max |engine - trainer| log-prob, the share of tokens bit-equal and
the share of sequences whose ratio exp(sum diff) is outside [0.5, 2]; the same of the update's (grad-enabled)
forward: `first_step_ratio_min/max`, exp(update forward - engine) over every sampled token (exactly 1 in exact
mode: the first step's PPO ratio).
Correctness against the default mode (`logits`): engine-vs-trainer equality cannot see a bug both sides share,
so the full-vocabulary logits of exact mode's forward and of the model's own forward on the same inputs are
compared (max |diff|, KL, each against the fp32 master, P(id 1)). On a GPU, exact mode's generation is timed
again with one 128-column matmul tile for every weight (`fixed_tiles`: what exact_kernels.mm_tile_n's tiles
per weight shape save).
With --rl-steps S (GPU default 3) it then runs bench/rl_step.py's workload (`relayrl rl`'s own loop, GRPO) for
S steps in each mode on ONE model folder and reports the mean step time after the first and its parts, exact
over default (the issue's target: <= 1.3x), and the same per generated token: EOS ends samples in that
workload, so step times compare only at equal generated tokens (`equal_tokens`: within 2%; before this was
checked, a shared shape table made the second mode's model get the tokenizer's ~100-row vocabulary, and its
samples ended 2.4x sooner). Compact `[...]` summary lines go to stdout. The exit status is 1 when exact mode
is not bit-equal. Writes $OUT/exact_mode.json when OUT is set, else bench/results/exact_mode.json (one entry per
device/shape, updated in place, rewritten after every part so a cut-off run keeps what it measured).

    python bench/exact_mode.py --device cuda --shape qwen0.5b --prompts 16     # ~3 min on one H100 / H200
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from relayrl.models import forward
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, exact_kernels, generate_all
from relayrl.rollout import exact as exact_module

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ),
    "qwen0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
}


def build(shape: str, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(max_position_embeddings=4096, tie_word_embeddings=True, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # livelier than the default init (std 0.02): samples are not uniform noise
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    return model.float().eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def phase(device: str, fn, repeats: int = 3):
    """(result, seconds): after a warm-up run, the fastest of the others; on a CPU process CPU seconds (a
    shared CPU's wall time is mostly other processes' load), on a GPU wall seconds."""
    out, best = None, float("inf")
    for i in range(repeats):
        _sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        _sync(device)
        secs = time.perf_counter() - t0 if device == "cuda" else time.process_time() - c0
        best = min(best, secs) if i else best
    return out, best


def run_mode(args, master: torch.nn.Module, engine_model: torch.nn.Module, prompts, exact: bool) -> dict:
    dev = args.device
    engine = build_engine(
        "native",
        engine_model,
        None,
        max_slots=len(prompts) * args.n,
        max_seq_len=args.max_len,
        eos_token_id=[],
        exact=exact,
        driver="loop" if dev == "cpu" else None,
    )
    reqs = [
        GenerationRequest(
            prompt_ids=p,
            params=SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=i),
        )
        for i, p in enumerate(prompts)
    ]
    results, gen_s = phase(dev, lambda: generate_all(engine, reqs))
    cache = getattr(engine, "graphs", None)  # the native engine's GraphCache (None without CUDA graphs)
    graphs = list(cache.graphs.values()) if cache is not None else []
    engine.close()
    seqs, spans, engine_lps = [], [], []
    for p, res in zip(prompts, results, strict=True):
        for c in res.completions:
            seqs.append(torch.tensor(p + c.token_ids))
            spans.append((len(p), len(p) + len(c.token_ids)))
            engine_lps.append(torch.tensor(c.logprobs))
    layout = "exact" if exact else forward.choose_layout(master, dev)
    forward.prepare_model(master, layout)
    autocast = torch.autocast("cuda", torch.bfloat16) if dev == "cuda" else contextlib.nullcontext()

    def pass_(grad: bool):
        outs = []
        for i in range(0, len(seqs), args.micro_seqs):
            with autocast, torch.set_grad_enabled(grad):
                lp, ent = forward.token_logprobs(master, seqs[i : i + args.micro_seqs], layout, entropy=grad)
            if grad and ent is not None:
                (lp.sum() + ent.sum()).backward()
            outs.append(lp.detach().float().cpu())
        return torch.cat(outs)

    lp, lp_s = phase(dev, lambda: pass_(False))
    train_lp, train_s = phase(dev, lambda: pass_(True))
    master.zero_grad(set_to_none=True)

    def against_engine(lp_all: torch.Tensor | None) -> list[torch.Tensor]:
        assert lp_all is not None
        flat = forward.split_flat(lp_all, [len(s) for s in seqs])
        return [row[a:b] - e for row, (a, b), e in zip(flat, spans, engine_lps, strict=True)]

    diffs = against_engine(lp)
    all_d = torch.cat(diffs).double()
    ratio = torch.cat(against_engine(train_lp)).double().exp()
    gen_tokens = sum(len(e) for e in engine_lps)
    return {
        "generation_s": gen_s,
        "gen_tokens_per_s": gen_tokens / gen_s,
        "logprobs_s": lp_s,
        "train_fwd_bwd_s": train_s,
        "mismatch_mean": float(all_d.abs().mean()),
        "mismatch_max": float(all_d.abs().max()),
        "tokens_bit_equal": float((all_d == 0).double().mean()),
        "seq_ratio_out_frac": sum(abs(float(d.double().sum())) > math.log(2) for d in diffs) / len(diffs),
        "first_step_ratio_min": float(ratio.min()),
        "first_step_ratio_max": float(ratio.max()),
        "cuda_graphs": {
            "captured": sum(g is not None for g in graphs),
            "failed": sum(g is None for g in graphs),
        },
        "exact_kernels": bool(exact and exact_module.use_kernels(torch.device(dev))),
    }


def rl_steps(args, row: dict, save) -> None:
    """bench/rl_step.py's workload (its shape table, `relayrl rl`'s own loop) in each mode, on ONE model folder
    built once (the same weights and vocabulary in both modes); mean step parts, and the same per generated /
    trained token, since EOS ends samples here and step time alone compares only equal token counts."""
    sys.path.insert(0, str(ROOT / "bench"))
    import rl_step  # bench/rl_step.py

    steps: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = rl_step.build_model(args.shape, Path(tmp) / "model")
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        for mode in ("default", "exact"):
            t0 = time.perf_counter()
            res = rl_step.run(
                args.device, args.shape, args.rl_steps, exact=mode == "exact", model_dir=str(folder)
            )
            s = res["seconds"]
            tokens = res["gen_tokens_per_step"]
            steps[mode] = {
                "vocab_size": vocab,
                "seconds": s,
                "gen_tokens_per_step": tokens,
                "ms_per_1k_gen_tokens": {p: 1e6 * s[p] / tokens for p in ("generation", "step")},
                "train_tokens_per_s": res["train_tokens_per_s"],
                "per_step": res["per_step"],
                "peak_mem_gib": res["peak_mem_gib"],
                "gen_tokens_per_s": res["gen_tokens_per_s"],
                **{k: v for k, v in res.items() if k.startswith("mismatch/")},
                "wall_s": round(time.perf_counter() - t0, 1),
            }
            row["rl_step"] = steps
            save()
    d, e = steps["default"], steps["exact"]
    ratio = e["gen_tokens_per_step"] / d["gen_tokens_per_step"]
    steps["exact_over_default"] = {
        **{p: e["seconds"][p] / d["seconds"][p] for p in ("generation", "update", "step") if d["seconds"][p] > 0},
        **{f"{p}_per_gen_token": e["ms_per_1k_gen_tokens"][p] / d["ms_per_1k_gen_tokens"][p]
           for p in ("generation", "step")},
        "train_tokens_per_s": e["train_tokens_per_s"] / d["train_tokens_per_s"],
        "gen_tokens": ratio,
    }  # fmt: skip
    # step time compares the modes only at (nearly) equal generated tokens; else read the per-token ratios
    steps["equal_tokens"] = abs(ratio - 1) <= 0.02
    save()


def logits_check(args, master: torch.nn.Module, engine_model: torch.nn.Module) -> dict:
    """Exact vs default mode on the SAME inputs (random ids, 4 x 64 tokens): the full-vocabulary logits of the
    engine's weights through exact mode's forward (ExactRunner: the kernels on CUDA) and through the model's
    own forward (the function the default engine computes), and both against the fp32 master's forward. Max
    |logit diff|, KL(default || exact) per position (mean, max), and the mean probability of id 1 (rl_step's
    char-tokenizer EOS): a bug shared by engine and trainer shows here, never in the mismatch."""
    vocab = SHAPES[args.shape]["vocab_size"]
    ids = torch.randint(3, vocab, (4, 64), generator=torch.Generator().manual_seed(1)).to(args.device)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        ref = master(ids).logits.float()
        default = engine_model(ids).logits.float()
        runner = exact_module.ExactRunner(engine_model, ids.shape[1])
        exact = runner._head(runner._stack(ids, pos, lambda li, k, v: (k, v), causal=True)).float()
        ld, le = default.log_softmax(-1), exact.log_softmax(-1)
        kl = (ld.exp() * (ld - le)).sum(-1)
        out = {
            "max_abs_diff": float((exact - default).abs().max()),
            "kl_mean": float(kl.mean()),
            "kl_max": float(kl.max()),
            "default_vs_fp32_max_abs": float((default - ref).abs().max()),
            "exact_vs_fp32_max_abs": float((exact - ref).abs().max()),
            "p_id1_default": float(ld[..., 1].exp().mean()),
            "p_id1_exact": float(le[..., 1].exp().mean()),
            "exact_kernels": runner.triton,
        }
    del ref, default, exact, ld, le
    return out


def gen_fixed_tiles(args, engine_model: torch.nn.Module, prompts) -> dict:
    """Exact mode's generation with the first GPU version's one 128-column matmul tile for every weight
    (exact_kernels.MM_TILES "fixed") instead of tiles per weight shape: what the per-shape tiles save."""
    old = exact_kernels.MM_TILES
    exact_kernels.MM_TILES = "fixed"
    try:
        engine = build_engine(
            "native", engine_model, None, max_slots=len(prompts) * args.n, max_seq_len=args.max_len,
            eos_token_id=[], exact=True,
        )  # fmt: skip
        reqs = [
            GenerationRequest(
                prompt_ids=p,
                params=SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=i),
            )
            for i, p in enumerate(prompts)
        ]
        results, secs = phase(args.device, lambda: generate_all(engine, reqs), repeats=2)
        engine.close()
    finally:
        exact_kernels.MM_TILES = old
    assert results is not None
    tokens = sum(len(c.token_ids) for r in results for c in r.completions)
    return {"generation_s": secs, "gen_tokens_per_s": tokens / secs}


def guarded(fn) -> dict:
    """fn()'s result ({} for None), or {"error": ...} when it raised: a later part of the run still runs."""
    try:
        return fn() or {}
    except Exception as e:  # (a partial result beats none on a shared GPU)
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


def summary(row: dict) -> list[str]:
    """Compact stdout lines of what `row` holds so far."""
    d, e, r = row["default"], row["exact"], row["exact_over_default"]
    lines = [
        f"[phases] default/exact s: generation {d['generation_s']:.3f}/{e['generation_s']:.3f} "
        f"(x{r['generation_s']:.2f}), logprobs {d['logprobs_s']:.3f}/{e['logprobs_s']:.3f} "
        f"(x{r['logprobs_s']:.2f}), train {d['train_fwd_bwd_s']:.3f}/{e['train_fwd_bwd_s']:.3f} "
        f"(x{r['train_fwd_bwd_s']:.2f})",
        f"[mismatch] default mean {d['mismatch_mean']:.2e} max {d['mismatch_max']:.2e}; exact mean "
        f"{e['mismatch_mean']:.2e} max {e['mismatch_max']:.2e}, first-step ratio [{e['first_step_ratio_min']}, "
        f"{e['first_step_ratio_max']}]; bit_equal {row['bit_equal']}",
    ]
    if "error" in row.get("logits", {}):
        lines.append(f"[logits] {row['logits']['error']}")
    elif "logits" in row:
        lg = row["logits"]
        lines.append(
            f"[logits] exact vs default: max|diff| {lg['max_abs_diff']:.3g}, KL mean {lg['kl_mean']:.3g} max "
            f"{lg['kl_max']:.3g}; vs fp32 master: default {lg['default_vs_fp32_max_abs']:.3g}, exact "
            f"{lg['exact_vs_fp32_max_abs']:.3g}; P(id 1) default {lg['p_id1_default']:.3g} exact "
            f"{lg['p_id1_exact']:.3g}"
        )
    if "error" in row.get("fixed_tiles", {}):
        lines.append(f"[tiles] {row['fixed_tiles']['error']}")
    elif "fixed_tiles" in row:
        ft = row["fixed_tiles"]
        lines.append(
            f"[tiles] exact generation: per-shape tiles {e['generation_s']:.3f} s, fixed 128-column tiles "
            f"{ft['generation_s']:.3f} s"
        )
    rl, nan = row.get("rl_step"), float("nan")
    if isinstance(rl, dict) and "exact_over_default" in rl:
        x = rl["exact_over_default"]
        lines.append(
            f"[rl_step] vocab {rl['default']['vocab_size']}, gen tokens/step default "
            f"{rl['default']['gen_tokens_per_step']:.0f} exact {rl['exact']['gen_tokens_per_step']:.0f} "
            f"(equal: {rl['equal_tokens']}); exact/default: step x{x.get('step', nan):.2f}, generation "
            f"x{x.get('generation', nan):.2f}, update x{x.get('update', nan):.2f}; per generated token: step "
            f"x{x['step_per_gen_token']:.2f}, generation x{x['generation_per_gen_token']:.2f}; train tokens/s "
            f"x{x['train_tokens_per_s']:.2f}"
        )
    elif isinstance(rl, dict):
        done = [m for m in ("default", "exact") if m in rl]
        lines.append(f"[rl_step] incomplete (modes done: {done}): {rl.get('error', '')}")
    elif rl is not None:
        lines.append(f"[rl_step] {rl}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=0, help="prompts (0: 8 on CPU, 32 on GPU)")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=0, help="new tokens (0: 24 on CPU, 256 on GPU)")
    parser.add_argument("--micro-seqs", type=int, default=16, help="sequences per trainer micro-batch")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (1: steadier CPU seconds)")
    parser.add_argument(
        "--rl-steps", type=int, default=-1, help="rl_step.py workload steps per mode (-1: 3 on GPU, 0 on CPU)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=230, help="skip the rl_step part when past 55%% of this (seconds)"
    )
    parser.add_argument(
        "--exact-impl",
        default="auto",
        choices=["auto", "torch"],
        help="exact mode's forward: auto (Triton kernels on CUDA) or torch (the CPU ops, on any device: the "
        "earlier GPU implementation, for comparison; results key suffix /torch-ops)",
    )
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    if args.exact_impl == "torch":  # both sides (engine and trainer) read exact.use_kernels
        exact_module.use_kernels = lambda device: False
    gpu = args.device == "cuda"
    args.rl_steps = (3 if gpu else 0) if args.rl_steps < 0 else args.rl_steps
    if not gpu:
        torch.set_num_threads(args.threads)
    args.prompts = args.prompts or (32 if gpu else 8)
    args.new_tokens = args.new_tokens or (256 if gpu else 24)
    args.max_len = 128 + args.new_tokens
    master = build(args.shape, args.device)
    engine_model = copy.deepcopy(master).to(torch.bfloat16) if gpu else master
    gen = torch.Generator().manual_seed(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [
        torch.randint(3, vocab, (int(n),), generator=gen).tolist()
        for n in torch.randint(8, 128, (args.prompts,), generator=gen)
    ]
    out = (
        Path(os.environ["OUT"]) / "exact_mode.json"
        if os.environ.get("OUT")
        else (ROOT / "bench" / "results" / "exact_mode.json")
    )
    row: dict = {}

    def save() -> None:
        row["wall_s"] = round(time.perf_counter() - t_start, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        results = json.loads(out.read_text()) if out.is_file() else {}
        results[f"{args.device}/{args.shape}" + ("/torch-ops" if args.exact_impl == "torch" else "")] = row
        out.write_text(json.dumps(results, indent=2) + "\n")

    row["setup"] = {
        "device": torch.cuda.get_device_name() if gpu else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "prompts": args.prompts,
        "n": args.n,
        "new_tokens": args.new_tokens,
        "engine_dtype": "bf16" if gpu else "fp32",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for mode in ("default", "exact"):
        row[mode] = run_mode(args, master, engine_model, prompts, mode == "exact")
        save()
    row["exact_over_default"] = {
        k: row["exact"][k] / row["default"][k] for k in ("generation_s", "logprobs_s", "train_fwd_bwd_s")
    }
    ex = row["exact"]
    row["bit_equal"] = (
        ex["mismatch_max"] == 0.0 and ex["first_step_ratio_min"] == ex["first_step_ratio_max"] == 1.0
    )
    save()
    row["logits"] = guarded(lambda: logits_check(args, master, engine_model))
    save()
    print("\n".join(summary(row)), flush=True)
    if args.rl_steps and time.perf_counter() - t_start > 0.55 * args.budget_s:
        row["rl_step"] = f"skipped: {time.perf_counter() - t_start:.0f} s spent of --budget-s {args.budget_s}"
        save()
        print(summary(row)[-1])
    elif args.rl_steps:
        master.cpu()  # (the RL part loads its own model; the engine copy stays for the tile timing below)
        if gpu:
            torch.cuda.empty_cache()
        failed = guarded(lambda: rl_steps(args, row, save))
        if failed:
            row["rl_step"] = {**row.get("rl_step", {}), **failed}
            save()
        print(summary(row)[-1])
    # last (the least important part): exact generation with one 128-column tile for every weight
    if gpu and args.exact_impl == "auto" and time.perf_counter() - t_start < 0.85 * args.budget_s:
        row["fixed_tiles"] = guarded(lambda: gen_fixed_tiles(args, engine_model, prompts))
        save()
        print(next(line for line in summary(row) if line.startswith("[tiles]")))
    print(f"wrote {out}; exact mode bit-equal: {row['bit_equal']}")
    if not row["bit_equal"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
