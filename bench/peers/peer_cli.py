"""The command line and side loop shared by bench/peers/verl_grpo.py and openrlhf_grpo.py.

    add_args(parser, peer)            --gpus --shape --steps --warmup --peer-path --budget --sides --timeout
                                      --offload --model-dir
    run_sides(args, peer, row, run_peer)
                                      build (or reuse, --model-dir) the model folders, run each side under the
                                      command's budget, write $OUT/<peer>-<shape>-<gpus>gpu.json after each
                                      side, print the comparison

A SIGTERM (bench/peers/run_cells.py at a cell's budget) kills the running side's processes at once; the steps
it logged so far are kept and written, and no further side starts.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peer_common as pc


def add_args(parser: argparse.ArgumentParser, peer: str) -> None:
    parser.add_argument("--gpus", type=int, default=1, choices=[1, 2, 4, 8])
    parser.add_argument("--shape", default="0.5b", choices=sorted(pc.RL_SHAPES))
    parser.add_argument("--steps", type=int, default=0, help="steps per side (default 6 at 0.5b, 4 at 7b)")
    parser.add_argument(
        "--warmup", type=int, default=-1, help="leading steps not timed (default 2 / 1 at 7b)"
    )
    parser.add_argument("--peer-path", default="", help="a folder put first on the peer's PYTHONPATH only")
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole command (all sides)")
    parser.add_argument("--sides", default=f"relayrl,{peer}", help=f"comma list: relayrl, {peer}")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per side before it is killed")
    parser.add_argument(
        "--offload",
        default="auto",
        choices=["auto", *pc.OFFLOAD_MODES],
        help="model-state offload of every side (peer_common.offload_mode; auto: from the cards' memory)",
    )
    parser.add_argument(
        "--model-dir",
        default="",
        help="build the model folders here, or reuse them when a previous command finished building them",
    )


def finish_args(args: argparse.Namespace, peer: str) -> None:
    """Defaults that depend on the shape; unknown sides fail before anything is built."""
    args.steps = args.steps or (6 if args.shape == "0.5b" else 4)
    args.warmup = args.warmup if args.warmup >= 0 else (2 if args.shape == "0.5b" else 1)
    for side in args.sides.split(","):
        if side not in ("relayrl", peer):
            raise SystemExit(f"--sides: unknown side {side!r}; expected relayrl and/or {peer}")


def run_sides(
    args: argparse.Namespace,
    peer: str,
    row: dict[str, Any],
    run_peer: Callable[[Path, float, str], dict[str, Any]],
) -> None:
    """Each side in turn (relayrl's through peer_common.run_relayrl, the peer's through
    `run_peer(peer_model_dir, timeout_s, offload)`), the row written after each."""
    pc.stop_on_sigterm()
    budget = pc.Budget(args.budget)
    offload = pc.resolve_offload(args.offload, args.shape, args.gpus)
    row["offload"] = offload
    name = f"{peer}-{args.shape}-{args.gpus}gpu"
    pc.write_result(name, row)
    with contextlib.ExitStack() as stack:
        if args.model_dir:
            model, peer_model = pc.models_in(Path(args.model_dir), args.shape)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="peers_model_"))
            model, peer_model = pc.build_models_in_child(args.shape, Path(tmp))
        for side in args.sides.split(","):
            if pc.stopped():
                break
            pc.stop_ray()
            if side == "relayrl":
                res = pc.run_relayrl(
                    args.shape, args.gpus, args.steps, model, budget.left(args.timeout), offload
                )
            else:
                res = run_peer(peer_model, budget.left(args.timeout), offload)
            row[side] = {**pc.summarise(res["steps"], args.warmup), **res}
            pc.write_result(name, row)  # partial results as each side ends
        pc.stop_ray()
    pc.compare(peer, row)
    print(f"wrote {pc.write_result(name, row)}")
