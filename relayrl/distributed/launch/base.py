"""The launcher seam: a role is a typed handle over its worker, called by method reference.

    policy: RoleHandle[PolicyWorker] = launcher.spawn("policy", PolicyWorker, spec)   # spec checked against
                                                                                      # PolicyWorker.__init__
    metrics = policy.call(PolicyWorker.update, exp, kl_coef)     # every rank runs it; results merged
    job = policy.submit(PolicyWorker.logprobs, batch)            # start it ...
    old = job.result()                                           # ... and collect it (a Tensor)

`call` / `submit` take the worker method itself (an unbound function of the worker class, or of a Protocol the
worker class satisfies, such as relayrl.workers.proxies.Generates), so a type checker checks the arguments and
the result type against the worker's signature and an editor jumps from the call site into the worker. Only
the method's name travels to the ranks (`method.__name__`); the per-rank results are merged as the worker
class's own method declares with `@merged(...)` (relayrl.distributed.group).

`RoleHandle` is covariant in the worker type: a `RoleHandle[PolicyWorker]` is a `RoleHandle[Generates]` when
PolicyWorker has Generates' methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
W = TypeVar("W")
W_co = TypeVar("W_co", covariant=True)


class RoleError(RuntimeError):
    """A rank of a role failed, died or stalled (the message names role, rank, host and the cause)."""


class Pending(Protocol[R_co]):
    """A started role call: `result()` waits for every rank and returns the merged result (or raises
    RoleError)."""

    def result(self) -> R_co: ...


class RoleHandle(Protocol[W_co]):
    """A worker living somewhere (this process, or one Ray actor per rank): call its methods by reference."""

    @property
    def name(self) -> str:
        """The role's name ("policy", "reward", ...)."""
        ...

    @property
    def world(self) -> int:
        """Ranks of the role."""
        ...

    def call(self, method: Callable[Concatenate[W_co, P], R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run `method` on every rank and return the merged result."""
        ...

    def submit(
        self, method: Callable[Concatenate[W_co, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        """Start `method` on every rank; `.result()` of the returned object collects it."""
        ...


class Launcher(Protocol):
    """Starts roles (local: objects in this process; ray: groups of actors) and stops them all."""

    @property
    def mode(self) -> str:
        """ "local" or "ray" (dist.mode)."""
        ...

    @property
    def use_gpus(self) -> bool:
        """The roles' ranks hold GPUs (a weight group between roles then uses NCCL)."""
        ...

    concurrency: dict[str, int]
    """Role -> calls one rank may run at once; set before `spawn` (the async rollout strategy raises it)."""

    def spawn(self, name: str, cls: Callable[P, W], /, *args: P.args, **kwargs: P.kwargs) -> RoleHandle[W]:
        """Build `cls(*args, **kwargs)` on every rank of role `name`."""
        ...

    def shutdown(self) -> None:
        """Stop every role (and a Ray cluster this launcher started)."""
        ...
