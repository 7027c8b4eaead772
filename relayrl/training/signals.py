"""SIGINT / SIGTERM during a training loop: finish the step, write a checkpoint, exit 130 / 143.

    stop = SignalFlag("relayrl sft")
    with stop.installed():            # in the main thread; a no-op elsewhere
        ... loop: if stop.signum is not None: save, break ...
    exit code: stop.exit_code()       # 128 + signal number (130 SIGINT, 143 SIGTERM), 0 when none came

A second signal interrupts at once (KeyboardInterrupt; the command's error boundary prints one line).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


class SignalFlag:
    """SIGINT / SIGTERM set `signum` (the loop then checkpoints and exits); a second signal interrupts."""

    def __init__(self, prog: str = "relayrl rl") -> None:
        self.prog = prog
        self.signum: int | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(
            f"\n{self.prog}: signal {signum}: finishing this step, then writing a checkpoint", file=sys.stderr
        )

    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)
