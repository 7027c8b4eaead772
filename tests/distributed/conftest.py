"""Fixtures of the multi-rank tests: `ray_cluster`, one local 2-CPU Ray cluster per module (a module that needs
another setup defines its own fixture of the same name)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
