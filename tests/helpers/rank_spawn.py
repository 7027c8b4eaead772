"""Start the ranks of a multi-process CPU test (a real gloo group, one process a rank) from a fork server that
has imported torch, transformers, relayrl and the rank bodies once per test session.

`torch.multiprocessing.spawn` starts each rank as a fresh interpreter that imports all of that again: ~3-5 s
of CPU a rank, ~25 spawns of 2-4 ranks in `make test`, on 2 cores. A rank forked from the server starts in
~0.1 s. What runs in a rank is unchanged (its own process, its own gloo group, arguments pickled as spawn
pickles them, an exception in a rank raised in the test as `ProcessRaisedException`).

    from rank_spawn import spawn_ranks
    spawn_ranks(tp_workers.engine_worker, (2, store, out), nprocs=2)

The server forks each rank, so a rank sees the environment of the moment the server started (this module
sets it up at the first call), not a variable a test sets later: pass such settings as arguments. CUDA tests
keep `mp.spawn` (no CUDA state may be forked)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.multiprocessing.spawn import start_processes

HELPERS = Path(__file__).parent

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "relayrl.models.tiny",
    # the rank bodies of tests/helpers (and what they import)
    "tp_workers",
    "vocab_kernel_ranks",
    "bucket_gather_ranks",
    "sharded_load_ranks",
    "export_ranks",
    "refresh_ranks",
    "ema_ranks",
    "keep_gathered_ranks",
    "sp_fixtures",
]
"""Imported once by the fork server (a module that fails to import there is imported by each rank instead)."""

_started = False


def _start_server() -> None:
    """Start the fork server with PRELOAD, with the repository and tests/helpers on its PYTHONPATH (Python
    3.11's fork server does not take the test process's sys.path)."""
    global _started
    if _started:
        return
    multiprocessing.set_forkserver_preload(PRELOAD)
    old = os.environ.get("PYTHONPATH")
    paths = [str(HELPERS), str(HELPERS.parents[1]), *[p for p in sys.path if p]]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths + ([old] if old else [])))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    _started = True


def spawn_ranks(fn: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` processes; returns when all exit, raises if one failed (as mp.spawn)."""
    _start_server()
    start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
