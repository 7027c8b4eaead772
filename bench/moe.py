"""Mixture-of-experts rollout: native engine tokens/s against vLLM on a Qwen3-MoE shape, and the routing-replay
mismatch (engine vs trainer log-probs with and without replayed routes) in bf16.

    python bench/moe.py                                   # GPU: Qwen3-30B-A3B widths, 16 of its 48 layers
    python bench/moe.py --device cpu --shape tiny         # CPU smoke run and the CPU bf16 mismatch numbers
    python bench/moe.py --skip-vllm --skip-mismatch --kernels on,off     # the MoE decode kernels A/B (< 4 min)

Shape "qwen3-30b-a3b" (Qwen3-30B-A3B's config, fewer layers: --layers, default 16): hidden 2048, 32 query /
4 KV heads of 128, 128 experts of width 768 per layer, top-8 routing renormalised, vocabulary 151936, bf16,
random weights. 16 layers are ~10B parameters (20 GB), so native and vLLM each fit one H100 in turn.

Phases (each written to the JSON as soon as it is done, so a timeout keeps what finished):
  layer      (CUDA; bench/moe_layer.py) one decode step's MoE blocks alone, --prompts tokens through every
             layer's sparse block in one CUDA graph: the torch path (fp32 router, softmax / top-k, grouped GEMMs) against the fused
             kernels (rollout/moe_kernels.py), the experts alone each way, and the kernels' tile configs
             (--sweep); microseconds per layer and the expert weights' read bandwidth.
  native_<v> for each of --kernels: "on" (the engine's default: fused decode kernels with the MoE kernels),
             "off" (the MoE blocks through the grouped-GEMM torch path, the other fused kernels on), "none"
             (fused_kernels=False).
  mismatch   the native engine (bf16 weights, CUDA graphs on a GPU, routes recorded) samples --mm-prompts
             prompts x --mm-new tokens at temperature 1; the trainer's forward (relayrl.models.forward, the
             device's default layout, on the same bf16 weights) recomputes every sampled token's log-prob
             without and with routing replay. Reported: mean |engine - trainer| log-prob, the share of tokens
             and of sequences whose ratio exp(diff) (sequence: exp(sum diff)) is outside [0.5, 2], the share
             of (token, layer) routes the trainer picks differently from the engine, and the forward's time
             each way; then again with the trainer's router perturbed (--router-noise 0.05 x its std: a
             stale or quantised engine). Before it the router and the LM head are re-drawn with std gain / sqrt(hidden)
             (--router-gain 2, --head-gain 8): HF's 0.02 init leaves both near-uniform (no route or
             token is ever close to decided), unlike a trained model.
  native     tokens/s of the native engine: --prompts random prompts of --prompt-len tokens, --new-tokens
             each, EOS ignored, temperature 1; as bench/rollout.py's fair protocol: one full-size warm-up
             round, then --rounds timed rounds with fresh prompts; tokens/s is their median (min, max kept).
  vllm       the same workload and rounds through vLLM (if it imports; else skipped with the reason), dummy
             weights of the same config, in a subprocess with what is left of --budget-s.
Writes $OUT/moe.json (or bench/results/moe.json).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relayrl.models import forward  # noqa: E402
from relayrl.models.moe import install_moe, moe_pass  # noqa: E402
from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all  # noqa: E402
from relayrl.rollout import moe_kernels as MK  # noqa: E402
from relayrl.rollout import native_moe as NM  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from moe_layer import layer_bench  # noqa: E402  (the bench folder is put on the path first)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": dict(
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        intermediate_size=6144,
        vocab_size=151936,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        intermediate_size=256,
        vocab_size=512,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}


def config(shape: str, layers: int):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**SHAPES[shape], num_hidden_layers=layers, pad_token_id=0)
    cfg.eos_token_id = cfg.bos_token_id = None
    return cfg


def build(shape: str, layers: int, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(config(shape, layers))
    finally:
        torch.set_default_dtype(default)
    model: Any = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)  # an engine's frozen copy
    model.generation_config.eos_token_id = None
    install_moe(model)
    return model


def requests(n: int, prompt_len: int, new: int, vocab: int, seed: int) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (n, prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_new_tokens=new, seed=seed)
    return [
        GenerationRequest(prompt_ids=row, params=params, request_id=f"r{seed}-{i}")
        for i, row in enumerate(ids)
    ]


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------- mismatch
@torch.no_grad()
def redraw(model: torch.nn.Module, router_gain: float, head_gain: float) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight") or name == "lm_head.weight":
            gain = router_gain if "gate" in name else head_gain
            p.copy_(
                torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
                * gain
                / p.shape[1] ** 0.5
            )


@torch.no_grad()
def perturb_router(model: torch.nn.Module, noise: float) -> None:
    """Router weights += N(0, (noise * their std)^2), in place."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(2)
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            z = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
            p.add_((z * noise * p.float().std()).to(p.dtype))


@torch.no_grad()
def trainer_pass(model, seqs, routes, layout: str, micro: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(log-probs [N], experts taken [N, layers, k], seconds) of the trainer's forward, `micro` sequences a
    call, routes replayed when given."""
    out, taken = [], []
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(seqs), micro):
        chunk = seqs[i : i + micro]
        lengths = [len(s) for s in chunk]
        r = None
        if routes is not None:
            start = sum(len(s) for s in seqs[:i])
            r = routes[start : start + sum(lengths)]
        with moe_pass(lengths, routes=r) as p:
            lp, _ = forward.token_logprobs(model, chunk, layout)
        out.append(lp.float().cpu())
        taken.append(torch.stack(p.taken, dim=1).cpu())
    sync()
    return torch.cat(out), torch.cat(taken), time.perf_counter() - t0


def mismatch(model, args, device: str, slots: int) -> dict[str, Any]:
    redraw(model, args.router_gain, args.head_gain)
    engine = build_engine(
        "native", model, None, eos_token_id=[], max_slots=slots, max_seq_len=args.mm_prompt_len + args.mm_new,
        prefix_cache=False, record_routes=True,
    )  # fmt: skip
    reqs = requests(args.mm_prompts, args.mm_prompt_len, args.mm_new, model.config.vocab_size, seed=7)
    results = generate_all(engine, reqs)
    engine.close()
    seqs, eng, routes, mask, seq_id = [], [], [], [], []
    for i, (req, res) in enumerate(zip(reqs, results, strict=True)):
        c = res.completions[0]
        seqs.append(torch.tensor(req.prompt_ids + c.token_ids, device=device))
        eng.append(torch.tensor([0.0] * len(req.prompt_ids) + c.logprobs))
        mask.append(torch.tensor([False] * len(req.prompt_ids) + [True] * len(c.token_ids)))
        seq_id.append(torch.full((len(seqs[-1]),), i))
        routes.append(c.routes)
    eng_lp, m, sid, rt = torch.cat(eng), torch.cat(mask), torch.cat(seq_id), torch.cat(routes)
    layout = forward.choose_layout(model, device)
    forward.prepare_model(model, layout)
    fed = rt[:, 0, 0] >= 0
    out: dict[str, Any] = dict(layout=layout, tokens=int(m.sum()), sequences=len(seqs),
                               router_gain=args.router_gain, head_gain=args.head_gain)  # fmt: skip
    trainer_pass(model, seqs[: args.micro], None, layout, args.micro)  # warm-up
    runs = [("without_replay", None), ("with_replay", rt.to(device))]
    if args.router_noise > 0:  # the trainer's router differs from the engine's (a stale or quantised engine)
        runs += [("perturbed_without_replay", None), ("perturbed_with_replay", rt.to(device))]
    for name, r in runs:
        if name == "perturbed_without_replay":
            perturb_router(model, args.router_noise)
        lp, taken, secs = trainer_pass(model, seqs, r, layout, args.micro)
        diff = (lp - eng_lp)[m]
        seq_diff = torch.zeros(len(seqs)).index_add_(0, sid[m], diff)
        flips = (taken[fed].sort(-1).values != rt[fed].long().sort(-1).values).any(-1).float().mean()
        out[name] = dict(
            mean_abs_diff=float(diff.abs().mean()),
            max_abs_diff=float(diff.abs().max()),
            token_ratio_out_of_range=float(((diff.exp() < 0.5) | (diff.exp() > 2)).float().mean()),
            seq_ratio_out_of_range=float(((seq_diff.exp() < 0.5) | (seq_diff.exp() > 2)).float().mean()),
            route_flip_share=float(flips),
            trainer_forward_s=secs,
        )
    a, b = out["without_replay"], out["with_replay"]
    out["forward_cost_ratio"] = b["trainer_forward_s"] / max(a["trainer_forward_s"], 1e-9)
    for prefix in ("", "perturbed_"):
        if prefix + "with_replay" in out:
            a, b = out[prefix + "without_replay"], out[prefix + "with_replay"]
            out[prefix + "seq_out_of_range_reduction"] = (  # None: replay left no sequence out of range
                a["seq_ratio_out_of_range"] / b["seq_ratio_out_of_range"]
                if b["seq_ratio_out_of_range"]
                else None
            )
    return out


# ---------------------------------------------------------------------------------------------- throughput
@contextlib.contextmanager
def moe_kernels_off():
    """Engines built inside run their MoE blocks through the torch path (MoEForward sees no kernel support)."""
    supports = MK.supports
    MK.supports = lambda experts: False
    try:
        yield
    finally:
        MK.supports = supports


def timed_rounds(run_round, args) -> dict[str, Any]:
    """The fair protocol: `run_round(new_tokens, seed) -> (tokens, seconds)` once at full size as the warm-up,
    then args.rounds times with fresh prompts (seeds 2, 3, ...); tokens/s is the median round's."""
    warm_tokens, warm_s = run_round(args.new_tokens, 1)
    rounds = [run_round(args.new_tokens, 2 + i) for i in range(max(1, args.rounds))]
    rates = sorted(t / s for t, s in rounds)
    median = statistics.median(rates)
    secs = statistics.median(s for _, s in rounds)
    return dict(
        warmup_s=warm_s, warmup_tokens=warm_tokens, round_seconds=[s for _, s in rounds], seconds=secs,
        tokens=rounds[0][0], tokens_per_s=median, tokens_per_s_min=rates[0], tokens_per_s_max=rates[-1],
        ms_per_token_step=secs / args.new_tokens * 1e3,
    )  # fmt: skip


def native_throughput(model, args, slots: int, variant: str = "on") -> dict[str, Any]:
    t0 = time.perf_counter()
    off = moe_kernels_off() if variant == "off" else contextlib.nullcontext()
    with off:
        engine = build_engine(
            "native", model, None, eos_token_id=[], max_slots=slots, max_seq_len=args.prompt_len + args.new_tokens,
            prefix_cache=False, fused_kernels=None if variant != "none" else False,
        )  # fmt: skip
    sync()
    startup = time.perf_counter() - t0
    runner: Any = getattr(engine, "runner", None)
    moe = [f for f in getattr(runner, "mlps", []) if isinstance(f, NM.MoEForward)]
    vocab = model.config.vocab_size

    def run(new: int, seed: int) -> tuple[int, float]:
        reqs = requests(args.prompts, args.prompt_len, new, vocab, seed=seed)
        sync()
        t0 = time.perf_counter()
        res = generate_all(engine, reqs)
        sync()
        return sum(len(c.token_ids) for r in res for c in r.completions), time.perf_counter() - t0

    timed = timed_rounds(run, args)
    engine.close()
    return dict(
        variant=variant, fused_kernels=bool(getattr(runner, "kernels", False)),
        moe_kernel_layers=sum(f.kernels for f in moe), startup_s=startup, **timed,
    )  # fmt: skip


def vllm_throughput(args) -> dict[str, Any]:
    """Runs inside the subprocess (--vllm-only)."""
    from vllm import LLM  # pyright: ignore[reportMissingImports]
    from vllm import SamplingParams as VSP  # pyright: ignore[reportMissingImports]
    from vllm.inputs import TokensPrompt  # pyright: ignore[reportMissingImports]

    folder = tempfile.mkdtemp(prefix="relayrl-moe-")
    cfg = config(args.shape, args.layers)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(folder)
    t0 = time.perf_counter()
    llm = LLM(
        model=folder, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, seed=0,
        max_model_len=args.prompt_len + args.new_tokens, max_num_seqs=args.prompts, gpu_memory_utilization=0.85,
    )  # fmt: skip
    startup = time.perf_counter() - t0

    def run(new: int, seed: int) -> tuple[int, float]:
        reqs = requests(args.prompts, args.prompt_len, new, cfg.vocab_size, seed)
        params = VSP(temperature=1.0, max_tokens=new, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs], params, use_tqdm=False
        )
        return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t

    timed = timed_rounds(run, args)
    import vllm  # pyright: ignore[reportMissingImports]

    return dict(version=vllm.__version__, startup_s=startup, **timed)


def run_vllm_subprocess(args, budget: float) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        return dict(skipped="vllm is not installed")
    if budget < 60:
        return dict(skipped=f"only {budget:.0f} s of the budget left")
    out = Path(tempfile.mkdtemp()) / "vllm.json"
    cmd = [sys.executable, __file__, "--vllm-only", str(out), "--shape", args.shape, "--layers", str(args.layers),
           "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--rounds", str(args.rounds)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, timeout=budget, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return dict(skipped=f"vLLM did not finish within the {budget:.0f} s left of the budget")
    if proc.returncode != 0 or not out.exists():
        return dict(failed=f"exit {proc.returncode}", log_tail=(proc.stdout + proc.stderr)[-3000:])
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- main
def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", default="qwen3-30b-a3b" if cuda else "tiny", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=16 if cuda else 2)
    p.add_argument("--prompts", type=int, default=64, help="throughput: concurrent prompts (one sample each)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after a full-size warm-up")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256 if cuda else 32)
    p.add_argument("--mm-prompts", type=int, default=64 if cuda else 16, help="mismatch: sampled sequences")
    p.add_argument("--mm-prompt-len", type=int, default=64 if cuda else 16)
    p.add_argument("--mm-new", type=int, default=128 if cuda else 32)
    p.add_argument("--micro", type=int, default=16, help="mismatch: sequences per trainer forward")
    p.add_argument("--router-gain", type=float, default=2.0)
    p.add_argument("--head-gain", type=float, default=8.0)
    p.add_argument(
        "--router-noise",
        type=float,
        default=0.05,
        help="mismatch: also measure with the trainer's router perturbed by this relative noise (0: skip)",
    )
    p.add_argument("--budget-s", type=float, default=230.0, help="stop starting phases after this")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--skip-mismatch", action="store_true", help="leave out the routing-replay mismatch phase")
    p.add_argument(
        "--kernels",
        default="on,off",
        help="native engine variants to time, comma-separated: on (MoE kernels), off (MoE torch path), none "
        "(fused_kernels=False); vLLM is compared with the first",
    )
    p.add_argument("--sweep", type=int, default=1, help="layer phase: also time the kernels' tile configs")
    p.add_argument("--vllm-only", default="", help=argparse.SUPPRESS)
    return p.parse_args()


def summary(result: dict[str, Any], variants: list[str]) -> None:
    """A few lines on stdout: tokens/s per variant, the layer timings, vLLM."""
    lines = [f"== moe bench: {result['machine']}, {result['layers']} layers, {result['workload']}"]
    for v in variants:
        n = result.get(f"native_{v}", {})
        if "tokens_per_s" in n:
            lines.append(f"native kernels={v}: {n['tokens_per_s']:.0f} tok/s ({n['ms_per_token_step']:.2f} ms a "
                         f"step, startup {n['startup_s']:.0f} s, MoE kernel layers {n['moe_kernel_layers']})")  # fmt: skip
        else:
            lines.append(f"native kernels={v}: {json.dumps(n)[:300]}")
    base, new = result.get("native_off", {}), result.get("native_on", {})
    if "tokens_per_s" in base and "tokens_per_s" in new:
        lines.append(f"MoE kernels on / off: {new['tokens_per_s'] / base['tokens_per_s']:.2f}x")
    layer = result.get("layer", {})
    timed = {k: v for k, v in layer.items() if isinstance(v, dict) and "us_per_layer" in v}
    for name, t in sorted(timed.items(), key=lambda kv: kv[1]["us_per_layer"]):
        lines.append(
            f"  {name}: {t['us_per_layer']:.0f} us/layer, {t['weight_tb_per_s']:.2f} TB/s of weights"
        )
    v = result.get("vllm", {})
    lines.append(
        f"vllm: {v.get('tokens_per_s', json.dumps(v)[:200])}; native/vllm {result.get('native_over_vllm')}"
    )
    print("\n".join(lines), flush=True)


def main() -> None:
    args = parse()
    if args.vllm_only:
        Path(args.vllm_only).write_text(json.dumps(vllm_throughput(args)))
        return
    t_start = time.perf_counter()
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "moe.json"
    dtype = torch.bfloat16
    result: dict[str, Any] = dict(
        shape=args.shape, layers=args.layers, dims=SHAPES[args.shape], device=args.device, dtype="bfloat16",
        machine=torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine(),
        torch=torch.__version__, workload=dict(prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens),
    )  # fmt: skip

    def save() -> None:
        path.write_text(json.dumps(result, indent=2))

    def phase(name: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as err:  # record the failure, keep the other phases
            result[name] = dict(
                failed=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-3000:]
            )
        result[name + "_wall_s"] = time.perf_counter() - t0
        print(name, json.dumps(result[name], indent=1)[:2000], flush=True)
        save()

    variants = [v for v in args.kernels.split(",") if v]
    unknown = sorted(set(variants) - {"on", "off", "none"})
    if unknown or not variants:
        raise SystemExit(f"--kernels: {args.kernels!r}; give a comma-separated list of on, off, none")

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t_start)

    def on_the_model() -> None:  # the model is freed when this returns (vLLM needs the card)
        t0 = time.perf_counter()
        model = build(args.shape, args.layers, args.device, dtype)
        result["params"] = sum(p.numel() for p in model.parameters())
        result["build_s"] = time.perf_counter() - t0
        if args.device == "cuda":
            phase("layer", lambda: layer_bench(model, args))
        for v in variants:
            if left() < 30:
                result[f"native_{v}"] = dict(skipped=f"only {left():.0f} s of the budget left")
                continue
            phase(f"native_{v}", lambda v=v: native_throughput(model, args, args.prompts, v))
        result["native"] = result[f"native_{variants[0]}"]
        if not args.skip_mismatch:
            phase("mismatch", lambda: mismatch(model, args, args.device, min(args.mm_prompts, 64)))

    on_the_model()
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if args.skip_vllm or args.device != "cuda":
        result["vllm"] = dict(skipped="--skip-vllm" if args.skip_vllm else "CPU run")
    else:
        phase("vllm", lambda: run_vllm_subprocess(args, left()))
    n, v = result.get("native", {}), result.get("vllm", {})
    if "tokens_per_s" in n and "tokens_per_s" in v:
        result["native_over_vllm"] = n["tokens_per_s"] / v["tokens_per_s"]
    summary(result, variants)
    result["total_s"] = time.perf_counter() - t_start
    save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
