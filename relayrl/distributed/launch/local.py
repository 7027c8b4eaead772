"""`dist.mode=local`: every role is one worker object in this process (the 1-rank case of the launcher seam).

launcher = LocalLauncher()
policy = launcher.spawn("policy", PolicyWorker, spec)   # LocalRole[PolicyWorker]: .instance is the worker
policy.call(PolicyWorker.update, exp, kl_coef)           # a plain method call, in the caller's thread
policy.submit(PolicyWorker.logprobs, batch).result()     # computed at submit, returned by result()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, Generic, ParamSpec, TypeVar

from relayrl.distributed.launch.profile import profiled

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

    def __init__(self, name: str, instance: W) -> None:
        self.name = name
        self.instance = instance
        """The worker object itself."""
        self.world = 1

    def call(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        # by name, as on a Ray rank: `method` may be a Protocol's (relayrl.workers.proxies) the worker satisfies
        name = method.__name__
        return profiled(self.name, 0, name, lambda: getattr(self.instance, name)(*args, **kwargs))

    def submit(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> Done[R]:
        return Done(self.call(method, *args, **kwargs))


class LocalLauncher:
    """Every role in this process."""

    mode = "local"
    use_gpus = False
    """Local roles share this process's device; no weight group forms between them."""

    def __init__(self) -> None:
        self.concurrency: dict[str, int] = {}
        """Unused here (local calls run in the caller's thread, so concurrent callers run concurrently)."""

    def spawn(self, name: str, cls: Callable[P, W], /, *args: P.args, **kwargs: P.kwargs) -> LocalRole[W]:
        return LocalRole(name, cls(*args, **kwargs))

    def shutdown(self) -> None:
        return None
