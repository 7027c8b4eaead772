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
Multi-GPU refresh from FSDP shards (all-gather into these buffers) builds on this seam.
"""

from __future__ import annotations

import copy
import time

import torch


class EngineWeights:
    """The engine-side weights of a trained module (see module doc)."""

    def __init__(self, source: torch.nn.Module, *, dtype: torch.dtype) -> None:
        self.source = source
        params = list(source.parameters())
        self.shared = all(p.dtype == dtype for p in params)
        if self.shared:
            self.model = source
            self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            return
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None  # not copied
        try:
            self.model = copy.deepcopy(source)
        finally:
            for p, g in zip(params, grads, strict=True):
                p.grad = g
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
            p.data = p.data.to(dtype)
        src = dict(source.named_parameters())
        self._pairs = [(src[n].data, p.data) for n, p in self.model.named_parameters()]

    @torch.no_grad()
    def refresh(self) -> float:
        """Copy (cast) the trainer's current weights into the engine's; returns the seconds it took (device
        synchronised, so the number is the real cost)."""
        if self.shared:
            return 0.0
        t0 = time.perf_counter()
        for s, d in self._pairs:
            d.copy_(s)
        if self._pairs and self._pairs[0][1].is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    @torch.no_grad()
    def max_abs_diff(self) -> float:
        """max |engine weight - trainer weight cast to the engine dtype| over every parameter (0 = in sync)."""
        if self.shared:
            return 0.0
        return max((float((d - s.to(d.dtype)).abs().max()) for s, d in self._pairs), default=0.0)
