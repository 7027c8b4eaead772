"""Rollout throughput: the native engine vs `transformers.generate` (hf engine) on the same requests
(and vLLM, with --engines native,hf,vllm, where the vllm package is installed).

    python bench/rollout.py --shape tiny --device cpu --prompts 32 --new-tokens 64 --n-prompts 8 --n-new-tokens 64
    python bench/rollout.py --shape qwen2.5-0.5b --device cuda            # the GPU target (bf16)

Workload 1: --prompts prompts of --prompt-len random tokens -> --new-tokens new tokens each, sampling at
temperature 1 (top_p 1, top_k 0). Workload 2: --n-prompts prompts x n=--n samples -> --n-new-tokens tokens,
with log-probs (the RL shape: n samples share one prefill). EOS is ignored (engines get no stop ids and the
model's generation_config has no EOS), so every sample has exactly the asked length and both engines do
the same work. The model has random weights, built locally (nothing is downloaded): "tiny" is the test
model (hidden 64, 2 layers, vocab 101); "qwen2.5-0.5b" is Qwen2.5-0.5B's shape (hidden 896, 24 layers,
14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings).

Timings: tokens/s = generated tokens / wall time of all requests (after a warm-up round, with
torch.cuda.synchronize around it); start-up = engine construction (KV cache allocation and CUDA graph
capture for native). Prints a table and writes bench/results/rollout.json.

vllm: the same random model is saved to a temporary folder (safetensors) and loaded by one in-process vLLM
engine (relayrl/rollout/vllm_engine.py) built on first use and reused for both workloads (max_model_len =
prompt + the longer workload, max_num_seqs = the most samples, gpu_memory_utilization=--vllm-gpu-util);
its start-up (load, profiling, torch.compile, CUDA graph capture) is reported on both rows.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all

QWEN05 = dict(
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


QWEN7B = dict(
    QWEN05,
    hidden_size=3584,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    intermediate_size=18944,
    vocab_size=152064,
    tie_word_embeddings=False,
)
SHAPES = {"qwen2.5-0.5b": QWEN05, "qwen2.5-7b": QWEN7B}

HBM_TB_S = {"H100": 3.35, "H200": 4.8}
"""Peak HBM bandwidth (TB/s) of the SXM cards, from NVIDIA's data sheets: the decode floor below uses it."""


def bandwidth_floor_ms(model, row: dict, samples: int, prompt_len: int, new: int) -> float | None:
    """Time one decode step needs at least on this card: (weight bytes + the K/V bytes it reads) / peak HBM
    bandwidth, with every sample decoding at the workload's mean context (prompt + new / 2)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    bw = next((v for k, v in HBM_TB_S.items() if k in name), None)
    if bw is None:
        return None
    c = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2  # K and V, bf16
    kv_bytes = samples * (prompt_len + new / 2) * kv_per_token
    return (weight_bytes + kv_bytes) / (bw * 1e12) * 1e3


def build_model(shape: str, device: str, dtype: torch.dtype, layers: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if shape == "tiny":
        from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer

        model = build_tiny_model(
            build_tiny_tokenizer(), TinyModelSpec(hidden=64, layers=2, max_positions=4096)
        )
    else:
        config = Qwen2Config(
            **{**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}, pad_token_id=0
        )
        config.eos_token_id = config.bos_token_id = None
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    model = model.to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # ignore EOS: fixed-length samples
    model.generation_config.pad_token_id = 0
    return model


def requests(
    num: int, prompt_len: int, new_tokens: int, n: int, vocab: int, seed: int
) -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (num, prompt_len), generator=gen)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, logprobs=True)
    return [
        GenerationRequest(prompt_ids=row.tolist(), params=params, request_id=str(i))
        for i, row in enumerate(ids)
    ]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_vllm(model, dtype: torch.dtype, *, max_seq_len: int, max_seqs: int, gpu_util: float, eager: bool):
    """Save `model` to a temporary folder and build the vllm engine over it (EOS ignored, like the others)."""
    folder = tempfile.mkdtemp(prefix="relayrl-bench-vllm-")
    model.save_pretrained(folder)
    return build_engine(
        "vllm",
        folder,
        None,
        max_seq_len=max_seq_len,
        eos_token_id=[],
        dtype=str(dtype).removeprefix("torch."),
        max_num_seqs=max_seqs,
        gpu_memory_utilization=gpu_util,
        enforce_eager=eager,
    )


class PlainVLLM:
    """vLLM as its users run it offline: `vllm.LLM(model=folder)` with vLLM's own defaults for the card
    (scheduler limits, CUDA graphs, torch.compile, prefix caching), `gpu_memory_utilization` as given (0.9 is
    vLLM's default), token ids in (`skip_tokenizer_init`), EOS ignored and the sampled token's log-prob
    returned, like the other engines. One `llm.generate(...)` call per workload (vLLM batches it itself)."""

    def __init__(
        self, folder: str, dtype: torch.dtype, *, max_seq_len: int, gpu_util: float, extra: dict | None = None
    ) -> None:
        from vllm import LLM

        t0 = time.perf_counter()
        self.llm = LLM(
            model=folder,
            dtype=str(dtype).removeprefix("torch."),
            max_model_len=max_seq_len,
            gpu_memory_utilization=gpu_util,
            skip_tokenizer_init=True,
            seed=0,
            **(extra or {}),
        )
        self.startup_s = time.perf_counter() - t0
        cfg = self.llm.llm_engine.vllm_config
        self.settings = dict(
            max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
            async_scheduling=getattr(cfg.scheduler_config, "async_scheduling", None),
            prefix_caching=cfg.cache_config.enable_prefix_caching,
            gpu_memory_utilization=gpu_util,
            enforce_eager=cfg.model_config.enforce_eager,
        )

    def generate(
        self, reqs: list[GenerationRequest]
    ) -> list[tuple[list[int], list[list[int]], list[list[float]]]]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        p = reqs[0].params
        params = VSP(
            n=p.n,
            temperature=p.temperature,
            max_tokens=p.max_new_tokens,
            ignore_eos=True,
            logprobs=0 if p.logprobs else None,
            detokenize=False,
        )
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in reqs], params, use_tqdm=False
        )
        return [
            (
                r.prompt_ids,
                [list(o.token_ids) for o in out.outputs],
                [
                    [float(step[t].logprob) for step, t in zip(o.logprobs or [], o.token_ids, strict=False)]
                    for o in out.outputs
                ],
            )
            for r, out in zip(reqs, outs, strict=True)
        ]


def run_plain_vllm(engine: PlainVLLM, reqs: list[GenerationRequest]) -> tuple[dict, list]:
    warm = [
        GenerationRequest(prompt_ids=r.prompt_ids, params=SamplingParams(max_new_tokens=8)) for r in reqs[:4]
    ]
    engine.generate(warm)
    _sync("cuda")
    t0 = time.perf_counter()
    out = engine.generate(reqs)
    _sync("cuda")
    elapsed = time.perf_counter() - t0
    lengths = [len(t) for _, toks, _ in out for t in toks]
    want = reqs[0].params.max_new_tokens
    assert all(n == want for n in lengths), f"vllm-llm: expected {want} tokens per sample, got {set(lengths)}"
    row = dict(
        engine="vllm-llm",
        tokens=sum(lengths),
        seconds=elapsed,
        tokens_per_s=sum(lengths) / elapsed,
        startup_s=engine.startup_s,
        settings=engine.settings,
    )
    return row, out


def mismatch(model, samples: list, temperature: float, limit: int) -> dict:
    """The engine's log-probs against relayrl's trainer forward (relayrl.models.forward.token_logprobs, the
    layout the trainer uses on this device, the same weights) over the first `limit` samples:
    relayrl.algorithms.off_policy.logprob_mismatch."""
    from relayrl.algorithms.off_policy import logprob_mismatch
    from relayrl.models import forward

    device = next(model.parameters()).device
    layout = forward.choose_layout(model, device)
    forward.prepare_model(model, layout)
    flat = [(p, t, lp) for p, toks, lps in samples for t, lp in zip(toks, lps, strict=True)][:limit]
    seqs = [torch.tensor(p + t, device=device) for p, t, _ in flat]
    width = max(len(s) for s in seqs)
    parts = []
    with torch.no_grad():  # 16 sequences per forward: bounded memory beside an engine that holds most of it
        for i in range(0, len(seqs), 16):
            chunk = seqs[i : i + 16]
            lp, _ = forward.token_logprobs(model, chunk, layout, temperature=temperature)
            parts.append(forward.to_padded(lp, [len(s) for s in chunk], width).float().cpu())
    trainer = torch.cat(parts)
    rollout = torch.zeros_like(trainer)
    mask = torch.zeros_like(trainer, dtype=torch.bool)
    for i, (p, t, lps) in enumerate(flat):
        rollout[i, len(p) : len(p) + len(t)] = torch.tensor(lps)
        mask[i, len(p) : len(p) + len(t)] = True
    out = logprob_mismatch(trainer, rollout, mask)
    out["samples"] = len(flat)
    return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in out.items()}


def run_engine(
    name: str,
    model,
    reqs,
    *,
    device: str,
    max_seq_len: int,
    slots: int,
    hf_batch: int,
    native_opts: dict,
    prebuilt=None,
) -> dict:
    _sync(device)
    t0 = time.perf_counter()
    if prebuilt is not None:  # vllm: built once for all workloads
        engine, startup = prebuilt, prebuilt.startup_s
    else:
        opts = dict(max_slots=slots, **native_opts) if name == "native" else dict(max_batch=hf_batch)
        engine = build_engine(name, model, None, max_seq_len=max_seq_len, eos_token_id=[], **opts)
        _sync(device)
        startup = time.perf_counter() - t0
    warm = [
        GenerationRequest(prompt_ids=r.prompt_ids, params=SamplingParams(max_new_tokens=8)) for r in reqs[:4]
    ]
    generate_all(engine, warm)
    _sync(device)
    t0 = time.perf_counter()
    results = generate_all(engine, reqs)
    _sync(device)
    elapsed = time.perf_counter() - t0
    kept = [
        (r.prompt_ids, [c.token_ids for c in r.completions], [c.logprobs for c in r.completions])
        for r in results
    ]
    lengths = [len(c.token_ids) for r in results for c in r.completions]
    want = reqs[0].params.max_new_tokens
    assert all(n == want for n in lengths), f"{name}: expected {want} tokens per sample, got {set(lengths)}"
    assert all(len(c.logprobs) == want for r in results for c in r.completions)
    row = dict(
        engine=name,
        tokens=sum(lengths),
        seconds=elapsed,
        tokens_per_s=sum(lengths) / elapsed,
        startup_s=startup,
    )
    if name == "native":
        row.update(decode_steps=engine.decode_steps, prefill_batches=engine.prefill_batches)
        if engine.graphs is not None:
            row["cuda_graphs"] = len(engine.graphs.graphs)
    if prebuilt is not None:
        row["engine_steps"] = engine.steps
        return row, kept
    engine.close()
    del engine
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype", default=None, help="bfloat16 | float16 | float32 (default: bf16 on cuda, fp32 on cpu)"
    )
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="qwen2.5-0.5b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt in workload 2 (0 skips it)")
    ap.add_argument("--n-prompts", type=int, default=64)
    ap.add_argument("--n-new-tokens", type=int, default=512)
    ap.add_argument(
        "--engines",
        default="native,hf",
        help="comma list of native, hf, vllm (relayrl's adapter), vllm-llm (vLLM's own LLM(...), its defaults)",
    )
    ap.add_argument("--vllm-llm-util", type=float, default=0.9, help="vllm-llm: gpu_memory_utilization")
    ap.add_argument(
        "--vllm-llm-args",
        default="{}",
        help='vllm-llm: more LLM(...) arguments as JSON, e.g. {"max_num_seqs": 256}',
    )
    ap.add_argument(
        "--mismatch", type=int, default=0, help="workload 2: compare N samples' log-probs with the trainer's"
    )
    ap.add_argument("--vllm-gpu-util", type=float, default=0.5, help="vllm: gpu_memory_utilization")
    ap.add_argument("--vllm-eager", action="store_true", help="vllm: enforce_eager (no compile / graphs)")
    ap.add_argument("--hf-max-batch", type=int, default=0, help="rows per generate call (0: all at once)")
    ap.add_argument("--decode-attention", default="auto", help="native: sdpa | math | auto (sdpa on cuda)")
    ap.add_argument("--sync-every", type=int, default=16, help="native: decode steps between host syncs")
    ap.add_argument("--no-graphs", action="store_true", help="native: run decode eagerly (no CUDA graphs)")
    ap.add_argument(
        "--layers", type=int, default=0, help="override the qwen shape's layer count (CPU smoke runs)"
    )
    ap.add_argument(
        "--threads", type=int, default=1, help="CPU threads for torch on --device cpu (1 avoids contention)"
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "rollout.json"))
    args = ap.parse_args(argv)
    if {"vllm", "vllm-llm"} & set(args.engines.split(",")) and importlib.util.find_spec("vllm") is None:
        ap.error("--engines vllm needs the vllm package (pip install vllm, on a CUDA machine)")
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    )
    model = build_model(args.shape, args.device, dtype, args.layers)
    vocab = model.config.vocab_size
    workloads = [
        ("w1", requests(args.prompts, args.prompt_len, args.new_tokens, 1, vocab, 0), args.new_tokens)
    ]
    if args.n > 0:
        workloads.append(
            (
                "w2",
                requests(args.n_prompts, args.prompt_len, args.n_new_tokens, args.n, vocab, 1),
                args.n_new_tokens,
            )
        )
    native_opts = dict(decode_attention=args.decode_attention, sync_every=args.sync_every)
    if args.no_graphs:
        native_opts["cuda_graphs"] = False
    rows = []
    vllm_engine = plain = None
    kept: dict[tuple[str, str], list] = {}
    # engines outer, workloads inner: an engine built once for all workloads (vllm, vllm-llm) is closed
    # before the next engine starts, so each has the card to itself
    for name in args.engines.split(","):
        for wname, reqs, new in workloads:
            samples = sum(r.params.n for r in reqs)
            if name == "vllm-llm":  # built once, after the other engines freed their memory
                if plain is None:
                    folder = tempfile.mkdtemp(prefix="relayrl-bench-vllm-llm-")
                    model.save_pretrained(folder)
                    plain = PlainVLLM(
                        folder,
                        dtype,
                        max_seq_len=args.prompt_len + max(n for _, _, n in workloads),
                        gpu_util=args.vllm_llm_util,
                        extra=json.loads(args.vllm_llm_args),
                    )
                row, kept[(wname, name)] = run_plain_vllm(plain, reqs)
                row.update(
                    workload=wname,
                    prompts=len(reqs),
                    n=reqs[0].params.n,
                    prompt_len=args.prompt_len,
                    new_tokens=new,
                )
                rows.append(row)
                print(
                    f"{wname} {name:8s} {row['tokens_per_s']:10.0f} tok/s  {row['seconds']:8.2f} s  start-up {row['startup_s']:.2f} s  {row['settings']}",
                    flush=True,
                )
                continue
            if name == "vllm" and vllm_engine is None:
                vllm_engine = build_vllm(
                    model,
                    dtype,
                    max_seq_len=args.prompt_len + max(n for _, _, n in workloads),
                    max_seqs=max(sum(r.params.n for r in w) for _, w, _ in workloads),
                    gpu_util=args.vllm_gpu_util,
                    eager=args.vllm_eager,
                )
            row, kept[(wname, name)] = run_engine(
                name,
                model,
                reqs,
                device=args.device,
                max_seq_len=args.prompt_len + new,
                slots=samples,
                hf_batch=args.hf_max_batch or samples,
                native_opts=native_opts,
                prebuilt=vllm_engine if name == "vllm" else None,
            )
            row.update(
                workload=wname,
                prompts=len(reqs),
                n=reqs[0].params.n,
                prompt_len=args.prompt_len,
                new_tokens=new,
            )
            if name == "native" and args.device.startswith("cuda"):
                # decode time per step, as if all of it were decode (prefill included: an upper bound)
                row["ms_per_decode_step"] = row["seconds"] / max(1, row["decode_steps"]) * 1e3
                row["bandwidth_floor_ms"] = bandwidth_floor_ms(model, row, samples, args.prompt_len, new)
            rows.append(row)
            print(
                f"{wname} {name:7s} {row['tokens_per_s']:10.0f} tok/s  {row['seconds']:8.2f} s  start-up {row['startup_s']:.2f} s",
                flush=True,
            )
        if name == "vllm" and vllm_engine is not None:  # free the card for the next engine
            vllm_engine.close()
            vllm_engine = None
    if args.mismatch and args.n > 0:
        for row in rows:
            if row["workload"] == "w2":
                row["mismatch"] = mismatch(model, kept[("w2", row["engine"])], 1.0, args.mismatch)
                print(f"w2 {row['engine']:8s} log-prob mismatch vs trainer: {row['mismatch']}", flush=True)
    if vllm_engine is not None:
        vllm_engine.close()
    _report(rows, args, dtype)
    return 0


def _report(rows: list[dict], args, dtype: torch.dtype) -> None:
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"\n{card}  {args.shape}  {dtype}")
    print(f"{'workload':28s} {'engine':8s} {'tok/s':>10s} {'speed-up':>9s} {'start-up s':>10s}")
    for w in dict.fromkeys(r["workload"] for r in rows):
        base = next((r["tokens_per_s"] for r in rows if r["workload"] == w and r["engine"] == "hf"), None)
        for r in (r for r in rows if r["workload"] == w):
            label = f"{r['prompts']}x{r['prompt_len']} n={r['n']} -> {r['new_tokens']}"
            speed = f"{r['tokens_per_s'] / base:8.1f}x" if base else "        -"
            print(f"{label:28s} {r['engine']:8s} {r['tokens_per_s']:10.0f} {speed} {r['startup_s']:10.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=card,
        shape=args.shape,
        dtype=str(dtype),
        torch=torch.__version__,
        **({"vllm": sys.modules["vllm"].__version__} if "vllm" in sys.modules else {}),
        eos="ignored (fixed-length samples)",
        sampling="temperature 1, top_p 1, top_k 0",
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    raise SystemExit(main())
