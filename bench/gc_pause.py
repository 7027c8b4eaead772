"""Garbage-collector pauses inside an RL run, with and without the start-up freeze (CPU, local mode).

    PYTHONPATH=. python bench/gc_pause.py [--steps 4 --prompts 64 --samples 8 --new-tokens 8] [--out x.json]

Runs `relayrl rl`'s own loop (the tiny model of the tests, the add2 task, local mode: the driver and every
role in this process) twice in fresh subprocesses: `frozen` as relayrl runs (relayrl.training.setup.freeze_heap
after the roles are built) and `unfrozen` with freeze_heap replaced by a no-op (the code before). A gc
callback records every collection from the end of start-up to the roles' close (before thaw_heap's own
collection): how many, their summed
seconds, and the full (generation 2) ones, each with its seconds. Also the tracked objects at the start of
the run and one full collection's seconds at its end. Prints a table, writes JSON (--out, default
bench/results/gc_pause.json). A full collection visits every tracked object it has not frozen, so its pause
grows with the process's heap (imports, datasets, tokenizer, trajectories), whatever the model size.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _child(variant: str, args: argparse.Namespace) -> dict:
    """One run in this process (the subprocess side): `variant` frozen | unfrozen."""
    import gc
    from dataclasses import replace

    import relayrl.trainers.rl.roles as roles
    from relayrl.config.presets import tiny_cpu_config
    from relayrl.models.tiny import save_tiny
    from relayrl.trainers.rl.loop import RLTrainer

    pauses: list[tuple[int, float]] = []
    t0 = [0.0]
    counting = [False]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            t0[0] = time.perf_counter()
        elif counting[0]:
            pauses.append((int(info["generation"]), time.perf_counter() - t0[0]))

    real = roles.freeze_heap
    objects: list[int] = []

    def start_up_done() -> None:
        gc.collect()
        objects.append(len(gc.get_objects()))  # before freezing: frozen objects are not listed
        if variant == "frozen":
            real()
        counting[0] = True

    real_thaw = roles.thaw_heap

    def run_ends() -> None:  # the roles close: stop counting before the thaw's own full collection
        counting[0] = False
        real_thaw()

    roles.freeze_heap, roles.thaw_heap = start_up_done, run_ends
    gc.callbacks.append(callback)
    tmp = Path(tempfile.mkdtemp(prefix="gc_pause_"))
    model = save_tiny(tmp / "model")
    cfg = tiny_cpu_config(str(model), str(tmp / "run"), steps=args.steps)
    cfg = replace(
        cfg,
        rollout=replace(
            cfg.rollout, prompts_per_step=args.prompts, n_samples=args.samples, max_new_tokens=args.new_tokens
        ),
        ckpt=replace(cfg.ckpt, save_final=False),
    )
    t = time.perf_counter()
    RLTrainer(cfg, banner=False).fit()
    run_s = time.perf_counter() - t
    counting[0] = False
    t = time.perf_counter()
    gc.collect()
    full_end = time.perf_counter() - t  # after the thaw: over everything again
    full = [round(s, 4) for g, s in pauses if g == 2]
    return {
        "variant": variant,
        "objects_at_start": objects[0] if objects else None,
        "collections": len(pauses),
        "collections_s": round(sum(s for _, s in pauses), 4),
        "full_collections_s": full,
        "full_collect_at_end_s": round(full_end, 4),
        "run_s": round(run_s, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gc_pause.json"))
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args)))
        return
    rows = []
    for variant in ("unfrozen", "frozen"):
        cmd = [sys.executable, __file__, "--child", variant, *sys.argv[1:]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"RL run, tiny model, {args.steps} steps of {args.prompts} x {args.samples} samples, local mode")
    print(
        f"{'variant':<10}{'objects':>9}{'collections':>13}{'their s':>9}  full collections (s){'':>4}end full s"
    )
    for r in rows:
        print(f"{r['variant']:<10}{r['objects_at_start']:>9}{r['collections']:>13}{r['collections_s']:>9.3f}  "
              f"{r['full_collections_s']!s:<24}{r['full_collect_at_end_s']:>6.3f}")  # fmt: skip
    report = {
        "argv": sys.argv[1:],
        "host": f"{platform.node()} ({platform.processor() or platform.machine()}, python {platform.python_version()})",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
