"""Failure attribution of a Ray role call: which rank failed, died or stalled, and why (one RoleError).

    results = gather(role, method, refs, hosts, timeout_s)   # every rank's result, in rank order

When one rank fails, its peers usually fail too (their collectives break); `gather` waits up to GRACE_S for
their outcomes and names the culprit first: a rank that died, else one that raised its own error, else ranks
still running while the others' collectives failed or timed out (a stuck rank), then the peers' errors. When
some ranks of a call are done and others are still running `timeout_s` later, the RoleError names the
stragglers. When no rank is done `stall_s` (dist.stall_timeout_s) after the call started, it is a stall: the
ranks' own watchdogs have written their stacks (launch.watchdog), and `Stalled` names every rank still running.
Ray is imported in the functions (an optional heavy dependency).
"""

from __future__ import annotations

import time
from typing import Any

from relayrl.distributed.launch.base import RoleError
from relayrl.distributed.launch.oom import PHASES
from relayrl.distributed.launch.watchdog import STALL_GRACE_S


class Stalled(RoleError):
    """No rank of a role call finished within dist.stall_timeout_s (the ranks are stuck in it)."""


def _label(role: str, rank: int, hosts: list[str], world: int) -> str:
    host = hosts[rank] if rank < len(hosts) else "?"
    return f"{role} rank {rank}/{world} on host {host}"


def _cause(err: BaseException) -> str:
    """The original error of a Ray exception, as one line."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(err, RayTaskError):
        cause = getattr(err, "cause", None)
        if cause is not None and not isinstance(cause, RayTaskError):
            return f"{type(cause).__name__}: {cause}".splitlines()[0]
        return str(err).strip().splitlines()[-1]
    if isinstance(err, RayActorError):
        return "the process died (killed, out of memory, or crashed); see the Ray logs of that worker"
    return f"{type(err).__name__}: {err}".splitlines()[0]


GRACE_S = 3.0
"""After a rank's call fails, how long to wait for the other ranks' outcomes before naming the culprit."""

_COLLECTIVE_ERRORS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "watchdog")


def _is_secondary(err: BaseException) -> bool:
    """A failure caused by a peer: a collective that broke or timed out because another rank died or hung."""
    from ray.exceptions import RayActorError

    if isinstance(err, RayActorError):
        return False
    text = _cause(err).lower()
    return any(k in text for k in _COLLECTIVE_ERRORS)


def _blame(
    role: str, method: str, failed: dict[int, BaseException], running: list[int], hosts: list[str], world: int
) -> RoleError:
    """One error naming the likely culprit first: a rank that died, else one that raised its own error, else
    ranks still running while their peers' collectives failed (stuck), then the others' errors."""
    from ray.exceptions import RayActorError

    died = [i for i, e in failed.items() if isinstance(e, RayActorError)]
    own = [i for i, e in failed.items() if i not in died and not _is_secondary(e)]
    secondary = [i for i in failed if i not in died and i not in own]
    parts = [f"{_label(role, i, hosts, world)} failed in {method}: {_cause(failed[i])}" for i in died + own]
    if not parts and running:
        parts.append(
            f"{'; '.join(_label(role, i, hosts, world) for i in running)} still running while its peers' "
            f"collectives failed (stuck or too slow: dist.timeout_s bounds a collective)"
        )
    tail = [f"{_label(role, i, hosts, world)}: {_cause(failed[i])}" for i in secondary]
    if not parts:
        parts, tail = tail[:1], tail[1:]
    msg = "; ".join(parts) + (f" (then {'; '.join(tail)})" if tail else "")
    first = failed[(died + own + secondary)[0]]
    err = RoleError(msg)
    err.__cause__ = first
    return err


def _stalled(
    role: str, method: str, running: list[int], hosts: list[str], world: int, stall_s: float
) -> Stalled:
    ranks = "; ".join(_label(role, i, hosts, world) for i in running)
    return Stalled(
        f"{ranks} made no progress in {PHASES.get(method, method)} ({role}.{method}) for {stall_s:g} s "
        f"(dist.stall_timeout_s): stuck; every rank's Python stack is in the run folder's stacks/ (or its "
        f"Ray worker log); a larger dist.stall_timeout_s allows slower calls (0 turns the watchdog off)"
    )


def gather(
    role: str,
    method: str,
    refs: list[Any],
    hosts: list[str],
    timeout_s: float,
    stall: tuple[float, float] = (0.0, 0.0),
    ready_at: list[float] | None = None,
) -> list[Any]:
    """Every rank's result; on failure a RoleError naming the culprit rank (see module doc and `_blame`).
    `stall`: (dist.stall_timeout_s, the call's start on time.monotonic()); a timeout of 0 is off.
    `ready_at`: one float per rank, set to the time.monotonic() at which each rank's result was seen ready (before it is
    fetched: every rank found ready is noted before any fetch, so a late stamp is off by at most one fetch)."""
    import ray

    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    failed: dict[int, BaseException] = {}
    pending = list(refs)
    first_done: float | None = None
    first_failed: float | None = None
    stall_s, started = stall
    stall_at = started + stall_s + min(STALL_GRACE_S, max(2.0, stall_s)) if stall_s > 0 else None
    while pending:
        deadlines = [t + d for t, d in ((first_done, timeout_s), (first_failed, GRACE_S)) if t is not None]
        if first_done is None and stall_at is not None:
            deadlines.append(stall_at)
        wait = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
        if ready and pending:  # note the others already done too, before this fetch delays their stamps
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        if ready_at is not None:
            now = time.monotonic()
            for r in ready:
                ready_at[index[r]] = now
        if not ready:
            running = sorted(index[r] for r in pending)
            if failed:
                raise _blame(role, method, failed, running, hosts, len(refs))
            if first_done is None:  # nothing done, nothing failed: only the stall deadline can have passed
                raise _stalled(role, method, running, hosts, len(refs), stall_s)
            raise RoleError(
                f"{role}.{method}: ranks {running} of {len(refs)} still running {timeout_s:.0f} s after the "
                f"others finished (a peer stuck or dead; dist.timeout_s bounds this): "
                + "; ".join(_label(role, i, hosts, len(refs)) for i in running)
            )
        for r in ready:
            i = index[r]
            try:
                results[i] = ray.get(r)
            except Exception as e:  # collected, then named by _blame
                failed[i] = e
                first_failed = first_failed if first_failed is not None else time.monotonic()
        first_done = first_done if first_done is not None else time.monotonic()
    if failed:
        raise _blame(role, method, failed, [], hosts, len(refs))
    return results
