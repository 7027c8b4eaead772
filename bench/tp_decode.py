"""Tensor-parallel native engine decode: TP = 1 vs 2 (vs 4, ...) on the GPUs of one host, no Ray.

    torchrun --standalone --nproc_per_node=4 bench/tp_decode.py                    # 7B shape, TP 1, 2, 4
    torchrun --standalone --nproc_per_node=2 bench/tp_decode.py --tp 1 2
    torchrun --standalone --nproc_per_node=2 bench/tp_decode.py --tp 1 2 --head both  # split vs replicated head
    torchrun --standalone --nproc_per_node=4 bench/tp_decode.py --shape qwen2.5-32b --tp 2 4 --profile 4 --rounds 3
    torchrun --standalone --nproc_per_node=2 bench/tp_decode.py --shape tiny --device cpu   # smoke test
    torchrun --standalone --nproc_per_node=2 bench/tp_decode.py --tp 1 2 --no-unfused --rounds 3 --profile 0 \
        --phases 3 --control auto,device,auto          # where a TP round's time goes, CPU vs NCCL round messages

Model: random bf16 weights of Qwen2.5-7B's shape (hidden 3584, 28 layers, 28 heads, 4 KV heads, intermediate
18944, vocab 152064, untied; --shape qwen2.5-32b: hidden 5120, 64 layers, 40 heads, 8 KV heads, intermediate
27648), built straight into each rank's TP shard (a meta-device model sharded by
rollout/native_tp.shard_model, filled with N(0, 0.02), norms 1; the same generator on every rank, so the
replicated weights agree). For each TP size, ranks [0, tp) form the engine (rank 0 the leader, the others
follow its rounds); the other ranks wait.

Workload: --batch prompts of --prompt-len random tokens -> --new-tokens tokens each at temperature 1, EOS
ignored (every sample runs the full length), so the decode batch is --batch slots for --new-tokens steps.
One full warm-up round and one prefill-only one, then --rounds timed rounds (median reported). Per TP size:
    tok_s            generated tokens / wall time of a round (prefill included)
    ms_per_step      (round - a prefill-only round [--new-tokens 1]) / (new_tokens - 1) decode steps (medians)
    ms_per_step_min  the same from the fastest round of each (a one-time cost in one of two rounds moves the
                     median, which is their mean, but not this)
    control          TP > 1: where the round messages travel (--control; TPNativeEngine(control=...))
    phases           --phases N: N more rounds probed on every rank (bench/tp_phases.py): the in-round step
                     = graph replay + gaps in a batch + gaps at syncs (GPU events), per round the collectives
                     outside the graphs, the device syncs and the host ms by phase, and how long after the
                     leader each follower launched each round's first step; then each rank's graphs alone /
                     queued (decode_phases.replay_table)
    floor_ms         the step's floor per rank: max(compute, bandwidth) of bench/rollout_profile.floors_ms at the
                     round's mean context (data-sheet peaks; absent off CUDA), with compute_ / bandwidth_floor_ms
    startup_s        engine construction (KV cache, CUDA graph capture; NCCL communicator); TP 1 runs the
                     plain NativeEngine over a 1-way "shard" (the same weights, no collectives)
    shard_s          building the shard's weights on the GPU (not a checkpoint load: random init)
    graphs / eager   CUDA graphs captured / keys whose capture failed (run eagerly)
    peak_gib         peak GPU memory of rank 0
    kernels          decode ran rollout/kernels.py's fused Triton kernels (on by default on CUDA)
    sampler          TP > 1 with the vocab-parallel head: "kernel" (vocab_parallel.sample_split's per-rank passes as
                     sampling_kernels.sample_shard's Triton kernels, the default on CUDA) or "torch" (its
                     torch ops: the sampler before the kernels); --tp-sampler kernel,torch gives one row (and one
                     profile) each. TP 1 always runs the one-GPU Triton sampler ("kernel").
    head             TP > 1: "vocab_parallel" (lm_head rows split, ranks sample together without gathering the
                     logits: rollout/vocab_parallel.py; the default) or "replicated" (every rank computes the
                     full logits and samples alone: the engine before the split); --head picks, "both" runs
                     each TP > 1 size both ways (the split's gain)
A last row runs TP 1 with unfused projections (q/k/v and gate/up as separate GEMMs): the fused projections'
gain (--no-unfused skips it).

--profile TP (default 2; 0: off): after the rows, the TP-TP engine's decode step at batch --batch, half way
through the samples (kv bucket covering prompt + new_tokens / 2), under torch.profiler: GPU kernel time per
step split into all-reduce (NCCL, the sampler's two small ones included), GEMM, attention, the fused norm /
rotary / SiLU kernels, the sampler's Triton kernels ("sampler": TP 1's one kernel, the vocab-parallel sampler's
three) and the rest ("other": embedding, copies, and with --tp-sampler torch the torch sampler's ops), for
the step run eagerly (every kernel visible) and as the CUDA graph the engine replays; plus each one's wall
time per step. Written as "profile" in the JSON (--profile-head both: the vocab-parallel head's, then the
replicated head's as "profile_replicated"; the other --allreduce-impl names as "profile_<impl>", the other
--tp-sampler names as "profile_sampler_<name>").

--allreduce (GPUs, last): the decode step's all-reduce alone ([batch, hidden] bf16, 2 a layer), per call,
eagerly and inside a CUDA graph: NCCL (what the engine runs) vs torch's symmetric-memory one-shot / two-shot
all-reduce, for each TP size > 1 ("allreduce" in the JSON; an unavailable one is recorded as an error).

Writes $OUT/tp_decode.json (or bench/results/tp_decode.json without $OUT) after every row and prints a table.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # P2P all-reduces only: never NVLink multicast
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse
import contextlib
import datetime
import hashlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_phases import replay_table  # bench/decode_phases.py
from rollout_engines import param_counts  # bench/rollout_engines.py
from rollout_profile import card_peaks, floors_ms  # bench/rollout_profile.py
from tp_allreduce import allreduce_bench  # bench/tp_allreduce.py
from tp_phases import phases_text, summary, tp_rounds  # bench/tp_phases.py

from relayrl.rollout import sampling
from relayrl.rollout.base import GenerationRequest, SamplingParams, generate_all
from relayrl.rollout.native import NativeEngine
from relayrl.rollout.native_tp import TPNativeEngine, shard_model

CONTROLS = ("auto", "cpu", "device")
"""--control names (TPNativeEngine(control=...)): where a TP engine's round messages travel."""
IMPLS = {"nccl": "nccl", "custom": "auto", "one_shot": "one_shot", "two_shot": "two_shot"}
"""--allreduce-impl names -> TPNativeEngine(allreduce=...) (custom: the engine's default, symmetric memory where
it works)."""
SAMPLERS = ("kernel", "torch")
"""--tp-sampler names: the vocab-parallel sampler's Triton kernels (sampling.FAST True) or its torch ops."""
TOKENS: dict[tuple[int, str], list] = {}
"""Rank 0: (tp, head) -> the first row's tokens of that TP size and head (the rows of the other --allreduce-impl
and --tp-sampler names are compared to it)."""


@contextlib.contextmanager
def sampler_choice(name: str):
    """sampling.FAST for an engine's life (its CUDA graphs capture the choice): "kernel" True, "torch" False."""
    saved = sampling.FAST
    sampling.FAST = name == "kernel"
    try:
        yield
    finally:
        sampling.FAST = saved


SHAPES = {
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(  # 65.5 GB of bf16 weights: TP 2 and up on 80 GB cards
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        intermediate_size=27648,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=128,
        tie_word_embeddings=False,
    ),
}


def build_shard(
    shape: str, tp: int, rank: int, group, device: torch.device, dtype: torch.dtype, split_head: bool = True
):
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(cfg)
    shard = shard_model(
        model, rank=rank, size=tp, group=group, dtype=dtype, device=device, vocab_parallel=split_head
    )
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in shard.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return shard


def requests(args, new_tokens: int) -> list[GenerationRequest]:
    g = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    return [
        GenerationRequest(
            prompt_ids=torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist(),
            params=SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i),
        )
        for i in range(args.batch)
    ]


def timed_round(engine: NativeEngine, reqs: list[GenerationRequest] | None, device: torch.device) -> float:
    """Leader (or a TP = 1 engine): one round of `reqs` (then release the followers); follower: follow it.
    Wall seconds."""
    return _round(engine, reqs, device)[0]


def _round(
    engine: NativeEngine, reqs: list[GenerationRequest] | None, device: torch.device
) -> tuple[float, list]:
    """timed_round's seconds and the leader's sampled token ids per request ([] on a follower)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    results = []
    if not isinstance(engine, TPNativeEngine):
        assert reqs is not None
        results = generate_all(engine, reqs)
    elif engine.is_leader:
        assert reqs is not None
        results = generate_all(engine, reqs)
        engine.release()
    else:
        engine.follow()
    sync()
    return time.perf_counter() - t0, [[c.token_ids for c in r.completions] for r in results]


def run_tp(
    args,
    tp: int,
    device: torch.device,
    dtype: torch.dtype,
    fused: bool = True,
    split_head: bool = True,
    impl: str = "custom",
    sampler: str = "kernel",
    control: str = "auto",
) -> dict | None:
    """One row: TP size `tp` over ranks [0, tp) (tp 1: the plain NativeEngine, no collectives); `fused`
    False keeps the projections separate (the shard's parameters left trainable, which fusion skips);
    `split_head` False: the lm_head replicated (module doc); `impl`: the all-reduce (IMPLS); `sampler`: the
    vocab-parallel sampler (SAMPLERS); `control`: where the round messages travel (CONTROLS)."""
    with sampler_choice(sampler):
        return _run_tp(args, tp, device, dtype, fused, split_head, impl, sampler, control)


def _run_tp(args, tp, device, dtype, fused, split_head, impl, sampler, control) -> dict | None:
    rank = dist.get_rank()
    group = dist.new_group(list(range(tp)))  # every rank creates it (torch.distributed's rule)
    out = None
    if rank < tp:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        shard = build_shard(args.shape, tp, rank, group, device, dtype, split_head)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        shard_s = time.perf_counter() - t0
        if not fused:
            shard.requires_grad_(True)
        dist.barrier(group)  # start-up without the ranks' skew
        t0 = time.perf_counter()
        opts = dict(
            max_slots=args.batch,
            max_seq_len=args.prompt_len + args.new_tokens,
            max_prefill_tokens=args.prefill_tokens,
            eos_token_id=[],
            seed=0,
            sync_every=args.sync_every,
        )
        if tp > 1:
            engine = TPNativeEngine(shard, group=group, allreduce=IMPLS[impl], control=control, **opts)
        else:
            engine = NativeEngine(shard, **opts)
        startup_s = time.perf_counter() - t0
        full, prefill = requests(args, args.new_tokens), requests(args, 1)
        lead = rank == 0
        _, tokens = _round(engine, full if lead else None, device)  # warm-up: one full-size round
        # and one prefill-only round: its prompts hit the prefix cache (their K/V parked by the full round),
        # whose suffix prefill compiles on first use (a 1.2 s first "prefill round" at TP 1 otherwise)
        timed_round(engine, prefill if lead else None, device)
        pre = [timed_round(engine, prefill if lead else None, device) for _ in range(args.rounds)]
        rounds = [timed_round(engine, full if lead else None, device) for _ in range(args.rounds)]
        t, tp_pre = statistics.median(rounds), statistics.median(pre)
        phases = phases_of(args, engine, group, full if lead else None, device) if args.phases else None
        graphs = engine.graphs.graphs if engine.graphs is not None else {}
        fast = getattr(engine, "fast_all_reduce", None)
        out = {
            "tp": tp,
            "fused": fused,
            "head": head_name(tp, split_head),
            "allreduce": impl if tp > 1 else "none",
            "sampler": sampler,
            "control": str(getattr(engine, "control_device", "none")),
            "allreduce_used": (fast.name if fast is not None else "nccl") if tp > 1 else "none",
            **token_check(tp, head_name(tp, split_head), tokens, rank),
            "tok_s": args.batch * args.new_tokens / t,
            "round_s": rounds,
            "prefill_round_s": pre,
            "ms_per_step": 1000 * (t - tp_pre) / max(1, args.new_tokens - 1),
            "ms_per_step_min": 1000 * (min(rounds) - min(pre)) / max(1, args.new_tokens - 1),
            **step_floors(args, tp, device),
            "startup_s": startup_s,
            "shard_s": shard_s,
            "graphs": sum(g is not None for g in graphs.values()),
            "eager": sum(g is None for g in graphs.values()),
            "fused_layers": engine.runner.fused_layers,
            "kernels": bool(engine.runner.kernels),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
            **({"phases": phases} if phases is not None else {}),
        }
        engine.close()
        del engine, shard
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return out if rank == 0 else None


def phases_of(args, engine, group, reqs: list[GenerationRequest] | None, device: torch.device) -> dict | None:
    """--phases N: N more rounds of `reqs` on every rank of the engine under bench/tp_phases (per rank: each
    round's collectives and host reads by phase, host ms per phase, the GPU's split of the in-round step, each
    round's first launch), then decode_phases.replay_table on every rank at once (its graphs' all-reduces pair
    up); rank 0 gets every rank's reports and their summary (None elsewhere) and prints it."""
    reps = tp_rounds(engine, lambda: _round(engine, reqs, device), args.phases, device)
    table = replay_table(engine) if device.type == "cuda" else {}
    per_rank: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, {"rounds": reps, "replay_table": table}, group=group)
    if dist.get_rank(group) != 0:
        return None
    summ = summary([r["rounds"] for r in per_rank])
    name = f"tp{dist.get_world_size(group)} control={getattr(engine, 'control_device', 'none')}"
    print(phases_text(name, summ), flush=True)
    print(f"tp-phases [{name}] graphs alone / queued ms by kv (rank 0): {table.get('by_kv')}", flush=True)
    return {"summary": summ, "per_rank": per_rank}


def step_floors(args, tp: int, device: torch.device) -> dict:
    """The decode step's compute and bandwidth floors (ms) for one rank of a TP-`tp` engine at --batch slots and
    the round's mean context (prompt + new / 2): bench/rollout_profile.floors_ms, the card's data-sheet peaks
    (empty off CUDA or on an unknown card)."""
    config = Qwen2Config(**SHAPES[args.shape])
    peaks = card_peaks(device.type)
    ctx = args.prompt_len + args.new_tokens / 2
    return floors_ms(config, param_counts(config), peaks, batch=args.batch, ctx=ctx, tp=tp)


def token_check(tp: int, head: str, tokens: list, rank: int) -> dict:
    """Rank 0: a digest of the warm-up round's tokens and, after the first row of this (tp, head) (the rows of
    the other --allreduce-impl / --tp-sampler names), the share of samples whose whole token sequence equals
    that row's. Another all-reduce: TP 2 1.0 expected (the sums are bit-equal); TP 4: bf16 rounding may flip a
    few late tokens. Another sampler: NOT a correctness check: the kernel and torch samplers group their fp32
    sums differently, so a draw whose u lies within rounding (~1e-6) of a CDF boundary may differ (about 1% of
    draws on the near-flat rows of random weights: test_sampling_gpu.py), and a 256-token sample then differs
    from there on; most samples are expected to differ somewhere (tests/rollout/test_vocab_parallel_kernel*.py
    check the samplers against each other and against fp64)."""
    if rank != 0:
        return {}
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    first = TOKENS.setdefault((tp, head), tokens)
    if first is tokens:
        return {"tokens_sha": digest}
    pairs = [(a, b) for ra, rb in zip(first, tokens, strict=True) for a, b in zip(ra, rb, strict=True)]
    same = sum(a == b for a, b in pairs) / max(1, len(pairs))
    return {"tokens_sha": digest, "same_tokens_as_first_impl": same}


def head_name(tp: int, split_head: bool) -> str:
    return "vocab_parallel" if tp > 1 and split_head else "replicated"


GEMM_NAMES = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "wgmma", "sm90_", "sm100_", "sm80_")


def kernel_category(name: str) -> str:
    """all_reduce / gemm / attention / norm_rope_silu (kernels.py's fused elementwise kernels) / sampler (the
    Triton samplers) / other (the torch sampler's ops, embedding, copies), from a GPU kernel's name."""
    n = name.lower()
    if "nccl" in n or "all_reduce" in n or "allreduce" in n:
        return "all_reduce"
    if "attention" in n or "attn" in n or "flash" in n:
        return "attention"
    # sampling_kernels.py: the one-GPU sampler (TP 1), the vocab-parallel one's 3 kernels
    if n.startswith(("_sample_kernel", "_shard_block_kernel", "_shard_stats_kernel", "_shard_pick_kernel")):
        return "sampler"
    if n.startswith(("_rms_norm", "_silu_mul", "_rope_kv")):
        return "norm_rope_silu"
    if any(g in n for g in GEMM_NAMES):
        return "gemm"
    return "other"


def kernel_breakdown(prof, steps: int) -> dict:
    """GPU kernel milliseconds per step by category, and the 12 costliest kernels (ms per step)."""
    from torch.autograd import DeviceType

    cats: dict[str, float] = {}
    names: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        ms = e.time_range.elapsed_us() / 1000 / steps
        cats[kernel_category(e.name)] = cats.get(kernel_category(e.name), 0.0) + ms
        names[e.name] = names.get(e.name, 0.0) + ms
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    return {
        "ms_per_step": cats,
        "kernel_ms_per_step": sum(cats.values()),
        "top": [{"name": k[:120], "ms": v} for k, v in top],
    }


def profile_tp(
    args,
    tp: int,
    device: torch.device,
    dtype: torch.dtype,
    steps: int = 10,
    split_head: bool = True,
    impl: str = "custom",
    sampler: str = "kernel",
) -> dict | None:
    """`_profile_tp` with sampling.FAST set for `sampler` (SAMPLERS)."""
    with sampler_choice(sampler):
        return _profile_tp(args, tp, device, dtype, steps, split_head, impl, sampler)


def _profile_tp(args, tp, device, dtype, steps, split_head, impl, sampler) -> dict | None:
    """The TP-`tp` engine's decode step at batch args.batch under torch.profiler (module doc); rank 0's view. (On a CPU: the same path, no kernel times; for the smoke test.)"""
    rank = dist.get_rank()
    group = dist.new_group(list(range(tp)))
    out = None
    if rank < tp:
        shard = build_shard(args.shape, tp, rank, group, device, dtype, split_head)
        opts = dict(max_slots=args.batch, max_seq_len=args.prompt_len + args.new_tokens,
                    max_prefill_tokens=args.prefill_tokens, eos_token_id=[], seed=0)  # fmt: skip
        if tp > 1:
            engine = TPNativeEngine(shard, group=group, allreduce=IMPLS[impl], **opts)
        else:
            engine = NativeEngine(shard, **opts)
        timed_round(engine, requests(args, args.new_tokens) if rank == 0 else None, device)  # warm-up
        st, bs = engine.state, args.batch
        assert st is not None
        # every slot at `pos` (a graph replay advances it: reset before each batch of `steps` steps)
        pos = min(args.prompt_len + args.new_tokens // 2, engine.max_seq_len - steps - 1)
        kv_len = next(k for k in engine.kv_buckets if k >= pos + steps + 1)
        keys = [k for k, g in (engine.graphs.graphs if engine.graphs else {}).items()
                if g is not None and k[0] == bs and k[1] == kv_len]  # fmt: skip

        def eager() -> None:
            engine.runner.decode(st.cur_tok[:bs], st.pos[:bs], st.k_cache, st.v_cache, kv_len, st.rows[:bs])

        def replay() -> None:
            assert engine.graphs is not None
            engine.graphs.run(keys[0])

        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        fast = getattr(engine, "fast_all_reduce", None)
        result: dict = {"tp": tp, "batch": bs, "kv_len": kv_len, "kernels": bool(engine.runner.kernels),
                        "head": head_name(tp, split_head), "allreduce": impl, "sampler": sampler,
                        "allreduce_used": fast.name if fast is not None else "nccl"}  # fmt: skip
        for label, fn in (("eager", eager), ("graph", replay if keys else None)):
            if fn is None:
                result[label] = "no captured graph for this (batch, kv_len)"
                continue
            with torch.no_grad():
                st.pos[:bs].fill_(pos)
                for _ in range(3):
                    fn()
                st.pos[:bs].fill_(pos)
                sync()
                dist.barrier(group)
                t0 = time.perf_counter()
                for _ in range(steps):
                    fn()
                sync()
                wall = (time.perf_counter() - t0) * 1000 / steps
                st.pos[:bs].fill_(pos)
                dist.barrier(group)
                acts = [torch.profiler.ProfilerActivity.CPU]
                if device.type == "cuda":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(steps):
                        fn()
                    sync()
            result[label] = {"wall_ms_per_step": wall, **kernel_breakdown(prof, steps)}
        out = result
        engine.close()
        del engine, shard
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    return out if rank == 0 else None


def attempt(fn, *args, **kwargs) -> dict | None:
    """fn's result, or {"error": ...} when it raises (every rank runs the same code, so a failure such as a
    kernel that does not compile is met by every rank alike, and the next row still runs)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # recorded in the JSON and printed
        print(f"rank {dist.get_rank()}: {getattr(fn, '__name__', fn)} failed: {e!r}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": repr(e)[:2000], "kwargs": {k: str(v) for k, v in kwargs.items()}}


def print_table(rows: list) -> None:
    rows = [r for r in rows if r and "error" not in r]
    base = next((r for r in rows if r["tp"] == 1 and r["fused"]), None)
    head = (
        f"{'tp':>3} {'fused':>5} {'head':>14} {'allreduce':>10} {'sampler':>7} {'kernels':>7} {'tok/s':>10} "
        f"{'ms/step':>8} {'min':>6} {'control':>7}"
    )
    head += f" {'x tp1':>6} {'floor':>6} {'x floor':>7}"
    head += f" {'start s':>8}"
    print(f"{head} {'graphs':>6} {'peak GiB':>8}")
    for r in rows:
        assert r is not None
        speed = r["tok_s"] / base["tok_s"] if base else float("nan")
        floor = r.get("floor_ms", float("nan"))
        print(
            f"{r['tp']:>3} {r['fused']!s:>5} {r['head']:>14} {r['allreduce_used']:>10.10} {r['sampler']:>7} "
            f"{r['kernels']!s:>7} "
            f"{r['tok_s']:>10.0f} {r['ms_per_step']:>8.2f} {r['ms_per_step_min']:>6.2f} {r['control']:>7.7} "
            f"{speed:>6.2f} {floor:>6.2f} {r['ms_per_step'] / floor:>7.2f} {r['startup_s']:>8.2f} {r['graphs']:>6} "
            f"{r['peak_gib']:>8.1f}"
        )


def write(result: dict, world_rank: int) -> None:
    """Rank 0: the JSON so far (a run cut short keeps its rows)."""
    if world_rank != 0:
        return
    folder = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tp_decode.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {folder / 'tp_decode.json'}", flush=True)


def watchdog(seconds: float, result: dict, world_rank: int) -> None:
    """Past `seconds`, write what was measured and end the process (exit 124)."""

    def fire() -> None:
        result["timed_out_after_s"] = seconds
        try:  # the main thread may be changing the result right now
            write(result, world_rank)
        except RuntimeError:
            write(json.loads(json.dumps(result, default=str)), world_rank)
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--tp", type=int, nargs="+", default=None, help="TP sizes (default 1, 2, 4, ... <= world)"
    )
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=16384, help="padded tokens per prefill batch")
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds (median)")
    ap.add_argument(
        "--sync-every", type=int, default=16, help="decode steps between host syncs (the engines' default 16)"
    )
    ap.add_argument("--no-unfused", action="store_true", help="skip the TP 1 row with unfused projections")
    ap.add_argument(
        "--head",
        choices=("split", "replicated", "both"),
        default="split",
        help="TP > 1 lm_head: vocab-parallel (split), replicated, or both rows per TP size",
    )
    ap.add_argument("--profile", type=int, default=2, help="TP size whose decode step is profiled (0: none)")
    ap.add_argument(
        "--profile-head",
        choices=("split", "replicated", "both"),
        default="split",
        help="the profiled engine's lm_head (both: profile each)",
    )
    ap.add_argument(
        "--allreduce",
        action="store_true",
        help="first, time the all-reduce alone: NCCL vs the symmetric-memory paths (eager and in a graph)",
    )
    ap.add_argument("--allreduce-only", action="store_true", help="--allreduce, then no engine rows")
    ap.add_argument(
        "--allreduce-impl",
        default="custom",
        help="comma list of the TP > 1 rows' all-reduce: nccl, custom (the engine default: symmetric memory "
        "where it works, else NCCL), one_shot, two_shot; one row (and profile) per name",
    )
    ap.add_argument(
        "--tp-sampler",
        default="kernel",
        help="comma list of the TP > 1 vocab-parallel rows' sampler: kernel (Triton, the default on CUDA), "
        "torch (its torch ops); one row (and profile) per name",
    )
    ap.add_argument(
        "--control",
        default="auto",
        help="comma list of the TP > 1 rows' round-message path (TPNativeEngine(control=...)): auto (the "
        "group's CPU backend, gloo), device (NCCL, the path before); one row per name, in order (a name may "
        "repeat: the first TP > 1 row of a process pays one-time costs)",
    )
    ap.add_argument(
        "--phases",
        type=int,
        default=0,
        help="probed rounds per row after its timed ones: the in-round step's parts on every rank, the "
        "collectives and device syncs outside the graphs per round, the followers' launch lag (tp_phases.py)",
    )
    ap.add_argument("--time-limit", type=float, default=230.0, help="seconds before partial results + exit")
    args = ap.parse_args()
    world_rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # gloo for CPU tensors (the TP engines' round messages), NCCL for CUDA ones: distributed/group.py's groups
        dist.init_process_group("cpu:gloo,cuda:nccl", device_id=device)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    sizes = args.tp or [t for t in (1, 2, 4, 8) if t <= world]
    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "rows": [],
    }
    watchdog(args.time_limit, result, world_rank)
    impls = [i.strip() for i in args.allreduce_impl.split(",") if i.strip()]
    if not impls or any(i not in IMPLS for i in impls):
        ap.error(f"--allreduce-impl: a comma list of {', '.join(IMPLS)}, got {args.allreduce_impl!r}")
    samplers = [i.strip() for i in args.tp_sampler.split(",") if i.strip()]
    if not samplers or any(i not in SAMPLERS for i in samplers):
        ap.error(f"--tp-sampler: a comma list of {', '.join(SAMPLERS)}, got {args.tp_sampler!r}")
    controls = [i.strip() for i in args.control.split(",") if i.strip()]
    if not controls or any(i not in CONTROLS for i in controls):
        ap.error(f"--control: a comma list of {', '.join(CONTROLS)}, got {args.control!r}")

    def mark(stage: str) -> None:
        result["stage"] = stage
        write(result, world_rank)

    if (args.allreduce or args.allreduce_only) and device.type == "cuda":  # first: seconds, never starved
        result["allreduce"] = []
        for tp in [t for t in sizes if t > 1]:
            cfg = SHAPES[args.shape]
            shape = (args.batch, cfg["hidden_size"], 2 * cfg["num_hidden_layers"])
            result["allreduce"].append(allreduce_bench(tp, *shape, device, dtype, mark))
            mark(f"allreduce tp{tp} done")
        if world_rank == 0:
            print(json.dumps(result["allreduce"], indent=1), flush=True)
    if args.allreduce_only:
        dist.destroy_process_group()
        return
    heads = {"split": [True], "replicated": [False], "both": [True, False]}
    plan = [(tp, True, s, i, m, c) for tp in sizes for s in (heads[args.head] if tp > 1 else [True])
            for i in (impls if tp > 1 else impls[:1])
            for m in (samplers if tp > 1 and s else ["kernel"])
            for c in (controls if tp > 1 else controls[:1])]  # fmt: skip
    plan += [(1, False, True, impls[0], "kernel", "auto")] if 1 in sizes and not args.no_unfused else []
    for tp, fused, split, impl, smp, ctl in plan:  # the unfused TP 1 row: the fused projections' gain
        mark(f"row tp{tp} fused={fused} {head_name(tp, split)} {impl} sampler={smp} control={ctl}")
        opts = dict(fused=fused, split_head=split, impl=impl, sampler=smp, control=ctl)
        result["rows"].append(attempt(run_tp, args, tp, device, dtype, **opts))
        write(result, world_rank)
    if world_rank == 0:
        print_table(result["rows"])
    if args.profile and args.profile <= world:
        # "profile": the first head, impl and sampler; "profile_replicated": the second head;
        # "profile_<impl>": the other impls, "profile_sampler_<name>": the other samplers (first head)
        first = heads[args.profile_head][0]
        runs = [("profile", first, impls[0], samplers[0])]
        runs += [("profile_replicated", s, impls[0], "kernel") for s in heads[args.profile_head][1:]]
        runs += [(f"profile_{i}", first, i, samplers[0]) for i in impls[1:]]
        runs += [
            (f"profile_sampler_{m}", first, impls[0], m) for m in samplers[1:] if args.profile > 1 and first
        ]
        for key, split, impl, smp in runs:
            mark(f"{key} tp{args.profile}")
            result[key] = attempt(
                profile_tp, args, args.profile, device, dtype, split_head=split, impl=impl, sampler=smp
            )
            write(result, world_rank)
            if world_rank == 0:
                print(json.dumps(result[key], indent=1), flush=True)
    result["stage"] = "done"
    write(result, world_rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
