"""Built-in tasks: each owns its data generator, reward and evaluation (the RL loop never parses answers).

base.py        the Task protocol, is_held_out (hash split of train / test)
arith.py       add2, add3          guess.py   guess (multi-turn)      preference.py  feedback rows
image_digit.py image_digit (vision-language: read the digit in a picture)
registry.py    TASKS (name -> factory, a plain dict), get_task
"""

from relayrl.tasks.base import Task
from relayrl.tasks.registry import TASKS, get_task

__all__ = ["TASKS", "Task", "get_task"]
