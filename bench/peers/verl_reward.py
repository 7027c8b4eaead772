"""verl's custom reward function (reward.custom_reward_function) over the file relayrl and OpenRLHF load:
tests/trainers/data/digit_reward.py, the fraction of digit characters of the response."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

_SPEC = importlib.util.spec_from_file_location(
    "digit_reward", Path(__file__).resolve().parents[2] / "tests" / "trainers" / "data" / "digit_reward.py"
)
assert _SPEC is not None and _SPEC.loader is not None
_MOD = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_MOD)


def compute_score(
    data_source: Any, solution_str: str, ground_truth: Any, extra_info: Any = None, **kw: Any
) -> float:
    """The response's digit fraction (queries = response with an empty prompt)."""
    return float(_MOD.reward_func([solution_str], [""], [ground_truth])["rewards"][0])
