"""Launch role workers in-process (`local`) or as Ray actors (`ray`): the same worker classes either way.

    launcher = build_launcher(dist_cfg, num_roles=3)     # LocalLauncher or RayLauncher
    policy = launcher.spawn("policy", PolicyWorker, spec)  # -> RoleHandle
    trajs = policy.call("rollout", prompts, step)          # a plain method call, or ray.get(actor.m.remote())
    futs = [h.submit("logprobs", batch) for h in handles]  # start several roles at once ...
    results = launcher.wait(futs)                          # ... and collect them
    launcher.shutdown()

`RoleHandle` is the only seam the trainer sees: `call(method, *args)` runs a worker method and returns its
result; `submit` starts it and `wait` collects it, so independent roles (reference, critic, reward) run in
parallel under Ray and sequentially in-process with the same trainer code.

Ray placement: one placement group with one bundle per role (PACK strategy); each role actor is pinned to
its bundle. The rollout engine is colocated with the policy by construction: the policy worker owns it, so
it reads the policy's weights in place in both modes. Without `ray_address` a local Ray cluster is started
with `num_cpus` CPUs (no dashboard) and shut down by `shutdown()`; a cluster we did not start is left alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

from relayrl.config.rl import DistConfig


class RoleHandle(Protocol):
    """A worker living somewhere: call its methods by name."""

    name: str

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run `method` and return its result."""
        ...

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `method`; pass the returned token to `Launcher.wait`."""
        ...


@dataclass(slots=True)
class _Done:
    """An already computed result (local mode's `submit`)."""

    value: Any


class LocalRole:
    """A worker instance in this process."""

    def __init__(self, name: str, instance: Any) -> None:
        self.name = name
        self.instance = instance

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.instance, method)(*args, **kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> _Done:
        return _Done(self.call(method, *args, **kwargs))


class LocalLauncher:
    """Every role in this process."""

    mode = "local"

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> LocalRole:
        return LocalRole(name, cls(*args, **kwargs))

    def wait(self, tokens: list[Any]) -> list[Any]:
        return [t.value for t in tokens]

    def shutdown(self) -> None:
        return None


class RayRole:
    """A worker running as a Ray actor."""

    def __init__(self, name: str, actor: Any) -> None:
        self.name = name
        self.actor = actor

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        return ray.get(self.submit(method, *args, **kwargs))

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.actor, method).remote(*args, **kwargs)


class RayLauncher:
    """Roles as Ray actors in one placement group (one bundle per role)."""

    mode = "ray"

    def __init__(self, cfg: DistConfig, num_roles: int) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self._started = False
        if not ray.is_initialized():
            env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM") if k in os.environ}
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
        total = float(ray.cluster_resources().get("CPU", 1.0))
        self.cpus_per_role = min(1.0, total / max(1, num_roles))
        self.gpus_per_role = cfg.num_gpus_per_role
        bundle: dict[str, float] = {"CPU": self.cpus_per_role}
        if self.gpus_per_role:
            bundle["GPU"] = self.gpus_per_role
        self.pg = placement_group([dict(bundle) for _ in range(num_roles)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        self._next_bundle = 0
        self.num_roles = num_roles

    def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> RayRole:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._next_bundle >= self.num_roles:
            raise RuntimeError(f"RayLauncher was sized for {self.num_roles} roles; cannot spawn {name!r}")
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=self._next_bundle
        )
        self._next_bundle += 1
        remote_cls = ray.remote(num_cpus=self.cpus_per_role, num_gpus=self.gpus_per_role)(cls)
        actor = remote_cls.options(scheduling_strategy=strategy, name=None).remote(*args, **kwargs)
        return RayRole(name, actor)

    def wait(self, tokens: list[Any]) -> list[Any]:
        import ray

        return list(ray.get(list(tokens)))

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        if not ray.is_initialized():
            return
        try:
            remove_placement_group(self.pg)
        finally:
            if self._started:
                ray.shutdown()


Launcher = LocalLauncher | RayLauncher

LAUNCHERS = {"local": lambda cfg, n: LocalLauncher(), "ray": RayLauncher}


def build_launcher(cfg: DistConfig, num_roles: int) -> Launcher:
    """The launcher for `cfg.mode`; a clear error lists the modes."""
    if cfg.mode not in LAUNCHERS:
        raise ValueError(f"dist.mode: unknown execution mode {cfg.mode!r}; choose one of {sorted(LAUNCHERS)}")
    return LAUNCHERS[cfg.mode](cfg, num_roles)
