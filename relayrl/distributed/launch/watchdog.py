"""The stall watchdog: a role call that makes no progress for `dist.stall_timeout_s` dumps every thread's Python
stack to the run folder and stops the run, naming the stuck role, rank and phase.

    watch = StallWatch(1800.0, run_dir / "stacks", on_stall=stop_process)   # one per process
    with watch.watching("policy", 0, "update"):
        worker.update(exp, kl_coef)

"No progress" is one role call (a rollout, a log-prob pass, an update, a weight refresh) still running after
the timeout; 0 turns the watchdog off. A background thread checks the running calls every second (at most a
quarter of the timeout); the first overdue call writes `<stack_dir>/<role>_rank<r>.txt` (a header naming the
call, then `faulthandler.dump_traceback` of every thread) and calls `on_stall(message)`:

- dist.mode=local: the call runs in the controller's process, which cannot interrupt it (it may be stuck in a
  CUDA or NCCL call): `stop_process` prints the message and exits with code 1 (the last complete checkpoint
  stays loadable; checkpoints are written to a temporary folder and renamed).
- dist.mode=ray: every rank hosts its own StallWatch (relayrl.distributed.launch.ray.RankHost), which dumps its
  stacks and logs the message; the controller, waiting on the call, stops waiting `STALL_GRACE_S` later and
  raises a Stalled error (a RoleError) naming the ranks still running (relayrl.distributed.launch.failures.gather), after which
  the launcher's shutdown kills the actors.

The thread needs the GIL: a call stuck in C code that holds it (rare: CUDA, NCCL and sleeps release it) cannot be
dumped from Python; the controller's timeout in ray mode still names it.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from relayrl.distributed.launch.oom import PHASES

STALL_GRACE_S = 10.0
"""Ray mode: how long past the stall timeout the controller waits for the ranks to write their stacks (at most
this, at least 2 s, and no more than the timeout itself)."""

UNWATCHED = frozenset({"precompute", "evaluate"})
"""Calls that are one pass over a whole dataset (DPO's reference log-probs, a one-model eval): they may run for
hours on a big dataset, so they are not watched."""

STALL_EXIT_CODE = 1
"""Exit code of a local-mode run stopped by the watchdog."""


@dataclass(frozen=True, slots=True)
class _Call:
    role: str
    rank: int
    method: str
    started: float


def dump_stacks(stack_dir: Path | None, name: str, header: str) -> Path | None:
    """Every thread's Python stack of this process into `<stack_dir>/<name>.txt` (stderr when stack_dir is
    None); returns the file."""
    if stack_dir is None:
        print(header, file=sys.stderr, flush=True)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        return None
    stack_dir.mkdir(parents=True, exist_ok=True)
    path = stack_dir / f"{name}.txt"
    with open(path, "w") as f:
        f.write(header + "\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)
    return path


def stop_process(message: str) -> None:
    """Local mode's stall action: print the message and exit (the stuck call cannot be interrupted)."""
    print(f"relayrl: error: {message}", file=sys.stderr, flush=True)
    os._exit(STALL_EXIT_CODE)


class StallWatch:
    """Watches the role calls running in this process (see module doc)."""

    def __init__(
        self, timeout_s: float, stack_dir: Path | None, on_stall: Callable[[str], None] = stop_process
    ) -> None:
        self.timeout_s = timeout_s
        """Seconds a call may run before it counts as stalled; 0 = off."""
        self.stack_dir = stack_dir
        self.on_stall = on_stall
        self.fired = False
        """A stall was reported (once per process)."""
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self, role: str, rank: int, method: str) -> Iterator[None]:
        """Count the enclosed call as running (no-op when the watchdog is off)."""
        if self.timeout_s <= 0 or method in UNWATCHED:
            yield
            return
        key = next(self._ids)
        with self._lock:
            self._calls[key] = _Call(role=role, rank=rank, method=method, started=time.monotonic())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="relayrl-stall-watch", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._calls.pop(key, None)

    def close(self) -> None:
        """Stop the checking thread."""
        self._stop.set()

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            now = time.monotonic()
            with self._lock:
                overdue = [c for c in self._calls.values() if now - c.started >= self.timeout_s]
            if overdue and not self.fired:
                self.fired = True
                self._report(min(overdue, key=lambda c: c.started), now)

    def _report(self, call: _Call, now: float) -> None:
        phase = PHASES.get(call.method, call.method)
        where = f"{call.role} rank {call.rank} on host {socket.gethostname()} (pid {os.getpid()})"
        header = (
            f"{where} made no progress in {phase} ({call.method}) for {now - call.started:.0f} s "
            f"(dist.stall_timeout_s {self.timeout_s:g})"
        )
        path = dump_stacks(self.stack_dir, f"{call.role}_rank{call.rank}", header)
        self.on_stall(
            f"{header}; every thread's Python stack is in {path if path else 'stderr'}; a larger "
            f"dist.stall_timeout_s allows slower calls (0 turns the watchdog off)"
        )
