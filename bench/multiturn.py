"""Multi-turn rollout with and without the native engine's prefix cache, on the built-in `guess` task.

    .venv/bin/python bench/multiturn.py                                    # tiny model, CPU
    python bench/multiturn.py --device cuda --shape qwen0.5b               # Qwen2.5-0.5B-shaped, bf16

Each run plays --prompts episodes x --n samples of guess-the-number (up to 4 turns; every turn after the
first is a new engine request whose prompt is the whole conversation so far) on a fresh engine with the same
seeds, once with `prefix_cache=False` (every turn re-prefills the conversation) and once with it on (a turn
prefills only the previous action's last token and the environment's feedback). Random weights: guesses are
mostly invalid, so episodes run all 4 turns, which is the case the cache is for. Reports wall time, prompt
tokens prefilled, tokens taken from the cache, and checks that both runs produced the same trajectories.
Writes bench/results/multiturn.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ("tiny", "qwen0.5b")
"""bench/rl_step.py's shapes of the same names (its random Qwen2 + the char tokenizer)."""


def build(shape: str, device: str):
    """bench/rl_step.py's model of `shape` (saved to a temporary folder), loaded on `device`."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "bench"))
    from rl_step import build_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(shape, Path(tmp) / "model")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(folder)


def play(model, tok, *, cache: bool, prompts: int, n: int, max_new: int, seed: int) -> tuple[dict, list]:
    from relayrl.data.records import PromptSample
    from relayrl.data.templates import encode
    from relayrl.rollout import SamplingParams, build_engine
    from relayrl.tasks import get_task

    task = get_task("guess")
    rows = task.make_rows("train", prompts, seed)
    engine = build_engine("native", model, tok, max_slots=prompts * n, max_seq_len=256, prefix_cache=cache)
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
        seconds=round(seconds, 3),
        episodes=len(trajs),
        turns_mean=round(sum(t.num_turns for t in trajs) / len(trajs), 3),
        requests=engine.prefill_count,
        prefill_tokens=engine.prefill_tokens,
        cached_tokens=engine.cached_tokens,
        generated_tokens=sum(t.response_len for t in trajs),
    )
    engine.close()
    return row, [t.token_ids for t in trajs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=16, help="new tokens per turn")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(2)
    model, tok = build(args.shape, args.device)
    play(model, tok, cache=True, prompts=4, n=1, max_new=4, seed=99)  # warm-up (kernels, allocator)
    off, trajs_off = play(
        model, tok, cache=False, prompts=args.prompts, n=args.n, max_new=args.max_new, seed=args.seed
    )
    on, trajs_on = play(
        model, tok, cache=True, prompts=args.prompts, n=args.n, max_new=args.max_new, seed=args.seed
    )
    same = sum(a == b for a, b in zip(trajs_off, trajs_on, strict=True))
    print(
        f"\nguess, {args.shape} on {args.device}, {args.prompts} prompts x {args.n} episodes, <= {args.max_new} tokens/turn"
    )
    print(f"{'prefix cache':<14}{'seconds':>9}{'turns':>7}{'requests':>9}{'prefilled':>10}{'cached':>8}")
    for r in (off, on):
        print(
            f"{'on' if r['prefix_cache'] else 'off':<14}{r['seconds']:>9.3f}{r['turns_mean']:>7.2f}{r['requests']:>9}"
            f"{r['prefill_tokens']:>10}{r['cached_tokens']:>8}"
        )
    print(f"speed-up {off['seconds'] / on['seconds']:.2f}x; identical trajectories {same}/{len(trajs_on)}")
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    out = ROOT / "bench" / "results" / "multiturn.json"
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[f"{args.device}/{args.shape}"] = dict(
        card=card,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        prompts=args.prompts,
        n=args.n,
        max_new=args.max_new,
        off=off,
        on=on,
        speedup=round(off["seconds"] / on["seconds"], 3),
        identical=f"{same}/{len(trajs_on)}",
    )
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
