"""Multi-turn rollout with and without the native engine's prefix cache: time, prefilled tokens and whether the
trajectories come out identical (token ids; token ids and log-probs), per workload, dtype and forward mode.

    .venv/bin/python bench/multiturn.py                                         # tiny model, CPU, guess
    .venv/bin/python bench/multiturn.py --configs all                           # every config below, CPU
    OUT=/tmp/o python bench/multiturn.py --device cuda --shape qwen0.5b --configs all --budget-s 200

Workloads (every turn after an episode's first is a new n=1 engine request whose prompt is the whole
conversation so far, so without the cache every turn re-prefills the conversation):
    guess   the built-in guess-the-number task through its agent executor: --prompts prompts x --n episodes,
            up to 4 turns of <= --max-new tokens (random weights: guesses are mostly invalid, so episodes run
            all 4 turns); prompts ~60 tokens, feedback a few tokens a turn. Tiny on purpose: the cache's worst
            case (little to reuse, decode dominates).
    long    an agent's shape: --episodes episodes sharing a --system-tokens system prompt, each with its own
            32-token task, --turns turns of <= --long-max-new tokens, each followed by an observation of
            --obs-min..--obs-max tokens (a tool's output; seeded random ids). Prefill dominates without the cache.
Configs: `workload/dtype/mode`, dtype fp32 | bf16, mode default (the engine's normal forward) | exact
(`exact=True`: rollout/exact.py's batch-invariant forward; with it the cache must give IDENTICAL trajectories,
ids and log-probs, in every dtype: rollout/prefix_cache.py's module doc says why). `--configs all` runs
ALL_CONFIGS in that (priority) order.

Per config: one engine with the cache off and one with it on (built once, before any clock: CUDA graphs and
Triton kernels are start-up costs; every round starts with `load_weights(None)`, an RL step's weight update,
which empties the cache), one untimed full-size warm-up round per engine, then --rounds timed
rounds alternating off / on with the same seeds; the speed-up is median(off) / median(on). With --breakdown
one more (untimed for the medians) round per engine times the prefill and extend forwards with a device sync
around each: the rest of the round is decode plus host work. Results go to $OUT/multiturn.json when OUT is set
(else bench/results/multiturn.json, or --out), rewritten after every round, so a run cut short keeps what it
measured; a config that raises is recorded with its error and the next one runs; --budget-s stops starting
configs (and timed rounds after the first) once that many seconds have passed.

The cache's default for agents on GPUs is relayrl/rollout/prefix_cache.py's PREFIX_CACHE_ON_CUDA (its doc
states the condition for flipping it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ("tiny", "qwen0.5b")
"""bench/rl_step.py's shapes of the same names (its random Qwen2 + the char tokenizer)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
ALL_CONFIGS = (
    "guess/fp32/exact",  # the target's identity claim (and speed-up) in fp32
    "guess/bf16/default",  # the engine agents get on a GPU by default: the flip's speed condition
    "long/bf16/default",
    "long/fp32/exact",
    "guess/fp32/default",  # the earlier measurement's config (1.37x, 92/128 identical)
    "guess/bf16/exact",
    "long/bf16/exact",
    "long/fp32/default",
)


def build(shape: str, device: str, dtype: torch.dtype):
    """bench/rl_step.py's model of `shape` (saved to a temporary folder), loaded on `device` in `dtype`."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "bench"))
    from rl_step import build_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(shape, Path(tmp) / "model")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(folder)


def seq_len(args, workload: str) -> int:
    """The engines' max_seq_len: room for the longest conversation of the workload."""
    if workload == "guess":
        return 256
    longest = args.system_tokens + 32 + args.turns * (args.long_max_new + args.obs_max)
    return -(-longest // 64) * 64


def slots(args, workload: str) -> int:
    return args.prompts * args.n if workload == "guess" else args.episodes


def play_guess(engine, tok, args, seed: int) -> tuple[list, int]:
    """One round of the guess task; returns (each episode's (token ids, rollout log-probs), generated tokens)."""
    from relayrl.data.records import PromptSample
    from relayrl.data.templates import encode
    from relayrl.rollout import SamplingParams
    from relayrl.tasks import get_task

    task = get_task("guess")
    rows = task.make_rows("train", args.prompts, seed)
    ex = task.executor(engine, tok, max_total_len=seq_len(args, "guess"))
    samples = [
        PromptSample(index=i, prompt=r["input"], prompt_ids=encode(tok, r["input"]), label=r["label"])
        for i, r in enumerate(rows)
    ]

    async def run():
        jobs = [
            ex.execute(
                s,
                SamplingParams(
                    n=args.n, temperature=1.0, max_new_tokens=args.max_new, seed=seed * 7919 + s.index
                ),
            )
            for s in samples
        ]
        return [t for g in await asyncio.gather(*jobs) for t in g]

    trajs = asyncio.run(run())
    return [(t.token_ids, t.rollout_logprobs) for t in trajs], sum(sum(t.action_mask) for t in trajs)


def play_long(engine, vocab: int, args, seed: int) -> tuple[list, int]:
    """One round of the long workload; returns (each episode's turns as (token ids, log-probs), generated
    tokens)."""
    from relayrl.rollout import GenerationRequest, SamplingParams

    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(args.system_tokens)]

    async def episode(e: int):
        er = random.Random(seed * 1_000_003 + e)
        prompt = system + [er.randrange(3, vocab) for _ in range(32)]
        turns = []
        for turn in range(args.turns):
            params = SamplingParams(
                n=1, temperature=1.0, max_new_tokens=args.long_max_new, seed=seed * 7919 + e * 64 + turn
            )
            c = (await engine.generate(GenerationRequest(prompt_ids=prompt, params=params))).completions[0]
            turns.append((c.token_ids, c.logprobs))
            obs = [er.randrange(3, vocab) for _ in range(er.randint(args.obs_min, args.obs_max))]
            prompt = prompt + c.token_ids + obs
        return turns

    async def run():
        return await asyncio.gather(*(episode(e) for e in range(args.episodes)))

    trajs = list(asyncio.run(run()))
    return trajs, sum(len(ids) for turns in trajs for ids, _ in turns)


COUNTERS = ("prefill_count", "prefill_tokens", "cached_tokens", "decode_steps")


class Side:
    """One engine (cache on or off) of a config, its forward counters and optional timers."""

    def __init__(self, model, tok, args, workload: str, exact: bool, cache: bool) -> None:
        from relayrl.rollout.native import NativeEngine

        t0 = time.perf_counter()
        self.engine = NativeEngine(
            model, tok, max_slots=slots(args, workload), max_seq_len=seq_len(args, workload),
            prefix_cache=cache, exact=exact,
        )  # fmt: skip
        self.build_s = time.perf_counter() - t0
        self.cuda = model.device.type == "cuda"
        self.model, self.tok, self.args, self.workload = model, tok, args, workload
        self.vocab = min(len(tok), model.config.vocab_size)
        self.stats: dict = {}
        self.timed = False
        for name in ("prefill", "extend"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        runner = self.engine.runner
        orig = getattr(runner, name)

        def wrapped(ids, *a, **k):
            self.stats[f"{name}_calls"] = self.stats.get(f"{name}_calls", 0) + 1
            self.stats[f"{name}_rows"] = self.stats.get(f"{name}_rows", 0) + ids.shape[0]
            self.stats[f"{name}_padded_tokens"] = self.stats.get(f"{name}_padded_tokens", 0) + ids.numel()
            if not self.timed:
                return orig(ids, *a, **k)
            self._sync()
            t0 = time.perf_counter()
            out = orig(ids, *a, **k)
            self._sync()
            self.stats[f"{name}_s"] = self.stats.get(f"{name}_s", 0.0) + time.perf_counter() - t0
            return out

        setattr(runner, name, wrapped)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def play(self, seed: int, timed: bool = False) -> tuple[dict, list]:
        """One round from an empty cache; returns (row, trajectories)."""
        eng = self.engine
        eng.load_weights(
            None
        )  # an RL step's weight update: drops the parked slots, so each round starts cold
        before = {c: getattr(eng, c) for c in COUNTERS}
        self.stats, self.timed = {}, timed
        self._sync()
        t0 = time.perf_counter()
        if self.workload == "guess":
            trajs, generated = play_guess(eng, self.tok, self.args, seed)
        else:
            trajs, generated = play_long(eng, self.vocab, self.args, seed)
        self._sync()
        seconds = time.perf_counter() - t0
        row = dict(
            seconds=round(seconds, 4), **{c: getattr(eng, c) - before[c] for c in COUNTERS}, **self.stats
        )
        if timed:
            row["other_s"] = round(seconds - row.get("prefill_s", 0.0) - row.get("extend_s", 0.0), 4)
        row["generated_tokens"] = generated
        return row, trajs

    def close(self) -> None:
        self.engine.close()


def _ids(trajs: list) -> list:
    if trajs and isinstance(trajs[0], tuple):
        return [ids for ids, _ in trajs]
    return [[ids for ids, _ in turns] for turns in trajs]


def run_config(config: str, args, model, tok, record, deadline: float) -> dict:
    """Warm-up, timed rounds (and the breakdown round) of one config; `record(result)` after every round."""
    workload, _, mode = config.split("/")
    sides = {}
    res: dict = dict(config=config, rounds_done=0)
    try:
        for cache in (False, True):
            sides[cache] = Side(model, tok, args, workload, mode == "exact", cache)
        res["engine_build_s"] = {k: round(sides[c].build_s, 3) for k, c in (("off", False), ("on", True))}
        for cache in (False, True):  # warm-up: the timed rounds' size, other seeds
            sides[cache].play(args.seed + 10_000)
        runs: dict = {"off": [], "on": []}
        same_ids = same_all = total = 0
        for r in range(args.rounds):
            if r > 0 and time.perf_counter() > deadline:
                res["truncated"] = f"budget reached after {r} timed rounds"
                break
            off, t_off = sides[False].play(args.seed + r)
            on, t_on = sides[True].play(args.seed + r)
            runs["off"].append(off)
            runs["on"].append(on)
            same_ids += sum(a == b for a, b in zip(_ids(t_off), _ids(t_on), strict=True))
            same_all += sum(a == b for a, b in zip(t_off, t_on, strict=True))
            total += len(t_on)
            med = {k: statistics.median(x["seconds"] for x in v) for k, v in runs.items()}
            res.update(
                rounds_done=r + 1,
                median_s=med,
                min_s={k: min(x["seconds"] for x in v) for k, v in runs.items()},
                max_s={k: max(x["seconds"] for x in v) for k, v in runs.items()},
                speedup=round(med["off"] / med["on"], 3),
                identical_ids=f"{same_ids}/{total}",
                identical_ids_and_logprobs=f"{same_all}/{total}",
                prefill_tokens={k: v[0]["prefill_tokens"] for k, v in runs.items()},
                cached_tokens=runs["on"][0]["cached_tokens"],
                rounds=runs,
            )
            record(res)
        if args.breakdown:
            res["breakdown"] = {
                k: sides[c].play(args.seed, timed=True)[0] for k, c in (("off", False), ("on", True))
            }
            record(res)
        if config in args.profile.split(","):
            res["profile"] = {
                k: profile_round(sides[c], args, f"{config}/{k}") for k, c in (("off", False), ("on", True))
            }
            record(res)
    except Exception as exc:  # recorded; the next config still runs
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()[-3000:]
        record(res)
        print(res["traceback"], file=sys.stderr)
    finally:
        for side in sides.values():
            side.close()
        if model.device.type == "cuda":
            torch.cuda.empty_cache()
    return res


def profile_round(side: Side, args, name: str) -> dict:
    """One more round under torch.profiler (all threads' ops, the device's kernels); writes the top ops by device
    and by host time next to the JSON (multiturn_profile_<name>.txt); returns the totals (or the error: a
    profiler failure costs this round only)."""
    from torch.profiler import ProfilerActivity, profile

    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if side.cuda else [])
        with profile(activities=acts) as prof:
            row, _ = side.play(args.seed)
        events = prof.key_averages()
        path = args.out_path.parent / f"multiturn_profile_{name.replace('/', '_')}.txt"
        device_key = "self_device_time_total" if side.cuda else "self_cpu_time_total"
        path.write_text(
            f"{name}: round {row['seconds']} s under the profiler\n\n"
            + events.table(sort_by=device_key, row_limit=40)
            + "\n\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=25)
        )
        device_us = sum(getattr(e, "self_device_time_total", 0) for e in events) if side.cuda else 0
        return dict(seconds=row["seconds"], device_busy_s=round(device_us / 1e6, 4), table=path.name)
    except Exception as exc:
        return dict(error=f"{type(exc).__name__}: {exc}")


def parse_configs(spec: str, device: str) -> list[str]:
    if spec == "all":
        return list(ALL_CONFIGS)
    if not spec:
        return ["guess/bf16/default" if device.startswith("cuda") else "guess/fp32/default"]
    out = []
    for c in spec.split(","):
        parts = c.strip().split("/")
        if (
            len(parts) != 3
            or parts[0] not in ("guess", "long")
            or parts[1] not in DTYPES
            or parts[2]
            not in (
                "default",
                "exact",
            )
        ):
            raise SystemExit(
                f"--configs: {c!r} is not workload/dtype/mode (guess|long / fp32|bf16 / default|exact)"
            )
        out.append(c.strip())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--configs", default="", help="comma list of workload/dtype/mode, or 'all' (see doc)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine (after one warm-up round)")
    ap.add_argument("--breakdown", action="store_true", help="one more round per engine timing the forwards")
    ap.add_argument("--profile", default="", help="configs to run one more round each under torch.profiler")
    ap.add_argument(
        "--budget-s", type=float, default=0.0, help="start no config after this many seconds (0: none)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=32, help="guess: prompts")
    ap.add_argument("--n", type=int, default=4, help="guess: episodes per prompt")
    ap.add_argument("--max-new", type=int, default=16, help="guess: new tokens per turn")
    ap.add_argument("--episodes", type=int, default=64, help="long: episodes")
    ap.add_argument("--turns", type=int, default=4, help="long: turns per episode")
    ap.add_argument("--system-tokens", type=int, default=256, help="long: shared system prompt tokens")
    ap.add_argument("--obs-min", type=int, default=64, help="long: fewest observation tokens per turn")
    ap.add_argument("--obs-max", type=int, default=128, help="long: most observation tokens per turn")
    ap.add_argument("--long-max-new", type=int, default=32, help="long: new tokens per turn")
    ap.add_argument(
        "--out", default=None, help="default $OUT/multiturn.json, else bench/results/multiturn.json"
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s if args.budget_s > 0 else float("inf")
    configs = parse_configs(args.configs, args.device)
    if args.device == "cpu":
        torch.set_num_threads(2)
    out_dir = os.environ.get("OUT")
    out = Path(
        args.out
        or (Path(out_dir) / "multiturn.json" if out_dir else ROOT / "bench" / "results" / "multiturn.json")
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    args.out_path = out
    results = json.loads(out.read_text()) if out.is_file() else {}
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    setup = dict(
        card=card, torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        rounds=args.rounds, guess=dict(prompts=args.prompts, n=args.n, max_new=args.max_new),
        long=dict(episodes=args.episodes, turns=args.turns, system_tokens=args.system_tokens,
                  obs_tokens=[args.obs_min, args.obs_max], max_new=args.long_max_new),
        switch="relayrl/rollout/prefix_cache.py PREFIX_CACHE_ON_CUDA (its doc: the condition to flip it)",
    )  # fmt: skip
    models: dict = {}
    done: list[dict] = []
    for config in configs:
        if time.perf_counter() > deadline:
            print(f"budget reached: skipping {config}")
            results[f"{args.device}/{args.shape}/{config}"] = dict(config=config, skipped="budget")
            continue
        dtype = config.split("/")[1]
        if dtype not in models:  # (both dtypes of the 0.5B shape fit any card at once: 3 GB)
            models[dtype] = build(args.shape, args.device, DTYPES[dtype])
        key = f"{args.device}/{args.shape}/{config}"

        def record(res: dict, key: str = key) -> None:
            results[key] = dict(setup, **res, wall_s=round(time.perf_counter() - t_start, 1))
            out.write_text(json.dumps(results, indent=1) + "\n")

        t0 = time.perf_counter()
        model, tok = models[dtype]
        res = run_config(config, args, model, tok, record, deadline)
        print(f"{config}: {time.perf_counter() - t0:.1f} s", flush=True)
        done.append(res)
    report(done, args, card)
    if args.device.startswith("cuda"):
        results[f"{args.device}/{args.shape}/flip"] = verdict = flip_verdict(done)
        out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"PREFIX_CACHE_ON_CUDA may flip to True: {verdict['flip']} ({verdict['reasons']})")
    print(f"wrote {out}")


def flip_verdict(done: list[dict]) -> dict:
    """prefix_cache.PREFIX_CACHE_ON_CUDA's condition (its doc), checked on this run's configs."""
    by = {r["config"]: r for r in done if "median_s" in r}
    reasons = []

    def need(config: str, speedup: float, identical: bool) -> None:
        r = by.get(config)
        if r is None:
            reasons.append(f"{config} did not run")
            return
        if r["speedup"] < speedup:
            reasons.append(f"{config} {r['speedup']}x < {speedup}x")
        same, total = r["identical_ids_and_logprobs"].split("/")
        if identical and same != total:
            reasons.append(f"{config} identical {same}/{total}")

    need("guess/fp32/exact", 1.3, True)  # the target: >= 1.3x with identical fp32 trajectories
    for config in by:
        if config.endswith("/exact"):
            need(config, 0.0, True)  # the cache is exact on the GPU's code path, every workload and dtype
    need("guess/bf16/default", 1.0, False)  # the engine agents get: never slower on the cache's worst case,
    need("long/bf16/default", 1.3, False)  # and >= 1.3x on an agent's shape
    return dict(flip=not reasons, reasons="; ".join(reasons) or "all conditions met")


def report(done: list[dict], args, card: str) -> None:
    print(f"\n{args.shape} on {args.device} ({card}), {args.rounds} timed rounds per engine")
    print(f"{'config':<20}{'off s':>8}{'on s':>8}{'speed-up':>9}{'ids same':>10}{'+logprobs':>10}"
          f"{'prefilled off':>14}{'on':>8}{'cached':>8}")  # fmt: skip
    for r in done:
        if "median_s" not in r:
            print(f"{r['config']:<20}{r.get('error', 'no timed round')}")
            continue
        m, p = r["median_s"], r["prefill_tokens"]
        print(f"{r['config']:<20}{m['off']:>8.3f}{m['on']:>8.3f}{r['speedup']:>8.2f}x{r['identical_ids']:>10}"
              f"{r['identical_ids_and_logprobs']:>10}{p['off']:>14}{p['on']:>8}{r['cached_tokens']:>8}")  # fmt: skip
        for k, b in r.get("breakdown", {}).items():
            print(f"    cache {k}: prefill {b.get('prefill_s', 0):.3f} s ({b.get('prefill_calls', 0)} calls), "
                  f"extend {b.get('extend_s', 0):.3f} s ({b.get('extend_calls', 0)} calls, "
                  f"{b.get('extend_padded_tokens', 0)} padded tokens), decode + host {b['other_s']:.3f} s "
                  f"({b['decode_steps']} steps)")  # fmt: skip


if __name__ == "__main__":
    main()
