"""How `make test`'s two pytest-xdist workers share the suite (tests/conftest.py's scheduler): a module's tests
stay together, and every module that may start Ray is one unit, run in turn on one worker."""

from __future__ import annotations

import re
from pathlib import Path

RAY_WORD = re.compile(r"\bray\b", re.IGNORECASE)
RAY_SCOPE = "ray"

_uses_ray: dict[Path, bool] = {}


def uses_ray(path: Path) -> bool:
    """Whether a test module may start or join a Ray cluster: the word "ray", any case, in its source (a
    module that only mentions Ray is grouped too: that costs parallelism, never correctness)."""
    if path not in _uses_ray:
        _uses_ray[path] = bool(RAY_WORD.search(path.read_text()))
    return _uses_ray[path]


def scope_of(nodeid: str, root: Path) -> str:
    """The unit a test id is scheduled with: "ray", or its module's path."""
    module = nodeid.split("::", 1)[0]
    return RAY_SCOPE if uses_ray(root / module) else module
