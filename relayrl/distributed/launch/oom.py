"""A CUDA out-of-memory error in any role, as one line: role, rank, phase, memory figures, what lowers it.

    try:
        worker.update(exp, kl_coef)
    except torch.OutOfMemoryError as e:
        raise OutOfMemory(oom_message("policy", 0, "update", e)) from e

Every role call goes through `call_method` (LocalRole.call in this process, RankHost.run on a Ray rank), so an
OOM anywhere (generation, log-probs, update, weight refresh) reads, for example:

    policy rank 0 ran out of GPU memory in update (PolicyWorker.update): tried to allocate 2.00 GiB; cuda:0
    allocated 61.2 GiB, reserved 74.0 GiB, peak 70.3 GiB, free 0.4 of 79.1 GiB; lower it with
    algo.micro_batch_tokens, model.gradient_checkpointing true, dist.offload true, ...

(one line in practice). Without CUDA (a test that injects the error, or a CPU run) the figures say so.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from relayrl.distributed.launch.base import RoleError

PHASES = {
    "rollout": "generation",
    "logprobs": "log-probs",
    "values": "log-probs",
    "precompute": "log-probs",
    "infer": "log-probs",
    "update": "update",
    "step": "update",
    "sync": "refresh",
    "receive_weights": "refresh",
    "join_weights": "refresh",
    "evaluate": "eval",
}
"""A worker method's name -> the phase of the step it belongs to (others are named by the method)."""

LOWER_IT = {
    "generation": "rollout.vllm_gpu_util (vllm: the engine's memory share) or rollout.engine_slots (native), "
    "a smaller rollout.n_samples or rollout.prompts_per_step or rollout.max_len, "
    "dist.offload_optimizer_in_rollout true, rollout.engine_copy no",
    "log-probs": "algo.micro_batch_tokens (rl; train.max_tokens_per_micro_batch / train.micro_batch_size "
    "for the other commands), a smaller rollout.n_samples, a smaller rollout.vllm_gpu_util or "
    "dist.engine_sleep yes",
    "update": "algo.micro_batch_tokens (rl; train.max_tokens_per_micro_batch / train.micro_batch_size for the "
    "other commands), model.gradient_checkpointing true, dist.offload true, dist.engine_sleep yes or a "
    "smaller rollout.vllm_gpu_util (the engine's memory share), a smaller rollout.n_samples, "
    "rollout.engine_copy no",
    "refresh": "a smaller rollout.vllm_gpu_util (the engine's memory share), dist.engine_sleep yes, "
    "dist.offload_optimizer_in_rollout true, dist.offload true, rollout.engine_copy no",
}
"""Phase -> the settings that lower its memory (config field names)."""

DEFAULT_LOWER = (
    "algo.micro_batch_tokens / train.max_tokens_per_micro_batch, model.gradient_checkpointing true, "
    "dist.offload true, a smaller rollout.vllm_gpu_util, a smaller rollout.n_samples"
)


class OutOfMemory(RoleError):
    """A role's rank ran out of (GPU) memory; the message is one line (see module doc)."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def memory_figures() -> str:
    """This process's CUDA memory (allocated, reserved, peak, free of total on the current device), or a
    note that CUDA is not available."""
    if not torch.cuda.is_available():
        return "no CUDA device in this process (no memory figures)"
    dev = torch.cuda.current_device()
    alloc, reserved = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    free, total = torch.cuda.mem_get_info(dev)
    return (
        f"cuda:{dev} allocated {_gib(alloc)} GiB, reserved {_gib(reserved)} GiB, peak {_gib(peak)} GiB, "
        f"free {_gib(free)} of {_gib(total)} GiB (memory outside torch's allocator, e.g. vLLM's KV cache or "
        f"another process, is total - free - reserved)"
    )


def _request(err: BaseException) -> str:
    """What the failed allocation asked for, from torch's message ("Tried to allocate 2.00 GiB")."""
    m = re.search(r"tried to allocate ([0-9.]+ ?[KMGT]?i?B)", str(err), flags=re.IGNORECASE)
    return f"tried to allocate {m.group(1)}; " if m else ""


def oom_message(role: str, rank: int, method: str, err: BaseException, cls: str = "") -> str:
    """The one line (see module doc)."""
    phase = PHASES.get(method, method)
    where = f"{cls}.{method}" if cls else method
    lower = LOWER_IT.get(phase, DEFAULT_LOWER)
    return (
        f"{role} rank {rank} ran out of GPU memory in {phase} ({where}): {_request(err)}{memory_figures()}; "
        f"lower it with {lower}"
    )


def call_method(worker: Any, role: str, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
    """`worker.<method>(*args, **kwargs)`, a torch.OutOfMemoryError turned into OutOfMemory (one line)."""
    try:
        return getattr(worker, method)(*args, **kwargs)
    except torch.OutOfMemoryError as e:
        raise OutOfMemory(oom_message(role, rank, method, e, type(worker).__name__)) from e
