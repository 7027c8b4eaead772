"""What the controller calls on a role that more than one worker class can fill, and the checkpoint face of a
trained role.

A role is a `RoleHandle[W]` (relayrl.distributed.launch.base) over its worker class W, called by method
reference: `roles.policy.call(PolicyWorker.update, exp, kl_coef)`. When two worker classes can fill one role,
the controller types the handle with a Protocol both satisfy and calls the Protocol's method (only the name
travels; the worker class's own `@merged` rule merges the ranks' results):

    Generates     rollout(samples, seed, eval) / close()    PolicyWorker (colocated engine), EngineWorker
    HoldsState    save(folder) / load(folder)               PolicyWorker, CriticWorker, ModelWorker

    gen: RoleHandle[Generates] = roles.engines or roles.policy
    trajs = gen.call(Generates.rollout, prompts, seed)

`WorkerFolder(handle)` lets relayrl.training.checkpoint.CheckpointManager write a role's state into a
checkpoint's sub-folder (`save_pretrained(path)` -> the workers' `save(path)`), so the controller's checkpoints
keep their atomic write, rotation and manifest while each rank writes its own shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from relayrl.agents.base import Trajectory
from relayrl.data.records import PromptSample
from relayrl.distributed.launch.base import RoleHandle


class Generates(Protocol):
    """A role that samples trajectories: the policy (its colocated engines) or the separate engines."""

    def rollout(self, samples: list[PromptSample], seed: int, eval: bool = False) -> list[Trajectory]:
        """n trajectories per prompt (eval: the eval sampling settings), grouped, in prompt order."""
        ...

    def close(self) -> None:
        """Stop the engine (aborts a batch in flight)."""
        ...


class HoldsState(Protocol):
    """A trained role whose state a checkpoint holds."""

    def save(self, folder: str) -> None:
        """Write model, optimizer, schedule and RNG into `folder` (each rank its part)."""
        ...

    def load(self, folder: str) -> None:
        """Restore what `save` wrote, in place."""
        ...


class WorkerFolder:
    """Lets CheckpointManager.save write a role's state: `save_pretrained(path)` -> every rank's save(path)."""

    def __init__(self, handle: RoleHandle[HoldsState]) -> None:
        self.handle = handle

    def save_pretrained(self, path: str | Path) -> None:
        self.handle.call(HoldsState.save, str(path))
