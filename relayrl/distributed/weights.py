"""The rollout engine's weights beside a trainer's: one seam for "the engine sees the new policy".

    ew = EngineWeights(policy, dtype=torch.bfloat16)   ew.model: what the engine runs on
    ...optimizer step on `policy`...
    seconds = ew.refresh()                             on-device cast-copy into the engine's buffers
    ew.max_abs_diff()                                  the weight canary: 0 when the engine matches the
                                                       trainer's weights cast to the engine dtype

Two cases, decided once at construction:
- shared (dtype and device equal, e.g. fp32 on a CPU): the engine runs on the policy module itself; refresh
  is a no-op (nothing to copy; the engine reads the parameters in place).
- copy (mixed precision on a GPU: fp32 master weights, bf16 engine): `model` is a structural copy of the
  policy (LoRA adapters included) whose parameters are held in `dtype`; buffers (e.g. rotary inv_freq) keep
  their dtype. `refresh` copies every parameter with `Tensor.copy_` (a cast on the device, no host round
  trip, no serialisation, storage addresses unchanged, so CUDA graphs captured over them stay valid).
- gather (the trainer is sharded with FSDP2 over its ranks, relayrl.distributed.fsdp): `model` is a full
  replica made BEFORE the trainer is sharded (so every rank's engine holds the whole model in `dtype`);
  `refresh` gathers the shards one FSDP unit (decoder layer) at a time with FSDP's own all-gather, in the
  mixed-precision param dtype (bf16 on a GPU: half the bytes of fp32), and copies each parameter into the
  replica's buffer: one layer in flight at a time (bounded extra memory), on the device, every rank at once
  (a collective: all ranks call `refresh` and `max_abs_diff` together).
Only parameters that train (requires_grad) are refreshed: frozen ones (a LoRA run's base weights) were
copied at construction and never change.
"""

from __future__ import annotations

import copy
import time

import torch


class EngineWeights:
    """The engine-side weights of a trained module (see module doc)."""

    def __init__(
        self,
        source: torch.nn.Module,
        *,
        dtype: torch.dtype,
        gather: bool = False,
        device: torch.device | None = None,
        own_copy: bool = False,
        stream: bool = False,
    ) -> None:
        """`own_copy`: hold a copy even when dtype and device match (async training: the engine must not see
        optimizer steps until `refresh`); `stream`: the engine holds its own weights (vllm), see
        `engine_tensors`."""
        self.source = source
        self.dtype = dtype
        self.gather = gather
        self.stream = stream
        params = list(source.parameters())
        same_device = device is None or all(p.device == torch.device(device) for p in params)
        self.shared = not gather and not own_copy and same_device and all(p.dtype == dtype for p in params)
        self.trained = {n for n, p in source.named_parameters() if p.requires_grad}
        if self.shared:
            self.model = source
            self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            self._targets: dict[str, torch.Tensor] = {}
            return
        # the structure is deep-copied, each parameter is made directly in `dtype` on `device` (memo): no
        # second full-precision copy of the model ever exists
        memo: dict[int, object] = {
            id(p): torch.nn.Parameter(
                p.detach().to(device=device or p.device, dtype=dtype, copy=True), requires_grad=False
            )
            for p in params
        }
        self.model = copy.deepcopy(source, memo)
        self.model.eval()
        if device is not None:
            self.model.to(device)  # buffers (rotary tables) too
        self._targets = {n: p.data for n, p in self.model.named_parameters()}
        src = dict(source.named_parameters())
        self._pairs = (
            [] if gather else [(src[n].data, self._targets[n]) for n in self._targets if n in self.trained]
        )

    @torch.no_grad()
    def refresh(self) -> float:
        """Copy (cast) the trainer's current weights into the engine's; returns the seconds it took (device
        synchronised, so the number is the real cost)."""
        if self.shared:
            return 0.0
        t0 = time.perf_counter()
        if self.gather:
            from relayrl.distributed.fsdp import unit_tensors

            for name, full in unit_tensors(self.source, self.trained):
                self._targets[name].copy_(full)
        else:
            for s, d in self._pairs:
                d.copy_(s)
        first = next(iter(self._targets.values()), None)
        if first is not None and first.is_cuda:
            torch.cuda.synchronize(first.device)
        return time.perf_counter() - t0

    def engine_tensors(self) -> None:
        """What `engine.load_weights` gets after `refresh`: None (the engine's module was updated in place)."""
        return None

    @torch.no_grad()
    def max_abs_diff(self) -> float:
        """max |engine weight - trainer weight cast to the engine dtype| over every parameter (0 = in sync)."""
        if self.shared:
            return 0.0
        if self.gather:
            from relayrl.distributed.fsdp import full_tensors

            pairs = ((full, self._targets[n]) for n, full in full_tensors(self.source, self.dtype))
        else:
            src = dict(self.source.named_parameters())
            pairs = ((src[n].data, d) for n, d in self._targets.items())
        return max((float((d - s.to(d.dtype)).abs().max()) for s, d in pairs), default=0.0)
