"""pyproject's dependency ranges admit both tested ends (the GPU image and the CPU pins of `make test`), and the
`[vllm]` extra pins a vLLM whose torch is in range. The network resolution of `.[dev]` / `.[vllm]` is
`make check-deps` (.ci/check_deps), run by CI."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

GPU_IMAGE = {"torch": "2.11.0", "transformers": "5.17.0", "numpy": "2.3.5"}
"""The low end: the GPU machines' image (vllm 0.26.0 pins torch 2.11.0 and, via mistral-common, numpy < 2.4)."""
CPU_PINS = {"torch": "2.13.0", "transformers": "5.24.0", "numpy": "2.4.6"}
"""The high end: what `make test` installs on a fresh clone."""


def _requirements(extra: str | None = None) -> dict[str, Requirement]:
    lines = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
    return {r.name: r for r in map(Requirement, lines)}


def test_ranges_admit_both_tested_ends():
    deps = _requirements()
    for versions in (GPU_IMAGE, CPU_PINS):
        for name, version in versions.items():
            assert deps[name].specifier.contains(version), f"{name} {deps[name].specifier} rejects {version}"


def test_vllm_extra_pins_the_tested_release():
    assert str(_requirements("vllm")["vllm"].specifier) == "==0.26.0"
