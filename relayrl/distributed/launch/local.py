"""`dist.mode=local`: every role is one worker object in this process (the 1-rank case of the launcher seam).

launcher = LocalLauncher()
policy = launcher.spawn("policy", PolicyWorker, spec)   # LocalRole[PolicyWorker]: .instance is the worker
policy.call(PolicyWorker.update, exp, kl_coef)           # a plain method call, in the caller's thread
policy.submit(PolicyWorker.logprobs, batch).result()     # computed at submit, returned by result()

A call that runs out of memory raises launch.oom.OutOfMemory (one line: role, rank, phase, memory, what lowers
it); one that runs past dist.stall_timeout_s dumps the stacks and stops the process (launch.watchdog).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Concatenate, Generic, ParamSpec, TypeVar

from relayrl.distributed.launch.oom import call_method
from relayrl.distributed.launch.profile import profiled
from relayrl.distributed.launch.watchdog import StallWatch

P = ParamSpec("P")
R = TypeVar("R")
W = TypeVar("W")


class Done(Generic[R]):
    """An already computed result (local mode's `submit`)."""

    __slots__ = ("value",)

    def __init__(self, value: R) -> None:
        self.value = value

    def result(self) -> R:
        return self.value


class LocalRole(Generic[W]):
    """A worker instance in this process (one rank)."""

    def __init__(self, name: str, instance: W, watch: StallWatch | None = None) -> None:
        self.name = name
        self.watch = watch if watch is not None else StallWatch(0.0, None)
        """The launcher's stall watchdog (off by default)."""
        self.instance = instance
        """The worker object itself."""
        self.world = 1
        self.ready_s: dict[str, list[float]] = {}
        """Method -> [seconds of its last call] (one rank; as RayRole.ready_s)."""

    def call(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        # by name, as on a Ray rank: `method` may be a Protocol's (relayrl.workers.proxies) the worker satisfies;
        # an out-of-memory error becomes one line naming role, rank 0 and phase (launch.oom)
        name = method.__name__
        t0 = time.perf_counter()
        with self.watch.watching(self.name, 0, name):
            out = profiled(
                self.name, 0, name, lambda: call_method(self.instance, self.name, 0, name, args, kwargs)
            )
        self.ready_s[name] = [time.perf_counter() - t0]
        return out

    def submit(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> Done[R]:
        return Done(self.call(method, *args, **kwargs))


class LocalLauncher:
    """Every role in this process."""

    mode = "local"
    use_gpus = False
    """Local roles share this process's device; no weight group forms between them."""

    def __init__(self, stall_timeout_s: float = 0.0, stack_dir: Path | None = None) -> None:
        self.concurrency: dict[str, int] = {}
        """Unused here (local calls run in the caller's thread, so concurrent callers run concurrently)."""
        self.watch = StallWatch(stall_timeout_s, stack_dir)
        """The stall watchdog of every role call (dist.stall_timeout_s; launch.watchdog): dumps the stacks
        to `stack_dir` and exits the process."""

    def spawn(self, name: str, cls: Callable[P, W], /, *args: P.args, **kwargs: P.kwargs) -> LocalRole[W]:
        return LocalRole(name, cls(*args, **kwargs), self.watch)

    def shutdown(self) -> None:
        self.watch.close()
