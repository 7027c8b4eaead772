"""RNG capture for exact resume: python, numpy, torch CPU and every CUDA device, in one place.

state = capture_rng_state()       # plain dict of tensors / tuples (torch.save-able)
restore_rng_state(state)          # CUDA states restored only where CUDA is present
seed_everything(seed)             # python, numpy, torch (all devices)
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

_LegacyState = tuple[str, np.ndarray, int, int, float]
"""numpy's legacy global RNG state: (bit generator name, keys uint32 [624], pos, has_gauss, cached_gaussian)."""


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _numpy_state() -> tuple[str, torch.Tensor, int, int, float]:
    """numpy's global state as plain types and a tensor (loadable with torch.load(weights_only=True))."""
    # legacy=True (the default) returns the tuple; numpy's stubs type the no-argument call as the dict
    state = cast(_LegacyState, np.random.get_state(legacy=True))
    name, keys, pos, has_gauss, cached = state
    return str(name), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def capture_rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when present) all CUDA RNG states, as tensors and plain types only (a
    checkpoint loads them with torch.load(weights_only=True): no pickled objects)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state` (CUDA states restored only when CUDA is present)."""
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
