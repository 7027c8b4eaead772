"""`dist.mode=ray`: each role is a group of Ray actors, one per rank, placed by relayrl.distributed.launch.placement.

    launcher = RayLauncher(dist_cfg, {"policy": 2, "reward": 1})    # role -> ranks; places the groups
    policy = launcher.spawn("policy", PolicyWorker, spec)           # RayRole[PolicyWorker]
    metrics = policy.call(PolicyWorker.update, exp, kl_coef)        # every rank, same arguments, merged
    launcher.shutdown()

`call(method, *args)` runs the method on EVERY rank of the role with the same arguments (big ones are put in
Ray's object store once); each rank takes its own share of the work (relayrl.distributed.group: contiguous
balanced shares), and the per-rank results are merged as the worker method declares with `@merged(...)`.

The ranks of a role join one torch.distributed group (NCCL with GPUs, gloo without): rank 0 reports its node's
IP and a free port, every rank then calls `init_process_group` with it and builds its worker, which shards its
model with FSDP2. Without `ray_address` a local Ray cluster is started (`num_cpus` CPUs, no dashboard) and shut
down by `shutdown()`; a cluster we did not start is left running (our actors and placement groups are removed).

Failures: a rank that raises or dies (killed, out of memory) makes `call` / `result()` raise `RoleError`
naming the role, rank, host and the original error (relayrl.distributed.launch.failures; a CUDA OOM is one
line with the phase and memory figures, launch.oom). A call that no rank finishes within dist.stall_timeout_s
is a stall: each rank's watchdog writes its stacks to the run folder (launch.watchdog) and `result()` raises a
RoleError naming the ranks still running; later calls of that role fail at once (its actors are stuck). The
caller stops the run; its last complete checkpoint stays loadable. Ray is imported in the functions (an
optional heavy dependency).
"""

from __future__ import annotations

import math
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from relayrl.config.dist import DistConfig
from relayrl.distributed.group import GroupSpec, join_group, leave_group, merge_results
from relayrl.distributed.launch.base import RoleError
from relayrl.distributed.launch.failures import Stalled, gather
from relayrl.distributed.launch.oom import call_method
from relayrl.distributed.launch.placement import MODEL_FREE, Pool, cpu_share, plan_pools, rank_gpus
from relayrl.distributed.launch.profile import CALL_ENV, PROFILE_ENV, profiled
from relayrl.distributed.launch.watchdog import StallWatch

P = ParamSpec("P")
R = TypeVar("R")
W = TypeVar("W")

PASSED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "TOKENIZERS_PARALLELISM", "PYTHONPATH", PROFILE_ENV, CALL_ENV)
"""Environment variables of the driver that Ray actors inherit (when set)."""


class RankHost:
    """The Ray actor hosting one rank of a role: joins the role's process group, then builds and runs the
    worker. Keeps worker classes free of Ray."""

    def __init__(
        self,
        role: str,
        rank: int,
        quiet: bool = False,
        stall_s: float = 0.0,
        stack_dir: str = "",
        threads: int = 0,
    ) -> None:
        self.role, self.rank = role, rank
        if threads > 0:
            _set_threads(threads)
        self.watch = StallWatch(stall_s, Path(stack_dir) if stack_dir else None, on_stall=_log_stall)
        """This rank's stall watchdog: dumps its stacks; the controller names the stall (failures.gather)."""
        self.worker: Any = None
        """The worker object (any worker class: this actor hosts whichever the launcher names)."""
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

    def start(
        self, group: GroupSpec, cls: Callable[..., Any], args: tuple, kwargs: dict
    ) -> tuple[str, str, int]:
        """Join the group and build the worker; returns (host name, Ray node id, torch's CPU threads)."""
        import ray
        import torch

        join_group(group)
        self.worker = cls(*args, **kwargs)
        return socket.gethostname(), ray.get_runtime_context().get_node_id(), torch.get_num_threads()

    def run(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self.watch.watching(self.role, self.rank, method):
            return profiled(
                self.role,
                self.rank,
                method,
                lambda: call_method(self.worker, self.role, self.rank, method, args, kwargs),
            )

    def stop(self) -> None:
        close = getattr(self.worker, "close", None)
        if callable(close):
            close()
        leave_group()


def _set_threads(threads: int) -> None:
    """This rank's CPU threads: torch's intra-op pool and OMP_NUM_THREADS for what it starts. Ray derives an
    actor's OMP_NUM_THREADS from its CPUs only when the variable is unset; inherited from the driver's
    environment (e.g. OMP_NUM_THREADS=64 on a 64-core host), every rank of the node would run 64 threads on
    cores the others need for the Python threads that launch their GPU work (docs/distributed.md: a 0.5B
    4-rank update of 2.0 s in a run with it, 0.32 s in one without)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def rank_threads(cpus_per_actor: float) -> int:
    """CPU threads of a rank given its actor's CPUs: Ray's own rule (the floor, at least 1)."""
    return max(1, math.floor(cpus_per_actor))


def _log_stall(message: str) -> None:
    print(f"relayrl: {message}", file=sys.stderr, flush=True)


class RayPending(Generic[R]):
    """Outstanding per-rank calls of one role (what `RayRole.submit` returns)."""

    __slots__ = ("method", "refs", "role", "started")

    def __init__(self, role: RayRole[Any], method: str, refs: list[Any]) -> None:
        self.role, self.method, self.refs = role, method, refs
        self.started = time.monotonic()

    def result(self) -> R:
        role = self.role
        ready_at = [0.0] * len(self.refs)
        try:
            results = gather(
                role.name,
                self.method,
                self.refs,
                role.hosts,
                role.timeout_s,
                stall=(role.stall_s, self.started),
                ready_at=ready_at,
            )
        except Stalled as e:  # its actors still run the stuck call: later calls would queue behind it
            role.stalled = str(e)
            raise
        role.ready_s[self.method] = [t - self.started for t in ready_at]
        return merge_results(self.role.cls, self.method, results)  # type: ignore[return-value]  # per @merged


class RayRole(Generic[W]):
    """A role as a group of Ray actors, one per rank (see module doc)."""

    def __init__(
        self,
        name: str,
        cls: Callable[..., W],
        actors: list[Any],
        hosts: list[str],
        timeout_s: float,
        nodes: list[str],
        stall_s: float = 0.0,
        threads: list[int] | None = None,
    ) -> None:
        self.name, self.cls, self.actors, self.hosts = name, cls, actors, hosts
        self.nodes = nodes
        """The Ray node id of each rank."""
        self.threads = threads or []
        """Each rank's torch CPU threads (RankHost: its actor's CPUs, whatever OMP_NUM_THREADS it inherited)."""
        self.world = len(actors)
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        """dist.stall_timeout_s (0 = off): a call no rank finished within it is a stall (failures.gather)."""
        self.stalled = ""
        """Set when a call stalled: the role's actors are stuck, so later calls fail at once with it."""
        self.ready_s: dict[str, list[float]] = {}
        """Method -> seconds from its last call's start to each rank's result ready in Ray's object store
        (before the driver fetches it): the spread is the wait for the slowest rank."""

    def call(self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.submit(method, *args, **kwargs).result()

    def submit(
        self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> RayPending[R]:
        import ray

        name = method.__name__
        if self.stalled:
            raise RoleError(
                f"{self.name}.{name}: not called, the role is stuck in an earlier call ({self.stalled})"
            )
        put_args: tuple[Any, ...] = args
        put_kwargs: dict[str, Any] = kwargs
        if self.world > 1:  # one copy in the object store, not one per rank
            put_args = tuple(ray.put(a) if _big(a) else a for a in args)
            put_kwargs = {k: ray.put(v) if _big(v) else v for k, v in kwargs.items()}
        refs = [a.run.remote(name, *put_args, **put_kwargs) for a in self.actors]  # top-level refs resolve
        return RayPending(self, name, refs)


def _bars_off() -> bool:
    logging_mod = sys.modules.get("transformers.utils.logging")
    return logging_mod is not None and not logging_mod.is_progress_bar_enabled()


def _big(x: Any) -> bool:
    return not isinstance(x, int | float | str | bool | type(None))


class RayLauncher:
    """Roles as groups of Ray actors in placement groups (see module doc)."""

    mode = "ray"

    def __init__(self, cfg: DistConfig, roles: dict[str, int], stack_dir: Path | None = None) -> None:
        import ray

        self.cfg = cfg
        self.stack_dir = stack_dir
        """Where the ranks' stall watchdogs write their stacks (each rank's own stderr log when None)."""
        self._started = False
        self._actors: list[Any] = []
        self.use_gpus = False
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
        self.pools: dict[str, Pool] = {}
        try:
            self._place(cfg, roles)
        except BaseException:  # leave nothing behind: our placement groups, and the cluster we started
            self.shutdown()
            raise

    def _place(self, cfg: DistConfig, roles: dict[str, int]) -> None:
        """Plan the pools and wait until the cluster has placed every placement group (see placement.py)."""
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group

        resources = ray.cluster_resources()
        self.use_gpus = cfg.gpus == "yes" or (cfg.gpus == "auto" and resources.get("GPU", 0) > 0)
        self.roles = roles
        self.where = plan_pools(cfg, roles)
        actors = sum(roles.values())
        # every CPU of the cluster shared among the actors (each rank's OMP / torch threads follow it,
        # RankHost: a GPU rank with 1 CPU would run its CPU work, e.g. an offloaded optimizer step, on one thread)
        self.cpu_per_actor = cpu_share(actors)
        for role, pool in self.where.items():
            p = self.pools.setdefault(pool, Pool(bundles=roles.get(pool, roles[role])))
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
            except GetTimeoutError as e:
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

    def spawn(self, name: str, cls: Callable[P, W], /, *args: P.args, **kwargs: P.kwargs) -> RayRole[W]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if name not in self.roles:
            raise RuntimeError(
                f"RayLauncher was planned for roles {sorted(self.roles)}; cannot spawn {name!r}"
            )
        world = self.roles[name]
        cfg = self.cfg
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
            ).remote(
                name,
                rank,
                _bars_off(),
                cfg.stall_timeout_s,
                str(self.stack_dir or ""),
                rank_threads(self.cpu_per_actor),
            )
            actors.append(actor)
        self._actors += actors
        addr, port, host0 = gather(
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
        placed = gather(name, "start", refs, [host0] * world, self.cfg.timeout_s)
        return RayRole(
            name,
            cls,
            actors,
            [h for h, _, _ in placed],
            cfg.timeout_s,
            nodes=[n for _, n, _ in placed],
            stall_s=cfg.stall_timeout_s,
            threads=[t for _, _, t in placed],
        )

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
