"""Built-in tasks: each owns its data generator, reward and evaluation (the RL loop never parses answers)."""

from relayrl.tasks.base import TASKS, Task, get_task

__all__ = ["TASKS", "Task", "get_task"]
