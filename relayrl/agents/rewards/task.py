"""A built-in task's verifiable reward as a reward source: `task.reward(response_text, label)` per trajectory.

Cheap, pure Python: called inline on the event loop. A raise or a non-finite value fails that trajectory.
"""

from __future__ import annotations

from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.agents.failures import FailureLog, ScalarError, check_scalar, mark_failed
from relayrl.agents.rewards.base import pending


class TaskRewardSource:
    """Scores each trajectory's `response_text` against its sample's label with `task.reward`."""

    def __init__(self, task: Any, *, log: FailureLog | None = None) -> None:
        self.task, self.log = task, log
        self.name = f"task {getattr(task, 'name', type(task).__name__)}"

    async def score(self, trajs: list[Trajectory]) -> None:
        for t in pending(trajs):
            try:
                reward = check_scalar(self.task.reward(t.response_text, t.sample.label), "task reward")
            except ScalarError as e:
                mark_failed(t, e.kind, str(e), source=self.name, log=self.log)
                continue
            except Exception as e:
                mark_failed(t, "exception", f"raised {type(e).__name__}: {e}", source=self.name, log=self.log)
                continue
            t.reward = t.score = reward
