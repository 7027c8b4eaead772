"""The vllm transport (base.py): what each vLLM worker process of a separate engine actor runs to take the
policy's weights, and the engine actor's receiver that runs it there.

    receiver = VLLMReceiver(engine, engine_rank, tp)        engine: WorkerLoading (rollout/base.py)
    receiver.join(channel, layout)  = engine.run_in_workers(join_weight_group, address, port, first_rank, world,
                                                            backend, timeout_s, layout)
    receiver.receive(version)       = engine.load_in_workers(receive_weights, version=version)   between rounds

A separate vLLM engine (relayrl/workers/engine.py, `dist.num_engines`, `dist.engine_tp`) runs its model in
`engine_tp` worker processes (vLLM's "mp" executor, one per GPU). The weights never pass through the engine
actor: each worker enters the policy's weight group (broadcast.py) itself, as rank
`first_rank + its tp rank` (the policy's rank 0 is rank 0, engine e's workers are 1 + e x tp + tp rank), and
keeps the sender's layout ((HF name, shape, dtype) in broadcast order: vLLM's own parameter names differ,
q/k/v and gate/up being packed). At each sync every worker receives every tensor of the layout
(`receive_named`, lazily) and feeds them in chunks of about LOAD_CHUNK_BYTES to its model's
`load_weights`, which copies HF-named tensors into the live parameters and keeps this rank's shard of each
(vLLM's loaders shard by tp rank), so CUDA graphs stay valid.

Checks and failures:
- the first receive checks that every parameter of vLLM's model was loaded (vLLM's own rule for a checkpoint):
  a layout that leaves one out is an error naming it, not a model half from the folder;
- a tensor vLLM's loader refuses (an unknown name, a shape mismatch) raises the loader's error, after the
  worker has taken the rest of the broadcast (into throwaway buffers), so the sender and the other workers
  finish the collective and the run stops on that error, not on a timeout at the sender.

The functions are pickled by reference into the workers (`collective_rpc`): relayrl must be importable there
(it is whenever the actor can import it: the workers inherit its environment).
"""

from __future__ import annotations

from typing import Any

import torch

from relayrl.distributed.weights.base import Channel, Layout
from relayrl.distributed.weights.broadcast import WeightGroup, receive_named
from relayrl.rollout.base import WorkerLoading
from relayrl.rollout.vllm_engine import LOAD_CHUNK_BYTES, named_chunks

RECEIVER = "_relayrl_weights"
"""Attribute of a vLLM worker holding [WeightGroup, layout, checked] after `join_weight_group`."""


def join_weight_group(
    worker: Any,
    address: str,
    port: int,
    first_rank: int,
    world: int,
    backend: str,
    timeout_s: float,
    layout: Layout,
) -> int:
    """Enter the weight group as rank first_rank + this worker's (tp) rank; keep `layout`. Returns the rank."""
    rank = first_rank + int(worker.rank)
    group = WeightGroup(address, port, rank=rank, world=world, backend=backend, timeout_s=timeout_s)
    setattr(worker, RECEIVER, [group, layout, False])
    return rank


def receive_weights(worker: Any, chunk_bytes: int = LOAD_CHUNK_BYTES) -> int:
    """Take the sender's broadcast of every tensor of the layout into this worker's model (see the module
    doc); returns how many tensors were received."""
    state = getattr(worker, RECEIVER, None)
    if state is None:
        raise RuntimeError("vllm worker: receive_weights before join_weight_group")
    group, layout, checked = state
    model = worker.model_runner.get_model()
    device = next(model.parameters()).device
    loaded: set[str] = set()
    incoming = receive_named(group, layout, device)
    with torch.inference_mode():  # vLLM may hold its parameters as inference tensors
        try:
            for chunk in named_chunks(incoming, chunk_bytes):
                loaded |= set(model.load_weights(weights=iter(chunk)) or ())
        except BaseException:
            for _ in incoming:  # the rest of the broadcast, so every rank finishes this collective
                pass
            raise
    if not checked:
        missing = sorted({n for n, _ in model.named_parameters()} - loaded)
        if missing:
            raise RuntimeError(
                f"vllm worker {worker.rank}: the policy's weights left {len(missing)} of vLLM's parameters "
                f"unloaded (e.g. {missing[:3]}); the policy's parameter names do not match the model folder's "
                "architecture"
            )
        state[2] = True
    return len(layout)


class VLLMReceiver:
    """A separate vLLM engine's end of the group (a `WeightReceiver`, base.py): its tp workers are ranks
    1 + engine_rank x tp + tp rank, each taking every tensor of the sender's layout (module doc)."""

    def __init__(self, engine: WorkerLoading, engine_rank: int, tp: int) -> None:
        self.engine, self.first_rank = engine, 1 + engine_rank * tp

    def layout(self) -> None:
        """None: vLLM loads whatever HF-named tensors the sender's layout lists (checked on the first receive)."""
        return None

    def join(self, channel: Channel, layout: Layout) -> None:
        c = channel
        self.engine.run_in_workers(
            join_weight_group, c.address, c.port, self.first_rank, c.world, c.backend, c.timeout_s, layout
        )

    def receive(self, version: int) -> None:
        self.engine.load_in_workers(receive_weights, version=version)
