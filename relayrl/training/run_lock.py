"""One run per run folder: an exclusive lock on `<run folder>/.relayrl.lock` while a run writes there.

    lock_run_dir(run_dir, prog)     RunFolderBusy (naming the other process's pid, host and command) when
                                    another process's run holds the folder; idempotent within a process
    release_run_dir(run_dir)        at the end of the run (the process ending releases it too)

Two runs into one folder at once (the same command started twice) used to both exit 0 claiming one `final/`,
the second "resuming" from a checkpoint the first was still writing. The lock is `fcntl.flock` on the file, so
the kernel drops it when its process ends, however it ends: a killed or crashed run never leaves a lock that
blocks the next one. The file records the holder (pid, host, command, start time); a run that takes the lock
and finds a record left there (the previous holder ended without releasing it: killed, crashed) takes it over
with a note naming that process. A file system without flock support (some network mounts) runs unlocked,
with a warning. Standard library only (loadable without the package: the tests start lock holders cheaply).
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import IO

LOCK_FILE = ".relayrl.lock"

_held: dict[Path, IO[str]] = {}
"""This process's locks: resolved run folder -> the open, flock'ed lock file."""


class RunFolderBusy(RuntimeError):
    """Another process is running in this run folder (the message names it and what to do)."""


def _key(run_dir: Path) -> Path:
    return run_dir.expanduser().resolve()


def lock_run_dir(run_dir: Path, prog: str) -> bool:
    """Take the run folder's lock (the folder must exist); True when taken (or already held by this process),
    False when the file system cannot lock (a warning is printed). RunFolderBusy when another process holds
    it."""
    key = _key(run_dir)
    if key in _held:
        return True
    f = open(key / LOCK_FILE, "a+")  # noqa: SIM115 -- held open for the run's lifetime
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise RunFolderBusy(
            f"{run_dir} is in use by another run ({holder}); two runs writing one folder would mix their "
            f"checkpoints and outputs. Wait for it to finish (or stop it: kill {_pid_of(holder) or '<pid>'}), or "
            "choose another --train.output_dir"
        ) from None
    except OSError as e:
        f.close()
        print(
            f"{prog}: warning: cannot lock {run_dir} ({e}); make sure no other run writes there",
            file=sys.stderr,
        )
        return False
    f.seek(0)
    left = f.read().strip()
    pid = _pid_of(left)
    if left and pid != os.getpid():
        print(
            f"{prog}: note: taking over the lock of {run_dir} left by a run that ended without releasing it "
            f"({left}; {_state(left, pid)})",
            file=sys.stderr,
        )
    f.seek(0)
    f.truncate()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, {prog}, since {stamp}\n")
    f.flush()
    _held[key] = f
    return True


def release_run_dir(run_dir: Path, *, remove: bool = False) -> None:
    """Release this process's lock of `run_dir` (nothing when it holds none); the record is cleared, so the
    next run finds no lock left behind. `remove`: also delete the lock file (a run that never started, whose
    folder is removed)."""
    f = _held.pop(_key(run_dir), None)
    if f is None:
        return
    try:
        f.seek(0)
        f.truncate()
        f.flush()
        if remove:
            (_key(run_dir) / LOCK_FILE).unlink(missing_ok=True)
        fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        f.close()


def release_all() -> None:
    """Release every lock this process holds."""
    for key in list(_held):
        release_run_dir(key)


def _pid_of(record: str) -> int | None:
    m = re.match(r"pid (\d+)", record)
    return int(m.group(1)) if m else None


def _state(record: str, pid: int | None) -> str:
    """Whether the recorded process is gone (only knowable on this host)."""
    if pid is None or f" on {socket.gethostname()}," not in record:
        return "its process cannot be checked from this host"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid} is no longer running"
    except PermissionError:
        pass
    return f"pid {pid} exists but does not hold the lock"
