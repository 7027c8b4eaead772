"""Shared fixtures: tiny models and tokenizers are built here, never downloaded.

Markers (pyproject.toml): `gpu` tests skip without CUDA; `slow` tests (multi-rank / Ray runs, async RL,
subprocesses killed or signalled, whole learning runs) are left out by `make test-fast` (`-m "not slow"`) and
run by `make test`, which is what CI runs.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# No GPU: relayrl/rollout/kernels.py's Triton kernels run in Triton's CPU interpreter (read when triton is
# first imported).
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test`'s workers: each its own Ray temp root, so that a
    # cluster one worker starts (`ray start` writes <root>/ray/ray_current_cluster) is never joined by the other
    os.environ.setdefault("RAY_TMPDIR", f"/tmp/ray_{os.environ['PYTEST_XDIST_WORKER']}")
    os.makedirs(os.environ["RAY_TMPDIR"], exist_ok=True)
# after the environment above: huggingface_hub reads HF_HUB_OFFLINE when it is first imported
import gc

import pytest
import torch
from suite_scopes import scope_of

from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer, save_tiny

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _unfreeze_the_heap():
    """A run in this process freezes its heap (relayrl.training.setup.freeze_heap); a test process runs many,
    so each test hands what it froze back to the collector."""
    yield
    if gc.get_freeze_count():  # a test stopped inside a run, before its thaw
        gc.unfreeze()
        gc.collect()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture()
def tiny_model(tiny_tokenizer):
    """A fresh fp32 2-layer Qwen2 (hidden 64) per test."""
    return build_tiny_model(tiny_tokenizer, TinyModelSpec(hidden=64, layers=2, seed=0))


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A saved tiny model + tokenizer folder, loadable by from_pretrained."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture()
def one_rank_group(tmp_path):
    """The default process group of one gloo rank in this process, destroyed after the test (FSDP2 and DCP run on
    it as on N ranks, without Ray or subprocesses; TrainStep and friends read `dist.is_initialized()`, so none may
    leak into later tests)."""
    dist = torch.distributed
    assert not dist.is_initialized(), "an earlier test left a process group"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own; a plain `pytest` never calls it
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers. Each module's tests go to one worker (its module and session
    fixtures are built once), and every module that may start Ray is one unit, run in turn on one worker: two
    Ray runs at once on 2 cores would stretch their timeouts, and `ray stop` in one test stops every cluster on
    the host. Each worker also has its own Ray temp root (above). (xdist's `loadgroup` marks cannot do this
    under pytest 9: the group suffix it writes into `item._nodeid` no longer reaches `item.nodeid`.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayApart(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, config.rootpath)

    return RayApart(config, log)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
