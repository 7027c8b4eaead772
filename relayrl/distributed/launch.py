"""Launch role workers in-process (`local`) or as groups of Ray actors (`ray`): the same worker classes either way.

    launcher = build_launcher(dist_cfg, {"policy": 2, "reward": 1, "reference": 2})   # role -> ranks
    policy = launcher.spawn("policy", PolicyWorker, spec)   # -> RoleHandle over the role's ranks
    trajs = policy.call("rollout", prompts, seed)            # every rank runs it; results merged
    futs = [h.submit("logprobs", batch) for h in handles]   # start several roles at once ...
    results = launcher.wait(futs)                           # ... and collect them
    launcher.shutdown()

`RoleHandle` is the only seam the trainer sees. `call(method, *args)` runs the method on EVERY rank of the role
with the same arguments (big ones are put in Ray's object store once); each rank takes its own share of the
work (relayrl.distributed.group: contiguous balanced shares), and the per-rank results are merged as the
worker method declares with `@merged(...)` (rank 0's result by default, "concat" for per-rank pieces of a
batch). Local mode is the 1-rank case of the same protocol.

Ray placement (OpenRLHF's model): each role with a model is a group of `num_nodes x num_gpus_per_node` rank
actors, one per placement-group bundle ({GPU: 1, CPU: c}, PACK strategy, so a group fills a node before the
next; a separate engine's bundle has dist.engine_tp GPUs, for its tensor-parallel workers). Colocated roles
share a placement group: their rank i actors sit on the same bundle, each asking for a fraction of its GPU
(1 / roles sharing it); a bundle asks for the CPUs of the actors it hosts. The rule-based / remote reward role is one actor without a GPU.
The ranks of a role join one torch.distributed group (NCCL with GPUs, gloo without): rank 0 reports its node's
IP and a free port, every rank then calls `init_process_group` with it and builds its worker, which shards its
model with FSDP2. Without `ray_address` a local Ray cluster is started (`num_cpus` CPUs, no dashboard) and shut
down by `shutdown()`; a cluster we did not start is left running (our actors and placement groups are removed).

Failures: a rank that raises or dies (killed, out of memory) makes `call` / `wait` raise `RoleError` naming the
role, rank, host and the original error. When one rank fails, its peers usually fail too (their collectives
break); the launcher waits up to GRACE_S for their outcomes and names the culprit first: a rank that died,
else one that raised its own error, else ranks still running while the others' collectives failed or timed
out (a stuck rank), then the peers' errors. When some ranks of a call are done and others are still running
`timeout_s` later, `RoleError` names the stragglers. The caller stops the run; its last complete checkpoint
stays loadable.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from relayrl.config.dist import DistConfig
from relayrl.distributed.group import GroupSpec, join_group, leave_group, merge_results

PASSED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "TOKENIZERS_PARALLELISM", "PYTHONPATH")
"""Environment variables of the driver that Ray actors inherit (when set)."""


class RoleError(RuntimeError):
    """A rank of a role failed, died or stalled (the message names role, rank, host and the cause)."""


class RoleHandle(Protocol):
    """A worker living somewhere: call its methods by name."""

    name: str

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` and return its (merged) result."""
        ...

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `method`; pass the returned token to `Launcher.wait`."""
        ...


@dataclass(slots=True)
class _Done:
    """An already computed result (local mode's `submit`)."""

    value: Any


class LocalRole:
    """A worker instance in this process (one rank)."""

    def __init__(self, name: str, instance: Any) -> None:
        self.name = name
        self.instance = instance
        self.world = 1

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.instance, method)(*args, **kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> _Done:
        return _Done(self.call(method, *args, **kwargs))


class LocalLauncher:
    """Every role in this process."""

    mode = "local"

    def __init__(self) -> None:
        self.concurrency: dict[str, int] = {}
        """Unused here (local calls run in the caller's thread, so concurrent callers run concurrently)."""

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> LocalRole:
        return LocalRole(name, cls(*args, **kwargs))

    def wait(self, tokens: list[Any]) -> list[Any]:
        return [t.value for t in tokens]

    def shutdown(self) -> None:
        return None


# ================================================================================================ ray


class RankHost:
    """The Ray actor hosting one rank of a role: joins the role's process group, then builds and runs the
    worker. Keeps worker classes free of Ray."""

    def __init__(self, role: str, rank: int, quiet: bool = False) -> None:
        self.role, self.rank = role, rank
        self.worker: Any = None
        if quiet:  # the driver silenced transformers' per-file progress bars: so do its workers
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()

    def endpoint(self) -> tuple[str, int, str]:
        """(node IP, a free TCP port on it, host name): the rendezvous of the role's group (rank 0)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, socket.gethostname()

    def start(self, group: GroupSpec, cls: type, args: tuple, kwargs: dict) -> tuple[str, str]:
        """Join the group and build the worker; returns (host name, Ray node id)."""
        import ray

        join_group(group)
        self.worker = cls(*args, **kwargs)
        return socket.gethostname(), ray.get_runtime_context().get_node_id()

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def stop(self) -> None:
        close = getattr(self.worker, "close", None)
        if callable(close):
            close()
        leave_group()


@dataclass(slots=True)
class _Pending:
    """Outstanding per-rank calls of one role (what `RayRole.submit` returns)."""

    role: RayRole
    method: str
    refs: list[Any]


class RayRole:
    """A role as a group of Ray actors, one per rank (see module doc)."""

    def __init__(
        self, name: str, cls: type, actors: list[Any], hosts: list[str], timeout_s: float, nodes: list[str]
    ) -> None:
        self.name, self.cls, self.actors, self.hosts = name, cls, actors, hosts
        self.nodes = nodes
        """The Ray node id of each rank."""
        self.world = len(actors)
        self.timeout_s = timeout_s

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.collect(self.submit(method, *args, **kwargs))

    def submit(self, method: str, *args: Any, **kwargs: Any) -> _Pending:
        import ray

        if self.world > 1:  # one copy in the object store, not one per rank
            args = tuple(ray.put(a) if _big(a) else a for a in args)
            kwargs = {k: ray.put(v) if _big(v) else v for k, v in kwargs.items()}
        refs = [a.run.remote(method, *args, **kwargs) for a in self.actors]  # top-level refs are resolved
        return _Pending(self, method, refs)

    def collect(self, p: _Pending) -> Any:
        results = _gather(self.name, p.method, p.refs, self.hosts, self.timeout_s)
        return merge_results(self.cls, p.method, results)


def _bars_off() -> bool:
    import sys

    logging_mod = sys.modules.get("transformers.utils.logging")
    return logging_mod is not None and not logging_mod.is_progress_bar_enabled()


def _big(x: Any) -> bool:
    return not isinstance(x, int | float | str | bool | type(None))


def _label(role: str, rank: int, hosts: list[str], world: int) -> str:
    host = hosts[rank] if rank < len(hosts) else "?"
    return f"{role} rank {rank}/{world} on host {host}"


def _cause(err: BaseException) -> str:
    """The original error of a Ray exception, as one line."""
    import ray

    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if cause is not None and not isinstance(cause, ray.exceptions.RayTaskError):
            return f"{type(cause).__name__}: {cause}".splitlines()[0]
        return str(err).strip().splitlines()[-1]
    if isinstance(err, ray.exceptions.RayActorError):
        return "the process died (killed, out of memory, or crashed); see the Ray logs of that worker"
    return f"{type(err).__name__}: {err}".splitlines()[0]


GRACE_S = 3.0
"""After a rank's call fails, how long to wait for the other ranks' outcomes before naming the culprit."""

_COLLECTIVE_ERRORS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "watchdog")


def _is_secondary(err: BaseException) -> bool:
    """A failure caused by a peer: a collective that broke or timed out because another rank died or hung."""
    import ray

    if isinstance(err, ray.exceptions.RayActorError):
        return False
    text = _cause(err).lower()
    return any(k in text for k in _COLLECTIVE_ERRORS)


def _blame(
    role: str, method: str, failed: dict[int, BaseException], running: list[int], hosts: list[str], world: int
) -> RoleError:
    """One error naming the likely culprit first: a rank that died, else one that raised its own error, else
    ranks still running while their peers' collectives failed (stuck), then the others' errors."""
    import ray

    died = [i for i, e in failed.items() if isinstance(e, ray.exceptions.RayActorError)]
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


def _gather(role: str, method: str, refs: list[Any], hosts: list[str], timeout_s: float) -> list[Any]:
    """Every rank's result; on failure a RoleError naming the culprit rank (see module doc and `_blame`)."""
    import ray

    index = {r: i for i, r in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    failed: dict[int, BaseException] = {}
    pending = list(refs)
    first_done: float | None = None
    first_failed: float | None = None
    while pending:
        deadlines = [t + d for t, d in ((first_done, timeout_s), (first_failed, GRACE_S)) if t is not None]
        wait = None if not deadlines else max(0.0, min(deadlines) - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait)
        if not ready:
            running = sorted(index[r] for r in pending)
            if failed:
                raise _blame(role, method, failed, running, hosts, len(refs))
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


@dataclass(slots=True)
class _Pool:
    """A placement group shared by the roles colocated on it."""

    bundles: int
    roles: list[str] = field(default_factory=list)
    pg: Any = None


MODEL_FREE = ("reward",)
"""Roles without a model (rule-based / remote rewards): one CPU actor, no GPU. Every other role (policy,
reference, critic, an SFT / RM model, ...) holds a model: one GPU per rank (`rank_gpus`: dist.engine_tp for a
separate engine)."""


def rank_gpus(cfg: DistConfig, role: str) -> int:
    """GPUs of one rank of `role`: dist.engine_tp for a separate engine (its tensor-parallel workers), else 1."""
    return cfg.engine_tp if role == "engine" else 1


def plan_pools(cfg: DistConfig, roles: dict[str, int]) -> dict[str, str]:
    """role -> name of the placement group it sits in (see module doc); checks colocated sizes."""
    where: dict[str, str] = {}
    for role in roles:
        if role == "reward":
            where[role] = "reward"
            if cfg.colocate_critic_reward and "critic" in roles:
                where[role] = "critic"
            if cfg.colocate_all:
                where[role] = "policy"
        elif (role == "reference" and (cfg.colocate_policy_ref or cfg.colocate_all)) or (
            role == "critic" and cfg.colocate_all
        ):
            where[role] = "policy"
        else:
            where[role] = role
    for role, pool in where.items():
        if role not in MODEL_FREE and pool != role and roles[role] != roles[pool]:
            raise ValueError(
                f"dist: {role} is colocated with {pool} but has {roles[role]} ranks against {roles[pool]}: "
                f"colocated roles need the same nodes x gpus_per_node"
            )
    return where


def _cpu_share(actors: int) -> float:
    """CPUs per actor such that the actors pack onto the nodes (a fraction when CPUs are scarce, whole CPUs
    otherwise, which Ray turns into each actor's thread count)."""
    import math

    import ray

    cpus = [float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")]
    cpus = [c for c in cpus if c > 0] or [1.0]
    share = min(cpus) / math.ceil(actors / len(cpus))
    return share if share < 1 else float(int(share))


class RayLauncher:
    """Roles as groups of Ray actors in placement groups (see module doc)."""

    mode = "ray"

    def __init__(self, cfg: DistConfig, roles: dict[str, int]) -> None:
        import ray

        self.cfg = cfg
        self._started = False
        self._actors: list[Any] = []
        self.concurrency: dict[str, int] = {}
        """Role -> calls one rank may run at once (threads of its actor); 1 unless set before `spawn`."""
        if not ray.is_initialized():
            env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": True,
                "runtime_env": {"env_vars": env},
            }
            if cfg.ray_address:
                ray.init(address=cfg.ray_address, **kwargs)
            else:
                ray.init(num_cpus=cfg.num_cpus, **kwargs)
                self._started = True
        self.pools: dict[str, _Pool] = {}
        try:
            self._place(cfg, roles)
        except BaseException:  # leave nothing behind: our placement groups, and the cluster we started
            self.shutdown()
            raise

    def _place(self, cfg: DistConfig, roles: dict[str, int]) -> None:
        """Plan the pools and wait until the cluster has placed every placement group (see the module doc)."""
        import ray
        from ray.util.placement_group import placement_group

        resources = ray.cluster_resources()
        self.use_gpus = cfg.gpus == "yes" or (cfg.gpus == "auto" and resources.get("GPU", 0) > 0)
        self.roles = roles
        self.where = plan_pools(cfg, roles)
        actors = sum(roles.values())
        # every CPU of the cluster shared among the actors (Ray sets each actor's OMP / torch threads from
        # it: a GPU rank with 1 CPU would run its CPU work, e.g. an offloaded optimizer step, on one thread)
        self.cpu_per_actor = _cpu_share(actors)
        for role, pool in self.where.items():
            p = self.pools.setdefault(pool, _Pool(bundles=roles.get(pool, roles[role])))
            p.roles.append(role)
        for p in self.pools.values():
            gpu = self.use_gpus and any(r not in MODEL_FREE for r in p.roles)
            bundles = []
            for i in range(p.bundles):  # bundle i hosts rank i of every role that has one (reward: 1 rank)
                actors = sum(1 for r in p.roles if roles[r] > i)
                bundle: dict[str, float] = {"CPU": self.cpu_per_actor * actors}
                if gpu:
                    bundle["GPU"] = float(rank_gpus(cfg, p.roles[0]))
                bundles.append(bundle)
            p.pg = placement_group(bundles, strategy="PACK")
        for p in self.pools.values():
            try:
                ray.get(p.pg.ready(), timeout=cfg.timeout_s)
            except ray.exceptions.GetTimeoutError as e:
                raise RoleError(
                    f"dist: the Ray cluster cannot place {p.bundles} bundle(s) for {'+'.join(p.roles)} "
                    f"within {cfg.timeout_s:.0f} s (asked for {p.pg.bundle_specs}; cluster resources: "
                    f"{resources}); lower the *_num_gpus_per_node / *_num_nodes values or add nodes"
                ) from e

    def _gpu_share(self, role: str) -> float:
        pool = self.pools[self.where[role]]
        if not self.use_gpus or role in MODEL_FREE:
            return 0.0
        return rank_gpus(self.cfg, role) / sum(1 for r in pool.roles if r not in MODEL_FREE)

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> RayRole:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if name not in self.roles:
            raise RuntimeError(
                f"RayLauncher was planned for roles {sorted(self.roles)}; cannot spawn {name!r}"
            )
        world = self.roles[name]
        pool = self.pools[self.where[name]]
        host_cls = ray.remote(RankHost)
        actors = []
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pool.pg, placement_group_bundle_index=rank
            )
            actor = host_cls.options(
                num_cpus=self.cpu_per_actor,
                num_gpus=self._gpu_share(name),
                scheduling_strategy=strategy,
                max_concurrency=self.concurrency.get(name, 1),
            ).remote(name, rank, _bars_off())
            actors.append(actor)
        self._actors += actors
        addr, port, host0 = _gather(
            name, "endpoint", [actors[0].endpoint.remote()], ["?"], self.cfg.timeout_s
        )[0]
        backend = "nccl" if self.use_gpus and name not in MODEL_FREE else "gloo"
        refs = [
            a.start.remote(
                GroupSpec(
                    rank=r, world=world, addr=addr, port=port, backend=backend, timeout_s=self.cfg.timeout_s
                ),
                cls,
                args,
                kwargs,
            )
            for r, a in enumerate(actors)
        ]
        placed = _gather(name, "start", refs, [host0] * world, self.cfg.timeout_s)
        return RayRole(
            name, cls, actors, [h for h, _ in placed], self.cfg.timeout_s, nodes=[n for _, n in placed]
        )

    def wait(self, tokens: list[Any]) -> list[Any]:
        return [t.role.collect(t) for t in tokens]

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        try:
            for a in self._actors:
                ray.kill(a)
            for p in self.pools.values():
                if p.pg is not None:
                    remove_placement_group(p.pg)
        finally:
            self._actors = []
            if self._started:
                ray.shutdown()


Launcher = LocalLauncher | RayLauncher

LAUNCHERS = {"local": lambda cfg, roles: LocalLauncher(), "ray": RayLauncher}


def build_launcher(cfg: DistConfig, roles: dict[str, int]) -> Launcher:
    """The launcher for `cfg.mode` sized for `roles` (role -> ranks); a clear error lists the modes."""
    if cfg.mode not in LAUNCHERS:
        raise ValueError(f"dist.mode: unknown execution mode {cfg.mode!r}; choose one of {sorted(LAUNCHERS)}")
    return LAUNCHERS[cfg.mode](cfg, roles)
