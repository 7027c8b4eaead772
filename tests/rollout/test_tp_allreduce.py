"""The tensor-parallel engine's all-reduce (relayrl/rollout/tp_allreduce.py, native_tp.RowParallelLinear).

CPU: the choice of implementation, the fallback to NCCL / gloo without any collective off CUDA, the row-parallel
layer's fast path (its GEMM written into the buffer and summed there; shapes that do not fit take the
dist.all_reduce path), the self-test catching a wrong sum, and the GPU set-up's agreed steps, with stand-in
reductions (a TP = 2 engine over gloo summing through a buffered stand-in is in test_native_tp.py). GPU (2
CUDA devices, `gpu` marker): the symmetric-memory one-shot, two-shot and auto all-reduces equal NCCL's bit for
bit on random [256, 3584] bf16 at TP = 2, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import contextlib
import os
import time
from typing import cast

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import tp_workers

from relayrl.rollout.native_tp import RowParallelLinear
from relayrl.rollout.tp_allreduce import FastAllReduce, resolve_impl, self_test, setup_fast_all_reduce


def standin(rows: int, cols: int, reduce, dtype=torch.float32) -> FastAllReduce:
    return FastAllReduce(torch.zeros(rows * cols, dtype=dtype), reduce, reduce, 0, "standin")


def test_impl_defaults_to_auto_and_the_env_overrides_it(monkeypatch):
    monkeypatch.delenv("RELAYRL_TP_ALLREDUCE", raising=False)
    assert resolve_impl(None) == "auto"
    monkeypatch.setenv("RELAYRL_TP_ALLREDUCE", "nccl")
    assert resolve_impl(None) == "nccl"
    assert resolve_impl("one_shot") == "one_shot"  # the engine's keyword wins over the env
    with pytest.raises(ValueError, match=r"allreduce=.*'ring' is not one of auto, nccl, one_shot, two_shot"):
        resolve_impl("ring")
    monkeypatch.setenv("RELAYRL_TP_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match=r"\$RELAYRL_TP_ALLREDUCE: 'fast'"):
        resolve_impl(None)


def test_off_cuda_it_is_nccl_or_gloo_without_any_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was attempted on CPU")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    monkeypatch.setattr(dist, "get_world_size", no_collective)
    assert setup_fast_all_reduce(object(), torch.device("cpu"), torch.float32, 8, 64) is None
    assert setup_fast_all_reduce(object(), torch.device("cpu"), torch.bfloat16, 8, 64, "one_shot") is None


def test_auto_keeps_nccl_above_two_ranks_without_touching_symmetric_memory(monkeypatch):
    """auto on a 4-rank CUDA group: NCCL, decided before any collective or allocation (module doc: the 4-rank
    symmetric-memory paths are not confirmed on GPUs); a forced algorithm still goes on to set it up."""
    from relayrl.rollout import tp_allreduce

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective was attempted")

    def went_on(*args, **kwargs):
        raise AssertionError("went on to set symmetric memory up")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(tp_allreduce, "_local_problem", went_on)
    cuda = torch.device("cuda", 0)
    assert setup_fast_all_reduce(object(), cuda, torch.bfloat16, 256, 5120, "auto") is None
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: tp_allreduce.AUTO_MAX_RANKS)
    with pytest.raises(AssertionError, match="went on"):  # 2 ranks: auto sets it up
        setup_fast_all_reduce(object(), cuda, torch.bfloat16, 256, 5120, "auto")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    with pytest.raises(AssertionError, match="went on"):  # forced: set up at 4 ranks too
        setup_fast_all_reduce(object(), cuda, torch.bfloat16, 256, 5120, "two_shot")


def row_parallel(fast: FastAllReduce | None) -> RowParallelLinear:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4, bias=True)
    lin.__class__ = RowParallelLinear  # as shard_model makes them
    out = cast(RowParallelLinear, lin)
    out.fast = fast
    return out


def test_a_product_that_fits_is_written_into_the_buffer_and_summed_there(monkeypatch):
    calls = []

    def nccl(t, group=None):
        calls.append(tuple(t.shape))
        t.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", nccl)
    fast = standin(6, 4, lambda v: v * 2)  # "two ranks with the same partial sums"
    lin = row_parallel(fast)
    x = torch.randn(2, 3, 8)
    y = lin(x)
    partial = F.linear(x, lin.weight)
    torch.testing.assert_close(y, 2 * partial + lin.bias, atol=0, rtol=0)  # the same GEMM, bit for bit
    assert torch.equal(fast.buffer.view(6, 4), partial.view(6, 4))  # written straight into the buffer
    assert calls == []
    y = lin(torch.randn(7, 8))  # 7 rows > the buffer's 6: NCCL
    assert calls == [(7, 4)] and y.shape == (7, 4)
    assert not fast.fits(4 * 4, torch.bfloat16)  # another dtype: NCCL
    assert not fast.fits(0, torch.float32)
    assert not fast.fits(3, torch.float32)  # 12 bytes: not a 16-byte multiple


def test_the_self_test_accepts_the_sum_and_catches_a_wrong_one():
    # rank 0 of 2: the peer holds pattern + 1, so the sum is 2 * own + 1
    self_test(standin(5, 4, lambda v: v * 2 + 1), rank=0, world=2, cols=4)
    with pytest.raises(RuntimeError, match=r"self-test: \d+ of 4 sums wrong at \[1, 4\]"):
        self_test(standin(5, 4, lambda v: v * 2), rank=0, world=2, cols=4)


@pytest.mark.gpu
def test_symmetric_memory_all_reduce_equals_nccl_bit_for_bit_at_tp2(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    out = str(tmp_path / "out")
    ctx = mp.spawn(
        tp_workers.allreduce_gpu_worker, args=(2, str(tmp_path / "store"), out), nprocs=2, join=False
    )
    deadline = time.monotonic() + 180  # a hung kernel fails the test instead of the run
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-GPU all-reduce workers did not finish in 180 s")
    for r in range(2):
        res = torch.load(f"{out}.{r}", weights_only=False)
        for impl in ("one_shot", "two_shot", "auto"):
            got = res[impl]
            assert got["name"] is not None, f"rank {r}: {impl} fell back to NCCL here (see the log)"
            assert got["eager_equal"] and got["graph_equal"], (r, impl, got)


@pytest.fixture
def gloo_world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_gpu_setup_steps_agree_and_fall_back_on_any_failure(gloo_world_of_one, monkeypatch):
    """_build's control flow (allocation, rendezvous, self-test, each agreed over the group; the algorithm
    picked) with the symmetric-memory calls replaced by CPU stand-ins (world of 1: the sum is the input)."""
    import torch.distributed._symmetric_memory as symm_mem

    from relayrl.rollout import tp_allreduce

    group = gloo_world_of_one
    monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: torch.empty(n, dtype=dtype))
    monkeypatch.setattr(symm_mem, "rendezvous", lambda buf, name: object())
    monkeypatch.setattr(tp_allreduce, "_one_shot", lambda name: lambda t: t.clone())
    monkeypatch.setattr(tp_allreduce, "_two_shot", lambda name: lambda t: t + 0)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    cpu, f32 = torch.device("cpu"), torch.float32

    def build(impl: str, errors: list[str]):
        return tp_allreduce._build(group, cpu, f32, 8 * 64, 64, impl, 0, 1, errors)

    errors: list[str] = []
    fast = build("auto", errors)
    assert fast is not None and fast.name == "one_shot" and errors == []
    assert fast.buffer.numel() == 8 * 64
    assert torch.equal(fast.buffer[:26], torch.arange(26.0) % 13)  # the self-test's last pattern (rank 0)
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"  # never a multicast object
    two = build("two_shot", errors)
    assert two is not None and two.name == "two_shot" and two.small is two.large

    def boom(buf, name):
        raise RuntimeError("no peer access")

    monkeypatch.setattr(symm_mem, "rendezvous", boom)
    assert build("auto", errors) is None
    assert errors == ["symm_mem.rendezvous failed on this rank: RuntimeError('no peer access')"]
    monkeypatch.setattr(symm_mem, "rendezvous", lambda buf, name: object())
    monkeypatch.setattr(tp_allreduce, "_one_shot", lambda name: lambda t: t * 2)  # a wrong sum
    errors.clear()
    assert build("auto", errors) is None
    assert len(errors) == 1 and errors[0].startswith(
        "self-test failed on this rank: RuntimeError('self-test: "
    )
