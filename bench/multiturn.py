"""Multi-turn rollout with and without the native engine's prefix cache, on the built-in `guess` task.

    .venv/bin/python bench/multiturn.py                                    # tiny model, CPU
    python bench/multiturn.py --device cuda --shape qwen0.5b --rounds 3    # Qwen2.5-0.5B-shaped, bf16
    python bench/multiturn.py --device cuda --shape qwen0.5b --dtype float32 --rounds 1   # same trajectories?

Each round plays --prompts episodes x --n samples of guess-the-number (up to 4 turns; every turn after the
first is a new engine request whose prompt is the whole conversation so far) on a fresh engine with the same
seeds, once with `prefix_cache=False` (every turn re-prefills the conversation) and once with it on (a turn
prefills only the previous action's last token and the environment's feedback; a step's turns and fresh
prompts go through one batched forward, relayrl/rollout/prefix_cache.py). One untimed warm-up round per mode
(full size: kernels, allocator, cuBLAS heuristics), then --rounds timed rounds alternating off / on; the
speed-up is median(off) / median(on). Random weights: guesses are mostly invalid, so episodes run all 4 turns,
which is the case the cache is for. Reports wall time, prompt tokens prefilled, tokens taken from the cache,
prefill forwards (calls and rows), and how many trajectories are identical (fp32: all must be; bf16: rounding
of the two prefill paths may flip sampled tokens). --breakdown also times the prefill forwards (a device sync
around each: slightly slower rounds). Writes bench/results/multiturn.json (or --out).

The cache's default for agents on GPUs is relayrl/rollout/prefix_cache.py's PREFIX_CACHE_ON_CUDA: flip it to
True when this bench's GPU speed-up is >= 1.3x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ("tiny", "qwen0.5b")
"""bench/rl_step.py's shapes of the same names (its random Qwen2 + the char tokenizer)."""


def build(shape: str, device: str, dtype_name: str | None = None):
    """bench/rl_step.py's model of `shape` (saved to a temporary folder), loaded on `device`."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "bench"))
    from rl_step import build_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(shape, Path(tmp) / "model")
        default = torch.bfloat16 if device.startswith("cuda") else torch.float32
        dtype = getattr(torch, dtype_name) if dtype_name else default
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(folder)


def play(model, tok, *, cache: bool, prompts: int, n: int, max_new: int, seed: int, breakdown: bool = False):
    """One round on a fresh engine (built before the clock starts); returns (row, trajectories' token ids)."""
    from relayrl.data.records import PromptSample
    from relayrl.data.templates import encode
    from relayrl.rollout import SamplingParams, build_engine
    from relayrl.tasks import get_task

    task = get_task("guess")
    rows = task.make_rows("train", prompts, seed)
    engine = build_engine("native", model, tok, max_slots=prompts * n, max_seq_len=256, prefix_cache=cache)
    forwards = _count_forwards(engine.runner, model.device.type == "cuda" and breakdown)
    ex = task.executor(engine, tok, max_total_len=256)
    samples = [
        PromptSample(index=i, prompt=r["input"], prompt_ids=encode(tok, r["input"]), label=r["label"])
        for i, r in enumerate(rows)
    ]

    async def run():
        jobs = [
            ex.execute(
                s, SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=seed * 7919 + s.index)
            )
            for s in samples
        ]
        return [t for g in await asyncio.gather(*jobs) for t in g]

    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    trajs = asyncio.run(run())
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    row = dict(
        prefix_cache=cache,
        seconds=round(seconds, 4),
        episodes=len(trajs),
        turns_mean=round(sum(t.num_turns for t in trajs) / len(trajs), 3),
        requests=engine.prefill_count,
        prefill_tokens=engine.prefill_tokens,
        cached_tokens=engine.cached_tokens,
        generated_tokens=sum(t.response_len for t in trajs),
        decode_steps=engine.decode_steps,
        **forwards,
    )
    engine.close()
    return row, [t.token_ids for t in trajs]


def _count_forwards(runner, timed: bool) -> dict:
    """Count (and with `timed`, time with a device sync around each) the runner's prefill forwards; the dict
    fills in as the round runs."""
    stats = dict(prefill_calls=0, prefill_rows=0, extend_calls=0, extend_rows=0)
    if timed:
        stats.update(prefill_s=0.0, extend_s=0.0)
    for name in ("prefill", "extend"):
        orig = getattr(runner, name)

        def wrapped(ids, *a, _orig=orig, _name=name, **k):
            stats[f"{_name}_calls"] += 1
            stats[f"{_name}_rows"] += ids.shape[0]
            if not timed:
                return _orig(ids, *a, **k)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = _orig(ids, *a, **k)
            torch.cuda.synchronize()
            stats[f"{_name}_s"] += time.perf_counter() - t0
            return out

        setattr(runner, name, wrapped)
    return stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=16, help="new tokens per turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per mode (after one warm-up round)")
    ap.add_argument("--breakdown", action="store_true", help="time the prefill forwards (CUDA; syncs)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "multiturn.json"))
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(2)
    model, tok = build(args.shape, args.device, args.dtype)
    kw = dict(prompts=args.prompts, n=args.n, max_new=args.max_new, breakdown=args.breakdown)
    for cache in (False, True):  # warm-up: the timed rounds' size
        play(model, tok, cache=cache, seed=args.seed + 10_000, **kw)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    same = total = 0
    for r in range(args.rounds):
        off, trajs_off = play(model, tok, cache=False, seed=args.seed + r, **kw)
        on, trajs_on = play(model, tok, cache=True, seed=args.seed + r, **kw)
        runs[False].append(off)
        runs[True].append(on)
        same += sum(a == b for a, b in zip(trajs_off, trajs_on, strict=True))
        total += len(trajs_on)
    med = {c: statistics.median(r["seconds"] for r in runs[c]) for c in runs}
    speedup = med[False] / med[True]
    print(f"\nguess, {args.shape} on {args.device}, {args.prompts} prompts x {args.n} episodes, "
          f"<= {args.max_new} tokens/turn, {args.rounds} rounds")  # fmt: skip
    print(f"{'prefix cache':<13}{'median s':>9}{'min s':>8}{'max s':>8}{'turns':>7}{'requests':>9}"
          f"{'prefilled':>10}{'cached':>8}{'forwards':>9}{'rows':>6}")  # fmt: skip
    for c, rs in runs.items():
        r0, secs = rs[0], [r["seconds"] for r in rs]
        calls = r0["prefill_calls"] + r0["extend_calls"]
        rows = r0["prefill_rows"] + r0["extend_rows"]
        print(f"{'on' if c else 'off':<13}{med[c]:>9.3f}{min(secs):>8.3f}{max(secs):>8.3f}{r0['turns_mean']:>7.2f}"
              f"{r0['requests']:>9}{r0['prefill_tokens']:>10}{r0['cached_tokens']:>8}{calls:>9}{rows:>6}")  # fmt: skip
    print(f"speed-up (median off / median on) {speedup:.2f}x; identical trajectories {same}/{total}")
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[f"{args.device}/{args.shape}/{args.dtype or 'default'}"] = dict(
        card=card,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        prompts=args.prompts,
        n=args.n,
        max_new=args.max_new,
        rounds=args.rounds,
        median_s=dict(off=med[False], on=med[True]),
        off=runs[False],
        on=runs[True],
        speedup=round(speedup, 3),
        identical=f"{same}/{total}",
        switch="relayrl/rollout/prefix_cache.py PREFIX_CACHE_ON_CUDA (flip to True at >= 1.3x on a GPU)",
    )
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
