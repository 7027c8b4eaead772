"""Host time of a sharded (FSDP2) training step against the 1-process step, per phase, before / after the
changes of relayrl/training/sharded.py (keep_gathered, norm and clipping on the local shards).

    .venv/bin/python bench/fsdp_host.py                                   # 1 process, plain module (local)
    .venv/bin/torchrun --standalone --nproc_per_node=1 bench/fsdp_host.py --fsdp1   # FSDP2 over 1 rank
    .venv/bin/torchrun --standalone --nproc_per_node=2 bench/fsdp_host.py          # 2 ranks (gloo / NCCL)
    torchrun --standalone --nproc_per_node=2 bench/fsdp_host.py --device cuda --shape qwen0.5b-char

The step is relayrl's TrainStep built by `build_trained` (as every trained role: on N ranks the FSDP2 units,
the fp32 shards as masters; on one GPU the bf16 module over fp32 MasterWeights) with the SFT loss, every rank
with the same number of micro-batches (weak scaling: the same work per rank). Shapes: `host` (24 layers like
Qwen2.5-0.5B, hidden 32: compute ~ 0, what is left is the host's Python / dispatch) for CPUs; `qwen0.5b-char`
(Qwen2.5-0.5B body, the char vocabulary, as bench/scale.py's RL runs) for GPUs.

Variants run round-robin on the same model (so load on a shared host hits them alike): `before` (keep_gathered
off, the norm / clip / scale through DTensor as torch.nn.utils does), `keep` (keep_gathered on), `local` (the
local-shard norm / clip / scale), `after` (both: the product's default). The 1-process run has one: `plain`.

Phases (host seconds a step, timed by wrapping: on a GPU they are the time to issue the work, not to run it):
fwd (the loss function: forward + loss), bwd (`.backward()`), sums (the step's metric all-reduce and host
read), norm_clip (scale, norm, clip: `TrainStep._clip` and the scale before it), opt (optimizer.step),
zero (zero_grad), other (the rest of TrainStep.step: micro-batch moves, FSDP2 flags, padding plan; on one GPU
also the bf16 refresh from the fp32 masters, which synchronises); `step` is the whole call's host time and
`wall` the step with the device synchronised. On a GPU `sums` is the step's first host read: it also holds the
wait for the device to finish the micro-batches' kernels (large: the step is device-bound there; small: the
host is the bottleneck). Also the all-gathers and
reduce-scatters issued a step (counted by wrapping torch.distributed's functions FSDP2 calls).

Writes $OUT/fsdp_host_<label>.json (or bench/results/ without OUT), one entry per variant: per phase median
and min over the timed steps, per rank; rank 0 prints the table. Every rank must run the same arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import relayrl.training.step as step_mod  # noqa: E402
from relayrl.config.components import OptimConfig  # noqa: E402
from relayrl.config.dist import DistConfig  # noqa: E402
from relayrl.data.batches import sft_batch  # noqa: E402
from relayrl.trainers.sft import next_token_loss  # noqa: E402
from relayrl.workers import trained as trained_mod  # noqa: E402

SHAPES = {
    "host": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=24, num_attention_heads=4,
                 num_key_value_heads=2),
    "qwen0.5b-char": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2),
    "qwen1.5b-char": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                          num_attention_heads=12, num_key_value_heads=2),
}  # fmt: skip
PHASES = ("fwd", "bwd", "sums", "norm_clip", "opt", "zero", "other", "step", "wall")
VARIANTS = ("before", "keep", "local", "after")


# ------------------------------------------------------------------------------------------------- the old path
def _old_scale(grads: list[torch.Tensor], factor: float) -> None:
    if grads:
        torch._foreach_mul_(grads, factor)  # pyright: ignore[reportPrivateImportUsage]


def _old_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    full = getattr(norm, "full_tensor", None)  # a DTensor under FSDP: reduce the partial norms
    return full() if full is not None else norm


def _old_clip(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """torch.nn.utils.clip_grads_with_norm_'s body (it takes parameters; these are their gradients)."""
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))  # pyright: ignore[reportPrivateImportUsage]


NEW = {"scale_": step_mod.scale_, "total_norm": step_mod.total_norm, "clip_": step_mod.clip_}
OLD = {"scale_": _old_scale, "total_norm": _old_norm, "clip_": _old_clip}


def set_variant(train: Any, name: str) -> None:
    """Switch the built TrainStep to a variant (see module doc)."""
    local = name in ("local", "after")
    for k, fn in (NEW if local else OLD).items():
        setattr(step_mod, k, fn)
    train.units.keep_gathered = name in ("keep", "after") and bool(train.units.units)


# ------------------------------------------------------------------------------------------------- timers
class Timers:
    """Host seconds per phase of the current step (wrapped functions add to them)."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def add(self, name: str, dt: float) -> None:
        self.now[name] = self.now.get(name, 0.0) + dt

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.add(name, time.perf_counter() - t0)

        return timed

    def count(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*a: Any, **k: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a, **k)

        return counted


def install(timers: Timers, train: Any) -> None:
    step_mod._Sums.result = timers.wrap("sums", step_mod._Sums.result)  # type: ignore[method-assign]
    step_mod.TrainStep._clip = timers.wrap("norm_clip", step_mod.TrainStep._clip)  # type: ignore[method-assign]
    for k in ("scale_",):
        NEW[k] = timers.wrap("norm_clip", NEW[k])
        OLD[k] = timers.wrap("norm_clip", OLD[k])
    train.optimizer.step = timers.wrap("opt", train.optimizer.step)
    train.optimizer.zero_grad = timers.wrap("zero", train.optimizer.zero_grad)
    torch.Tensor.backward = timers.wrap("bwd", torch.Tensor.backward)  # type: ignore[method-assign]
    dist = torch.distributed
    names = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")
    for name in (*names, "all_reduce"):
        if hasattr(dist, name):
            setattr(dist, name, timers.count(name, getattr(dist, name)))


# ------------------------------------------------------------------------------------------------- the model
def build(args: argparse.Namespace, device: torch.device, world: int) -> tuple[Any, Any, int]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from relayrl.models.tiny import build_tiny_tokenizer

    vocab = len(build_tiny_tokenizer())
    shape: dict[str, Any] = dict(SHAPES[args.shape])
    config = Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, tie_word_embeddings=True, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)  # on the CPU: build_trained moves / shards it
    if world == 1 and not args.fsdp1:
        model = model.to(device)  # pyright: ignore[reportArgumentType]
    if args.fsdp1:  # FSDP2 over a 1-rank group: its host work without any peer
        trained_mod.in_group = lambda: True  # type: ignore[assignment]
    built = trained_mod.build_trained(
        model,
        device=device,
        dtype="auto",
        optim=OptimConfig(lr=1e-5, warmup_steps=0, scheduler="constant"),
        opt_steps=10_000,
        dist=DistConfig(
            mode="ray" if world > 1 or args.fsdp1 else "local",
            reshard_after_forward=args.reshard_after_forward == "yes",
            keep_gathered="no",
        ),
        loss_fn=next_token_loss,
    )
    return model, built, vocab


def micro_batches(args: argparse.Namespace, vocab: int, layout: str, rank: int) -> list[Any]:
    """This rank's micro-batches: --samples random samples (lengths uniform in [min, max], loss on the second
    half) packed greedily into --micro-batches equal groups by count."""
    from relayrl.trainers.sft import sft_micro_batches

    g = torch.Generator().manual_seed(1000 + rank)
    samples = []
    for _ in range(args.samples):
        n = int(torch.randint(args.min_len, args.max_len + 1, (1,), generator=g))
        ids = torch.randint(4, vocab, (n,), generator=g).tolist()
        samples.append(type("S", (), {"input_ids": ids, "loss_mask": [i >= n // 2 for i in range(n)]})())
    if args.budget > 0:
        return sft_micro_batches(samples, layout=layout, packing=True, max_tokens_per_micro_batch=args.budget)
    per = -(-len(samples) // args.micro_batches)
    return [sft_batch(samples[i : i + per], layout) for i in range(0, len(samples), per)]


# ------------------------------------------------------------------------------------------------- cProfile
GROUPS = (
    ("fsdp", "distributed/fsdp/"),
    ("dtensor", "distributed/tensor/"),
    ("c10d", "distributed/"),
    ("optim", "torch/optim/"),
    ("nn_utils", "torch/nn/utils/"),
    ("nn_module", "torch/nn/modules/"),
    ("transformers", "transformers/"),
    ("relayrl", "relayrl/"),
    ("autograd_py", "torch/autograd/"),
)


def profile(fn: Callable[[], None], steps: int) -> dict[str, float]:
    """ms a step of Python self time (cProfile tottime) by where the function lives: FSDP2's code, DTensor's,
    the rest of torch.distributed, ...; C functions by name (the autograd engine's backward, waits on
    collectives, each torch op binding)."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        fn()
    pr.disable()
    groups: dict[str, float] = {}
    for (path, _, name), (_, _, tottime, _, _) in pstats.Stats(pr).stats.items():  # pyright: ignore[reportAttributeAccessIssue]
        if path == "~":
            key = (
                "wait"
                if "wait" in name
                else ("run_backward" if "run_backward" in name else "torch_ops_and_builtins")
            )
        else:
            key = next((k for k, frag in GROUPS if frag in path), "other_python")
        groups[key] = groups.get(key, 0.0) + tottime * 1e3 / steps
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


# ------------------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> dict[str, Any]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else None
    device = device or torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 or args.fsdp1:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(
            backend=backend, device_id=device if device.type == "cuda" else None
        )
    t0 = time.perf_counter()
    model, built, vocab = build(args, device, world)
    train = built.train
    mbs = micro_batches(args, vocab, built.layout, rank)
    sharded = bool(train.units.units)
    variants = [v for v in args.variants.split(",") if v] if sharded else ["plain"]
    timers = Timers()
    install(timers, train)
    loss_fn = timers.wrap("fwd", next_token_loss)
    per: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PHASES} for v in variants}
    calls: dict[str, dict[str, int]] = {}
    losses: dict[str, list[float]] = {v: [] for v in variants}
    peak: dict[str, float] = {}

    def one(v: str, record: bool) -> None:
        if sharded:
            set_variant(train, v)
        timers.now, timers.calls = {}, {}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t = time.perf_counter()
        out = train.step(mbs, loss_fn)
        host = time.perf_counter() - t
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            peak[v] = max(peak.get(v, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
        wall = time.perf_counter() - t
        if not record:
            return
        now = dict(timers.now, step=host, wall=wall)
        now["other"] = host - sum(now.get(p, 0.0) for p in PHASES if p not in ("other", "step", "wall"))
        for p in PHASES:
            per[v][p].append(now.get(p, 0.0))
        calls[v] = dict(timers.calls)
        losses[v].append(out.loss)

    for v in variants:  # warm-up: one step of each
        one(v, False)
    deadline = time.perf_counter() + args.time_limit
    for _ in range(args.steps):
        for v in variants:
            one(v, True)
        late = torch.tensor([float(time.perf_counter() > deadline)])
        if (
            torch.distributed.is_initialized()
        ):  # every rank stops after the same round (each step is collective)
            torch.distributed.all_reduce(late, op=torch.distributed.ReduceOp.MAX)  # a CPU tensor: gloo
        if late.item():
            break
    profiles = {v: profile(lambda v=v: one(v, False), args.profile) for v in variants} if args.profile else {}
    mine = {
        v: {
            "cprofile_ms_per_step": profiles.get(v, {}),
            "median": {p: statistics.median(x) for p, x in per[v].items() if x},
            "min": {p: min(x) for p, x in per[v].items() if x},
            "steps": len(per[v]["step"]),
            "calls_per_step": calls.get(v, {}),
            "peak_gib": peak.get(v, 0.0),
            "losses": losses[v],
        }
        for v in variants
    }
    everyone = [mine]
    if world > 1 or args.fsdp1:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
    return {
        "label": args.label,
        "argv": sys.argv[1:],
        "world": world,
        "fsdp": sharded,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "layout": built.layout,
        "precision": train.precision,
        "micro_batches": len(mbs),
        "tokens_per_rank": sum(int(getattr(m, "num_tokens", 0)) for m in mbs),
        "params": sum(p.numel() for p in model.parameters()),
        "setup_s": time.perf_counter() - t0,
        "ranks": everyone,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def table(res: dict[str, Any]) -> str:
    lines = [
        f"{res['label']}: world {res['world']} fsdp {res['fsdp']} {res['device']} {res['shape']} "
        f"{res['micro_batches']} micro-batches x {res['tokens_per_rank']} tokens a rank; ms a step, rank 0, "
        "median (min)",
        "variant | " + " | ".join(PHASES) + " | collectives | peak allocated (GPU)",
    ]
    for v, r in res["ranks"][0].items():
        cells = [f"{r['median'][p] * 1e3:.1f} ({r['min'][p] * 1e3:.1f})" for p in PHASES]
        lines.append(
            f"{v} | " + " | ".join(cells) + f" | {r['calls_per_step']} | peak {r['peak_gib']:.1f} GiB"
        )
    for v, r in res["ranks"][0].items():
        if r["cprofile_ms_per_step"]:
            prof = ", ".join(f"{k} {ms:.1f}" for k, ms in r["cprofile_ms_per_step"].items())
            lines.append(f"cProfile {v} (ms a step, self time): {prof}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--shape", default="host", choices=sorted(SHAPES))
    p.add_argument("--samples", type=int, default=12, help="samples a rank a step")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=3, help="micro-batches a rank (when --budget 0)")
    p.add_argument("--budget", type=int, default=0, help="tokens a micro-batch (0: --micro-batches by count)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--fsdp1", action="store_true", help="FSDP2 over a 1-rank group (its host work alone)")
    p.add_argument("--reshard-after-forward", default="yes", choices=("yes", "no"))
    p.add_argument("--threads", type=int, default=1, help="torch threads a rank (0: torch's default)")
    p.add_argument("--time-limit", type=float, default=120.0, help="stop timing after this many seconds")
    p.add_argument("--profile", type=int, default=0, help="then N steps of each variant under cProfile")
    p.add_argument("--label", default="")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.label = args.label or f"{args.device}_{args.shape}_w{world}{'_fsdp1' if args.fsdp1 else ''}"
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    rank = int(os.environ.get("RANK", "0"))
    try:
        res = run(args)
    except Exception:
        traceback.print_exc()
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            err = {"label": args.label, "argv": sys.argv[1:], "error": traceback.format_exc()[-3000:]}
            (out_dir / f"fsdp_host_{args.label}.json").write_text(json.dumps(err, indent=1))
        raise
    if rank == 0:
        print(table(res), flush=True)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"fsdp_host_{args.label}.json").write_text(json.dumps(res, indent=1))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
