"""The all-reduce of the tensor-parallel native engine's row-parallel layers (native_tp.RowParallelLinear):
PyTorch's symmetric memory over NVLink on GPUs, NCCL everywhere else.

Why: a 7B decode step at batch 256 and TP = 2 runs 56 all-reduces of [256, 3584] bf16 (1.8 MB; o_proj and
down_proj of 28 layers), about 30 us each through NCCL's ring inside the CUDA graph: 1.7 ms of a 6.7 ms step
(H200 x 2, bench/tp_decode.py --profile 2). A one-shot all-reduce over peer-to-peer NVLink loads reads each
peer's partial sums straight out of its memory in one kernel (no ring steps, no proxy, no protocol chunks).

How: `setup_fast_all_reduce` allocates ONE flat buffer per engine (`torch.distributed._symmetric_memory.empty`,
max_slots x hidden elements of the engine dtype, at most MAX_BYTES) and `rendezvous`es it over the TP group
(every rank maps every peer's buffer), before any CUDA graph is captured, so every captured decode step and
every replay uses the same addresses. RowParallelLinear then writes its GEMM's partial sums straight into a
view of that buffer (`torch.mm(..., out=view)`: the same GEMM as F.linear) and reduces it with
`torch.ops.symm_mem.one_shot_all_reduce` (every rank loads every rank's view and sums it, in rank order) or,
for larger tensors with more than 2 ranks, `two_shot_all_reduce_out` (each rank reduces 1/TP of the elements
and the ranks gather the sums). Both kernels barrier with the peers on entry and on exit (signal pads), so one
buffer serves every layer: a rank's next GEMM cannot overwrite its view while a peer still reads it. Tensors
that do not fit (prefill chunks larger than the buffer), other dtypes and the vocab-parallel head's small
sampling reductions stay on NCCL. NVLink multicast (multimem) is never used: TORCH_SYMM_MEM_DISABLE_MULTICAST
is set to 1 (unless set already) before the first allocation, so the rendezvous creates no multicast object.

Where: `impl` "auto" (the engine's default; env RELAYRL_TP_ALLREDUCE overrides it) uses it on groups of at most
AUTO_MAX_RANKS (2) ranks, where it works, and falls back to NCCL, logging why, where it does not: more ranks (the
4-rank paths are not yet confirmed on GPUs: a TP 4 decode of the 32B shape with them did not finish in 3.5 minutes,
4 x H200, 2026-11-27, where TP 2 took under a minute; "one_shot" / "two_shot" still force them), not CUDA (CPU / gloo: no
collective is even attempted),
a non-NCCL group, a GPU below sm80, ranks on different hosts, no symmetric-memory ops in this torch build, or
any failure of the allocation, the rendezvous or a self-test (a known pattern reduced and checked, both
algorithms' paths). Every step's outcome is agreed by all ranks (a MAX all-reduce of a failure flag through
NCCL) before the next, so one rank's failure makes every rank fall back together, before any capture. "nccl"
turns it off; "one_shot" / "two_shot" force one algorithm.

Numerics: one-shot sums the ranks' bf16 values in rank order with a bf16 add after each (`__hadd2`: the fp32
sum rounded once to bf16), the same on every rank. At TP = 2 that is a single rounded a + b, which is what
NCCL computes (commutative), so results are bit-equal to NCCL's (tests/rollout/test_tp_allreduce.py checks it
on GPUs). At TP = 4 both round after each of 3 adds, in a different order (NCCL's ring order depends on the
chunk), so results differ from NCCL's in the last bf16 bits: the same tokens up to bf16 rounding, as between
any two all-reduce implementations, and still identical on every rank (the lock step needs that).

Cost: one buffer of max_slots x hidden (1.8 MB at 7B, batch 256) plus PyTorch's signal pads, per engine.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

IMPLS = ("auto", "nccl", "one_shot", "two_shot")
"""TPNativeEngine(allreduce=...): symmetric memory where it works (auto), NCCL only, or one algorithm forced."""
ENV = "RELAYRL_TP_ALLREDUCE"
"""Overrides the engine's default "auto" (e.g. RELAYRL_TP_ALLREDUCE=nccl to turn the fast path off)."""
MULTICAST_ENV = "TORCH_SYMM_MEM_DISABLE_MULTICAST"
MAX_BYTES = 16 << 20
"""The buffer's largest size: decode batches up to this many bytes of [batch, hidden] take the fast path."""
ONE_SHOT_MAX_BYTES = 512 << 10
"""auto with more than 2 ranks: one-shot up to this size, two-shot above (each rank reads 1/TP instead of all
of every peer's data; vLLM's custom all-reduce draws the line here too). 2 ranks (or any size but 4 and 8,
which have no two-shot kernel): always one-shot."""

AUTO_MAX_RANKS = 2
"""auto: symmetric memory on groups up to this size (confirmed on H200 x 2), NCCL on larger ones (module doc)."""

Reduce = Callable[[torch.Tensor], torch.Tensor]
"""The sum over the group of a view of the buffer, as a new tensor."""


def resolve_impl(impl: str | None) -> str:
    """`impl`, else the env override, else "auto"; a ValueError naming the choices."""
    value = impl if impl is not None else (os.environ.get(ENV) or "auto")
    if value not in IMPLS:
        where = "TPNativeEngine(allreduce=...)" if impl is not None else f"${ENV}"
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(IMPLS)}")
    return value


class FastAllReduce:
    """Sums over the TP group through one pre-allocated flat buffer (module doc): `slot(rows, cols)` is the
    view a row-parallel GEMM writes its partial sums into, `reduce(view)` their sum as a new tensor. `small` /
    `large`: the reductions of views up to / above `split_bytes` (the same function when one algorithm)."""

    def __init__(
        self, buffer: torch.Tensor, small: Reduce, large: Reduce, split_bytes: int, name: str
    ) -> None:
        self.buffer = buffer
        self.small, self.large, self.split_bytes = small, large, split_bytes
        self.name = name
        """What runs: "one_shot", "two_shot" or "one_shot+two_shot" (by size)."""

    def fits(self, numel: int, dtype: torch.dtype) -> bool:
        """True if a [.., numel] tensor of `dtype` can be reduced here (else NCCL); the same answer on every
        rank for the same shape, so all ranks take the same path."""
        size = numel * self.buffer.element_size()
        return dtype == self.buffer.dtype and 0 < numel <= self.buffer.numel() and size % 16 == 0

    def slot(self, rows: int, cols: int) -> torch.Tensor:
        return self.buffer[: rows * cols].view(rows, cols)

    def reduce(self, view: torch.Tensor) -> torch.Tensor:
        fn = self.small if view.numel() * view.element_size() <= self.split_bytes else self.large
        return fn(view)


def _one_shot(group_name: str) -> Reduce:
    op = torch.ops.symm_mem.one_shot_all_reduce
    return lambda t: op(t, "sum", group_name)


def _two_shot(group_name: str) -> Reduce:
    ops = torch.ops.symm_mem
    if hasattr(ops, "two_shot_all_reduce_out"):
        out_op = ops.two_shot_all_reduce_out
        return lambda t: out_op(t, "sum", group_name, torch.empty_like(t))
    inplace = ops.two_shot_all_reduce_
    return lambda t: inplace(t, "sum", group_name).clone()


def _torch_version() -> tuple[int, int]:
    major, minor = [*re.findall(r"\d+", torch.__version__), "0", "0"][:2]
    return int(major), int(minor)


def _local_problem(group: Any, device: torch.device, dtype: torch.dtype, impl: str) -> str | None:
    """Why this rank cannot use symmetric memory (None: it can), without any collective."""
    try:
        backend = dist.get_backend(group)
    except Exception as err:  # a group object this torch does not know
        return f"no backend for the group ({err!r})"
    if "nccl" not in str(backend).lower():
        return f"the TP group's backend is {backend}, not nccl"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"dtype {dtype} (the kernels take bf16 and fp32)"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"{torch.cuda.get_device_name(device)} is below sm80"
    world = dist.get_world_size(group)
    if impl == "two_shot" and world not in (2, 4, 8):
        return f"two_shot runs on 2, 4 or 8 ranks, not {world}"
    try:
        import torch.distributed._symmetric_memory as symm_mem  # noqa: F401  (optional in a torch build)
    except Exception as err:
        return f"torch.distributed._symmetric_memory does not import ({err!r})"
    ops = torch.ops.symm_mem
    for name in ("one_shot_all_reduce", "two_shot_all_reduce_"):
        if not hasattr(ops, name):
            return f"torch.ops.symm_mem.{name} is missing in torch {torch.__version__}"
    return None


def _agree(problem: str | None, group: Any, device: torch.device) -> bool:
    """True if no rank of the group has a problem (one MAX all-reduce of a flag)."""
    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item()) == 0


def _same_host(group: Any, device: torch.device) -> bool:
    """True if every rank of the group runs on this host (the peer-to-peer mapping is intra-node only)."""
    h = zlib.crc32(socket.gethostname().encode())
    t = torch.tensor([h, -h], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t[0].item()) == h and int(t[1].item()) == -h


def _step(what: str, fn: Callable[[], Any], group: Any, device: torch.device, errors: list[str]) -> Any:
    """Run one setup step on every rank and agree on its outcome; None (and the reason in `errors`) if it
    failed on any rank."""
    result, problem = None, None
    try:
        result = fn()
    except Exception as err:  # any failure means: NCCL
        problem = f"{what} failed on this rank: {err!r}"[:400]
    if not _agree(problem, group, device):
        errors.append(problem or f"{what} failed on another rank of the TP group (see its log)")
        return None
    return result


def self_test(fast: FastAllReduce, rank: int, world: int, cols: int) -> None:
    """Reduce a known integer pattern (exact in bf16) at the smallest and the largest size of both of
    `fast`'s paths; raises on a wrong sum."""
    full_rows = fast.buffer.numel() // cols
    small_rows = max(1, min(full_rows, fast.split_bytes // (cols * fast.buffer.element_size())))
    for rows in sorted({1, small_rows, full_rows}):
        view = fast.slot(rows, cols)
        pattern = torch.arange(rows * cols, device=view.device).remainder_(13).view(rows, cols)
        view.copy_(pattern + rank)
        got = fast.reduce(view)
        want = (pattern * world + world * (world - 1) // 2).to(view.dtype)
        if not torch.equal(got, want):
            bad = int((got != want).sum().item())
            raise RuntimeError(f"self-test: {bad} of {got.numel()} sums wrong at [{rows}, {cols}]")


def setup_fast_all_reduce(
    group: Any, device: torch.device, dtype: torch.dtype, rows: int, cols: int, impl: str = "auto"
) -> FastAllReduce | None:
    """The symmetric-memory all-reduce for [<= rows, cols] tensors of `dtype` over `group` (module doc), or
    None: NCCL (impl "nccl", or it cannot work here; the reason logged). Collective: every rank of `group`
    calls it with the same arguments, before any CUDA graph that should use it is captured."""
    impl = resolve_impl(impl)
    if impl == "nccl" or device.type != "cuda" or group is None or dist.get_world_size(group) < 2:
        if device.type == "cuda" and impl != "nccl":
            log.info("tensor-parallel all-reduce: NCCL (a group of one rank)")
        return None  # CPU / gloo: no collective, nothing logged above debug
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if impl == "auto" and world > AUTO_MAX_RANKS:
        log.info("tensor-parallel all-reduce: NCCL (auto picks symmetric memory for up to %d ranks, this group "
                 "has %d; allreduce='one_shot' or 'two_shot' forces it)", AUTO_MAX_RANKS, world)  # fmt: skip
        return None
    numel = min(rows * cols, MAX_BYTES // torch.empty((), dtype=dtype).element_size() // cols * cols)
    errors: list[str] = []
    with torch.cuda.device(device):
        problem = _local_problem(group, device, dtype, impl)
        if not _agree(problem, group, device):
            errors.append(problem or "another rank of the TP group cannot (see its log)")
        elif not _same_host(group, device):
            errors.append("the TP group spans hosts (peer-to-peer memory is one host's)")
        else:
            fast = _build(group, device, dtype, numel, cols, impl, rank, world, errors)
            if fast is not None:
                log.info("tensor-parallel all-reduce: symmetric memory, %s, [<= %d, %d] %s (%.1f MB), TP %d",
                         fast.name, numel // cols, cols, dtype, fast.buffer.nbytes / 1e6, world)  # fmt: skip
                return fast
    log.warning("tensor-parallel all-reduce: NCCL (symmetric memory unavailable: %s)", "; ".join(errors))
    return None


def _build(
    group: Any,
    device: torch.device,
    dtype: torch.dtype,
    numel: int,
    cols: int,
    impl: str,
    rank: int,
    world: int,
    errors: list[str],
) -> FastAllReduce | None:
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.setdefault(MULTICAST_ENV, "1")  # P2P kernels only: no multicast object at the rendezvous
    name = group.group_name

    def alloc() -> torch.Tensor:
        buf = symm_mem.empty(numel, dtype=dtype, device=device)
        buf.zero_()
        return buf

    def rendezvous() -> object:
        if _torch_version() < (2, 11) and hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(name)  # before 2.11 the group's store is registered by hand
        return symm_mem.rendezvous(buffer, name)  # 2.11 finds the store itself (and deprecates the above)

    buffer = _step("symm_mem.empty", alloc, group, device, errors)
    if buffer is None or _step("symm_mem.rendezvous", rendezvous, group, device, errors) is None:
        return None
    one, two = _one_shot(name), _two_shot(name)
    if impl == "one_shot" or (impl == "auto" and world not in (4, 8)):  # 2 ranks, or no two-shot kernel
        fast = FastAllReduce(buffer, one, one, buffer.nbytes, "one_shot")
    elif impl == "two_shot":
        fast = FastAllReduce(buffer, two, two, 0, "two_shot")
    else:
        fast = FastAllReduce(buffer, one, two, ONE_SHOT_MAX_BYTES, "one_shot+two_shot")

    def check() -> bool:
        self_test(fast, rank, world, cols)
        if device.type == "cuda":  # (a CPU stand-in in the tests)
            torch.cuda.synchronize(device)
        return True

    return fast if _step("self-test", check, group, device, errors) else None
