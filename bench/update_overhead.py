"""Host overhead of the RL experience pass, the RL policy update and an SFT step, through the product's own
workers (PolicyWorker, ReferenceWorker, TrainStep + the SFT loss) on a fixed synthetic batch.

    .venv/bin/python bench/update_overhead.py                     # CPU: hidden 16, 1 layer (compute ~ 0)
    .venv/bin/python bench/update_overhead.py --profile           # + cProfile's top functions per phase
    python bench/update_overhead.py --device cuda --shape recipe100m            # after (today's code)
    python bench/update_overhead.py --device cuda --shape recipe100m --baseline # the old settings

Phases (each timed `--repeats` times after one warm-up pass, median reported):

    ref_logprobs   ReferenceWorker.logprobs(batch)      the reference pass of make_experience (GRPO's KL)
    old_logprobs   PolicyWorker.logprobs(batch)         the old-log-prob pass (kl in the reward, epochs > 1)
    update         PolicyWorker.update(exp, kl_coef)    GRPO (group_norm, seq_mean_token_mean, k3 KL loss),
                                                        one optimizer step over the whole batch
    sft_step       TrainStep.step over SFT micro-batches (relayrl.trainers.sft.next_token_loss), planned by
                   the SFT collate with train.max_tokens_per_micro_batch = the update's budget

For each phase: wall seconds, micro-batches (forward passes), host seconds per micro-batch, and host reads
of tensors from relayrl code (`.item()`, `.tolist()`, `.cpu()`, `float()/int()/bool()` of a tensor: counted
by wrapping those methods; per call site with --sites). On a CUDA device also the synchronising CUDA calls
(torch.cuda.set_sync_debug_mode "warn", counted) and the GPU kernel time of one traced pass (torch.profiler):
wall - kernel time is what the host adds.

`--baseline` runs the settings of the code before this bench's fixes: algo.micro_batch_tokens 4096 for every
pass (no larger inference budget, no auto budget). Without it, the run uses the product's defaults
(`algo.micro_batch_tokens` auto, `algo.infer_micro_batch_tokens` auto).

Writes bench/results/update_overhead.json (one entry per device / shape / settings key, updated in place) or
`$OUT/update_overhead.json` when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from relayrl.agents.base import Trajectory  # noqa: E402
from relayrl.config.components import TrainConfig  # noqa: E402
from relayrl.config.presets import tiny_cpu_config  # noqa: E402
from relayrl.config.rl import AlgoConfig  # noqa: E402
from relayrl.data.batches import sft_batch  # noqa: E402
from relayrl.data.packing import make_collate, plan_micro_batches  # noqa: E402
from relayrl.data.records import PromptSample  # noqa: E402
from relayrl.models.tiny import TinyModelSpec, save_tiny  # noqa: E402
from relayrl.trainers.rl.validate import validate_rl  # noqa: E402
from relayrl.trainers.sft import next_token_loss  # noqa: E402
from relayrl.workers.base import Experience, SequenceBatch, collate  # noqa: E402
from relayrl.workers.policy import PolicySpec, PolicyWorker  # noqa: E402
from relayrl.workers.reference import ReferenceSpec, ReferenceWorker  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "update_overhead.json"

SHAPES: dict[str, dict[str, Any]] = {
    # compute ~ 0: what is left is host time
    "micro": dict(
        model=TinyModelSpec(hidden=16, layers=1, heads=2, kv_heads=1, max_positions=512), dtype="fp32"
    ),
    # the GPU recipe's policy (examples/recipes: 103.9M Qwen2, character vocabulary)
    "recipe100m": dict(
        model=TinyModelSpec(
            hidden=768, layers=12, heads=12, kv_heads=4, intermediate=3072, max_positions=512
        ),
        dtype="auto",
    ),
    # bench/rl_step.py's qwen0.5b-char: the Qwen2.5-0.5B body with the character vocabulary
    "qwen0.5b-char": dict(
        model=TinyModelSpec(
            hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, max_positions=512
        ),
        dtype="auto",
    ),
}

HOST_READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__", "numpy")


# ---------------------------------------------------------------------------------------------- counting
class ReadCounter:
    """Counts host reads of tensors (HOST_READS) made from relayrl code, per call site, while `active`."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self.active = False
        self._orig: dict[str, Any] = {}

    def install(self) -> None:
        pkg = str(ROOT / "relayrl")
        for name in HOST_READS:
            orig = getattr(torch.Tensor, name)
            self._orig[name] = orig

            def wrapper(self_t: torch.Tensor, *a: Any, __orig=orig, __name=name, **k: Any) -> Any:
                if counter.active:
                    inner = f = sys._getframe(1)
                    while f is not None and not f.f_code.co_filename.startswith(pkg):
                        f = f.f_back
                    if f is not None:
                        where = f"{Path(f.f_code.co_filename).relative_to(ROOT)}:{f.f_lineno} {__name}"
                        if inner is not f:  # read inside a library called from relayrl
                            where += f" (in {Path(inner.f_code.co_filename).name}:{inner.f_lineno})"
                        counter.sites[where] += 1
                return __orig(self_t, *a, **k)

            setattr(torch.Tensor, name, wrapper)

    def uninstall(self) -> None:
        for name, orig in self._orig.items():
            setattr(torch.Tensor, name, orig)
        self._orig = {}

    @contextlib.contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        """Counting inside the block; the wrappers exist only there (the timed passes run unwrapped)."""
        self.sites = Counter()
        self.install()
        self.active = True
        try:
            yield self.sites
        finally:
            self.active = False
            self.uninstall()


counter = ReadCounter()


@contextlib.contextmanager
def cuda_syncs(device: torch.device) -> Iterator[list[str]]:
    """Synchronising CUDA calls inside the block (sync debug mode "warn"), as warning texts."""
    seen: list[str] = []
    if device.type != "cuda":
        yield seen
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for w in caught:  # attributed to the Python line that made the call
        if "synchroniz" in str(w.message):
            path = Path(w.filename)
            seen.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{w.lineno}")


class OpCounter(TorchDispatchMode):
    """Counts the aten operators run (forward and backward): each is at least one kernel launch on a GPU, so
    on a CPU this is the device-independent measure of the host's per-op work."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def kernel_seconds(fn: Callable[[], Any], device: torch.device) -> float | None:
    """GPU kernel time of one call of `fn` (torch.profiler, CUDA activity), or None off CUDA / on failure."""
    if device.type != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize(device)
        total = 0.0  # kernels, copies and memsets: the device's busy time (one stream)
        for e in prof.events() or []:
            if str(getattr(e, "device_type", "")).endswith("CUDA"):
                total += float(e.time_range.elapsed_us())
        return total / 1e6
    except Exception as e:  # a profiler problem must not lose the timings
        print(f"  (kernel time unavailable: {type(e).__name__}: {e})", flush=True)
        return None


# ---------------------------------------------------------------------------------------------- workload
def synthetic_batch(vocab: int, prompts: int, n: int, lengths: tuple[int, int], seed: int) -> SequenceBatch:
    """`prompts` x `n` trajectories: a 16-40-token prompt shared by a group, then a response so that the total
    is uniform in `lengths` (random token ids, the response the action tokens)."""
    g = torch.Generator().manual_seed(seed)
    trajs: list[Trajectory] = []
    lo, hi = lengths
    for p in range(prompts):
        plen = int(torch.randint(16, 41, (1,), generator=g))
        prompt = torch.randint(4, vocab, (plen,), generator=g).tolist()
        sample = PromptSample(index=p, prompt="", prompt_ids=prompt)
        for _ in range(n):
            total = max(plen + 2, int(torch.randint(lo, hi + 1, (1,), generator=g)))
            resp = torch.randint(4, vocab, (total - plen,), generator=g).tolist()
            lp = (-torch.rand(total - plen, generator=g) * 3).tolist()
            trajs.append(
                Trajectory(
                    sample=sample,
                    token_ids=prompt + resp,
                    action_mask=[False] * plen + [True] * len(resp),
                    rollout_logprobs=[0.0] * plen + lp,
                )
            )
    return collate(trajs, pad_id=0)


def experience(batch: SequenceBatch, ref: torch.Tensor, seed: int) -> Experience:
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(batch.input_ids.shape, generator=g) * batch.action_mask
    return Experience(
        tokens=batch,
        advantages=adv,
        rewards=torch.randn(batch.input_ids.shape[0], generator=g),
        ref_logprobs=ref,
    )


class _Sample:
    def __init__(self, ids: list[int], mask: list[bool]) -> None:
        self.input_ids, self.loss_mask, self.num_tokens = ids, mask, len(ids)


# ---------------------------------------------------------------------------------------------- phases
def build(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    shape = SHAPES[args.shape]
    path = save_tiny(folder / "model", shape["model"])
    cfg = tiny_cpu_config(str(path), str(folder / "run"))
    algo: dict[str, Any] = dict(preset="grpo", kl_coef=1e-3)
    # (the infer field is absent before the automatic budgets: the harness also runs on older commits)
    has_infer = "infer_micro_batch_tokens" in AlgoConfig.__dataclass_fields__
    if args.baseline:
        algo.update(micro_batch_tokens=4096, **({"infer_micro_batch_tokens": 4096} if has_infer else {}))
    elif args.micro_batch_tokens:
        algo["micro_batch_tokens"] = args.micro_batch_tokens
    if args.infer_micro_batch_tokens and not args.baseline:
        algo["infer_micro_batch_tokens"] = args.infer_micro_batch_tokens
    cfg = replace(
        cfg,
        model=replace(cfg.model, dtype=shape["dtype"]),
        optim=replace(cfg.optim, lr=1e-6),  # the passes repeat on the same weights: keep them where they are
        train=replace(cfg.train, device=args.device),
        algo=AlgoConfig(**algo),
        rollout=replace(
            cfg.rollout,
            temperature=1.0,
            prompts_per_step=args.prompts,
            n_samples=args.n,
            max_new_tokens=args.max_len - 40,
            max_len=args.max_len,
        ),
    )
    r = validate_rl(cfg)
    policy = PolicyWorker(
        PolicySpec(
            model=r.model, optim=r.optim, algo=r.algo, rollout=r.rollout, eval=r.eval, device=args.device
        )
    )
    infer: dict[str, Any] = {"infer_micro_batch_tokens": r.algo.infer_micro_batch_tokens} if has_infer else {}
    reference = ReferenceWorker(
        ReferenceSpec(
            model=r.model,
            micro_batch_tokens=r.algo.micro_batch_tokens,
            temperature=1.0,
            device=args.device,
            **infer,
        )
    )
    return dict(policy=policy, reference=reference, algo=r.algo)


def budgets(worker: Any) -> tuple[int, int]:
    """(update, inference) token budgets a worker plans micro-batches with (the configured int before the
    auto budgets existed)."""
    fixed = getattr(worker.spec, "algo", worker.spec).micro_batch_tokens
    return getattr(worker, "update_budget", fixed), getattr(worker, "infer_budget", fixed)


def generation(parts: dict[str, Any], args: argparse.Namespace, vocab: int) -> Callable[[], Any]:
    """One rollout of the colocated engine (prompts x n samples of random 16-40-token prompts): run before
    each timed pass on a GPU (--generate), so the passes find the memory as a real step leaves it."""
    g = torch.Generator().manual_seed(7)
    samples = [
        PromptSample(
            index=i,
            prompt="",
            prompt_ids=torch.randint(
                4, vocab, (int(torch.randint(16, 41, (1,), generator=g)),), generator=g
            ).tolist(),
        )
        for i in range(args.prompts)
    ]
    policy: PolicyWorker = parts["policy"]
    return lambda: policy.rollout(samples, seed=0)


def phases(parts: dict[str, Any], batch: SequenceBatch, vocab: int) -> dict[str, Callable[[], Any]]:
    policy: PolicyWorker = parts["policy"]
    reference: ReferenceWorker = parts["reference"]
    ref = reference.logprobs(batch)
    exp = experience(batch, ref, seed=1)
    lengths = batch.lengths
    samples = [
        _Sample(batch.input_ids[i, : lengths[i]].tolist(), batch.action_mask[i, : lengths[i]].tolist())
        for i in range(len(lengths))
    ]
    budget = budgets(policy)[0]
    train = TrainConfig(packing=True, max_tokens_per_micro_batch=budget)
    sft_mbs = make_collate(samples, train, policy.layout, sft_batch)(list(range(len(samples))))
    parts["sft_micro_batches"] = len(sft_mbs)
    return {
        "ref_logprobs": lambda: reference.logprobs(batch),
        "old_logprobs": lambda: policy.logprobs(batch),
        "update": lambda: policy.update(exp, 1e-3),
        "sft_step": lambda: policy.train.step(sft_mbs, next_token_loss),
    }


def micro_batches(parts: dict[str, Any], batch: SequenceBatch) -> dict[str, int]:
    policy: PolicyWorker = parts["policy"]
    lengths = batch.lengths
    update, infer = budgets(policy)
    return {
        "ref_logprobs": len(plan_micro_batches(lengths, budgets(parts["reference"])[1], policy.layout)),
        "old_logprobs": len(plan_micro_batches(lengths, infer, policy.layout)),
        "update": len(plan_micro_batches(lengths, update, policy.layout)),
        "sft_step": parts["sft_micro_batches"],
    }


def _alloc_stats(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    return {k: int(s.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def measure(
    name: str,
    fn: Callable[[], Any],
    mbs: int,
    args: argparse.Namespace,
    device: torch.device,
    before: Callable[[], Any] | None = None,
) -> dict:
    def call(inside: Any = None, generate: bool = True) -> tuple[float, float]:
        """(wall, process CPU) seconds of one pass of `fn` (inside the context `inside`), after the untimed
        generation (timed passes only: the counting passes skip it)."""
        if before is not None and generate:  # not timed: the generation a real step runs first
            before()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0, c0 = time.perf_counter(), time.process_time()
        with inside if inside is not None else contextlib.nullcontext():
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return time.perf_counter() - t0, time.process_time() - c0

    call()  # warm-up
    alloc0 = _alloc_stats(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = [call() for _ in range(args.repeats)]
    times, cpu_times = [r[0] for r in runs], [r[1] for r in runs]
    alloc1 = _alloc_stats(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    ops = OpCounter()
    call(ops, generate=False)
    sites: Counter[str] = Counter()
    syncs: list[str] = []

    @contextlib.contextmanager
    def reads() -> Iterator[None]:
        with counter.counting() as found, cuda_syncs(device) as seen:
            yield
        sites.update(found)
        syncs.extend(seen)

    call(reads(), generate=False)
    row: dict[str, Any] = {
        "seconds": statistics.median(times),
        "seconds_all": times,
        "cpu_seconds": statistics.median(cpu_times),
        "aten_ops": ops.ops,
        "micro_batches": mbs,
        "seconds_per_micro_batch": statistics.median(times) / max(1, mbs),
        "host_reads": sum(sites.values()),
        "host_read_sites": dict(sites.most_common()),
        "cuda_syncs": len(syncs) if device.type == "cuda" else None,
        "cuda_sync_kinds": dict(Counter(syncs).most_common(12)) if device.type == "cuda" else None,
        "kernel_seconds": kernel_seconds(fn, device),
        "peak_gib": peak,
        "allocator_per_pass": {k: (alloc1[k] - alloc0[k]) / args.repeats for k in alloc0},
    }
    if args.profile:
        prof = cProfile.Profile()
        call(prof, generate=False)
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.profile_top)
        row["cprofile_top"] = out.getvalue()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shape", default="micro", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=64, help="prompts (groups) in the batch")
    parser.add_argument("-n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--min-len", type=int, default=100, help="shortest sample (prompt + response tokens)")
    parser.add_argument("--max-len", type=int, default=256, help="longest sample")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per phase (median reported)")
    parser.add_argument(
        "--baseline", action="store_true", help="the settings before this bench: 4096 everywhere"
    )
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=0, help="algo.micro_batch_tokens (0: default)"
    )
    parser.add_argument(
        "--infer-micro-batch-tokens", type=int, default=0, help="algo.infer_micro_batch_tokens"
    )
    parser.add_argument("--phases", default="ref_logprobs,old_logprobs,update,sft_step")
    parser.add_argument(
        "--profile", action="store_true", help="cProfile one pass of each phase (top by tottime)"
    )
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--sites", action="store_true", help="print host reads per call site")
    parser.add_argument("--key", default="", help="results key suffix")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--generate", type=int, default=-1, help="a rollout before each pass (1/0; default: on for cuda)"
    )
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("update_overhead: --device cuda but no CUDA device is visible")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / RESULTS.name
    key = f"{args.device}/{args.shape}/{'baseline' if args.baseline else 'default'}" + (
        f"/{args.key}" if args.key else ""
    )
    entry: dict[str, Any] = {
        "key": key,
        "machine": platform.node(),
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "args": vars(args),
        "phases": {},
    }

    def save() -> None:
        data = json.loads(results_path.read_text()) if results_path.is_file() else {}
        data[key] = entry
        results_path.write_text(json.dumps(data, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        parts = build(args, Path(tmp))
        vocab = int(parts["policy"].model.config.vocab_size)
        batch = synthetic_batch(vocab, args.prompts, args.n, (args.min_len, args.max_len), seed=0)
        policy: PolicyWorker = parts["policy"]
        gen = (
            generation(parts, args, vocab)
            if (args.generate == 1 or (args.generate < 0 and device.type == "cuda"))
            else None
        )
        if gen is not None:  # a real run resolves its budgets after the first rollout
            gen()
        entry.update(
            generate=gen is not None,
            threads=torch.get_num_threads(),
            tokens=int(batch.attention_mask.sum()),
            rows=batch.input_ids.shape[0],
            layout=policy.layout,
            update_budget=budgets(policy)[0],
            infer_budget=budgets(policy)[1],
            reference_budget=budgets(parts["reference"])[1],
            params=sum(p.numel() for p in policy.model.parameters()),
        )
        print(
            f"{key}: {entry['rows']} rows, {entry['tokens']} tokens, layout {policy.layout}, "
            f"update budget {entry['update_budget']}, inference budget {entry['infer_budget']} "
            f"(reference {entry['reference_budget']}), {entry['params'] / 1e6:.1f}M parameters",
            flush=True,
        )
        fns = phases(parts, batch, vocab)
        mbs = micro_batches(parts, batch)
        for name in args.phases.split(","):
            try:
                row = measure(name, fns[name], mbs[name], args, device, before=gen)
            except Exception as e:  # keep the other phases' numbers
                traceback.print_exc()
                row = {"error": f"{type(e).__name__}: {e}"}
            entry["phases"][name] = row
            save()
            _print_row(name, row, args)
    total = sum(
        entry["phases"][p].get("seconds", 0.0) for p in ("ref_logprobs", "update") if p in entry["phases"]
    )
    entry["grpo_step_seconds"] = total
    save()
    print(f"GRPO experience + update (ref_logprobs + update): {total:.3f} s; results in {results_path}")


def _print_row(name: str, row: dict[str, Any], args: argparse.Namespace) -> None:
    if "error" in row:
        print(f"{name:<13} ERROR {row['error']}", flush=True)
        return
    ks = row["kernel_seconds"]
    syncs = row["cuda_syncs"]
    print(
        f"{name:<13} {row['seconds']:8.3f} s  {row['micro_batches']:4d} micro-batches  "
        f"{1e3 * row['seconds_per_micro_batch']:7.2f} ms/mb  cpu {row['cpu_seconds']:7.3f} s  "
        f"aten ops {row['aten_ops']:6d}  host reads {row['host_reads']:5d}"
        + (f"  cuda syncs {syncs:5d}" if syncs is not None else "")
        + (f"  kernels {ks:.3f} s (host-bound share {1 - ks / max(row['seconds'], 1e-9):.0%})" if ks else ""),
        flush=True,
    )
    if args.sites:
        for site, n in row["host_read_sites"].items():
            print(f"    {n:6d}  {site}")
    for site, n in (row["cuda_sync_kinds"] or {}).items():
        print(f"    {n:6d}  cuda sync at {site}")
    if args.profile:
        print(row["cprofile_top"])


if __name__ == "__main__":
    main()
