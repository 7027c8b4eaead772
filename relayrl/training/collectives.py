"""What every small collective of a training rank needs to know (TrainStep's sums, replicated gradients, the
token budgets' agreement):

    grouped()        True when this process is one rank of a multi-process group (world size > 1)
    comm_device()    where a collective's small tensors live: the current CUDA device under NCCL, else the CPU
                     (gloo)
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["comm_device", "grouped"]


def grouped() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def comm_device() -> torch.device:
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
