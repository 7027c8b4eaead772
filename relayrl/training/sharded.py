"""What the train step does differently when its model is sharded by FSDP2 (relayrl.distributed.fsdp): when
each unit gathers, reshards and reduces across a step's micro-batches, and the gradient norm and clipping
computed on each rank's local shards.

    units = Units(model, defer_grad_sync=True, keep_gathered=True, reshard_after_forward=True)
    with units.step():                        around the step's micro-batch loop
        for i, mb in enumerate(passes):
            units.before(i, len(passes))      before micro-batch i's forward
            ... forward, backward ...
    scale_(grads, factor)                     grads *= factor
    norm = total_norm(grads)                  the global L2 norm of DTensor (or plain) gradients
    clip_(grads, max_norm, norm)              grads *= min(1, max_norm / (norm + 1e-6))

Communication of one optimizer step with M micro-batches on each of the L + 1 units (decoder layers + root):

    defer_grad_sync  keep_gathered  all-gathers per step      reduce-scatters per step
    no               no             2 M L (fwd + bwd)          M L
    yes              no             2 M L                      L        (the default before keep_gathered)
    yes              yes            L (first forward)          L        (dist.keep_gathered)

keep_gathered leaves every unit's weights gathered (in the compute dtype) from the first micro-batch's
forward to the last one's backward: no reshard after any forward, none after a backward but the last. Each
skipped all-gather is also host work skipped on every rank (FSDP2's copy-in, the collective's launch, the
copy-out and the parameter swap of every unit), which is where a small model's sharded update spent its
time (bench/fsdp_host.py). The cost: the whole model's gathered weights for the length of the step, on top
of the unsharded fp32 gradients that the deferred reduction already holds. After the step every unit is
resharded, as without it (the optimizer, checkpoints and the engine refresh read the shards).

Norm and clipping on the local shards: the gradients of FSDP2 parameters are DTensors sharded along dim 0;
torch.nn.utils' norm and clip over them dispatch every foreach op through DTensor (a sharding propagation and
a wrap / unwrap of each tensor, measured 3-7 ms a step for 290 tensors on a CPU against ~1 ms here). Here the
same ops run on the local tensors, with the one all-reduce DTensor issues (of the per-tensor squared norms):
bit for bit the same norm and the same clipped gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, cast

import torch
from torch.distributed.tensor import DTensor

__all__ = ["Units", "clip_", "scale_", "total_norm"]


class _Unit(Protocol):
    """An FSDP2 unit (`FSDPModule`): when it gathers, reshards and reduces across a step's micro-batches."""

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None: ...
    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None: ...
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None: ...
    def reshard(self) -> None: ...


class Units:
    """The FSDP2 units of a model and how a train step's micro-batches drive them (see module doc). A model
    without FSDP2 units gets a no-op."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        defer_grad_sync: bool = False,
        keep_gathered: bool = False,
        reshard_after_forward: bool = True,
    ) -> None:
        units = [m for m in model.modules() if hasattr(m, "set_requires_gradient_sync")]
        self.units = cast(list[_Unit], units)
        """Every FSDP2 unit, the root (outermost) first."""
        self.defer_grad_sync = defer_grad_sync and bool(units)
        """Reduce-scatter the gradients after the step's last micro-batch only (unsharded fp32 gradients
        accumulate until then: + 4 bytes per parameter per rank)."""
        self.keep_gathered = keep_gathered and bool(units)
        """Gather each unit once per step and keep it gathered until the last backward (module doc)."""
        self.reshard_after_forward = reshard_after_forward
        """What the decoder-layer units were sharded with: restored after every step (no-grad forwards, e.g.
        log-probs and evals, reshard as configured)."""

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around one step's micro-batch loop: with keep_gathered no layer reshards after its forward; on
        leaving (also on an error) the units' settings are restored, and after an error every unit is
        resharded (a step cut short may have left them gathered)."""
        if self.keep_gathered:
            for unit in self.units[1:]:  # the root never reshards after forward (FSDP2's own rule)
                unit.set_reshard_after_forward(False, recurse=False)
        ok = False
        try:
            yield
            ok = True
        finally:
            if self.keep_gathered:
                for unit in self.units[1:]:
                    unit.set_reshard_after_forward(self.reshard_after_forward, recurse=False)
            for unit in self.units:
                if self.keep_gathered:
                    unit.set_reshard_after_backward(True, recurse=False)
                if self.defer_grad_sync:
                    unit.set_requires_gradient_sync(True, recurse=False)
                if not ok:
                    unit.reshard()

    def before(self, i: int, n: int) -> None:
        """Before micro-batch `i` of `n`: only the last one's backward reduces (defer_grad_sync) and
        reshards (keep_gathered)."""
        last = i == n - 1
        for unit in self.units:
            if self.defer_grad_sync:
                unit.set_requires_gradient_sync(last, recurse=False)
            if self.keep_gathered:
                unit.set_reshard_after_backward(last, recurse=False)


@torch.no_grad()  # DTensor.to_local without grad mode is the local tensor itself (no autograd function)
def _local(grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], Any]:
    """(the local tensors of `grads`, the process group their DTensors are sharded over, or None). FSDP2
    shards every parameter of a model the same way (one 1-D mesh, Shard(0)): the first DTensor's mesh and
    placements are checked, the others must match them."""
    first = next((g for g in grads if isinstance(g, DTensor)), None)
    if first is None:
        return list(grads), None
    mesh, placements = first.device_mesh, first.placements
    if mesh.ndim != 1 or not placements[0].is_shard():
        raise ValueError(
            f"a gradient placed as {placements} over a {mesh.ndim}-D mesh: the local-shard norm and clipping "
            "handle FSDP2's 1-D Shard placements only"
        )
    local: list[torch.Tensor] = []
    for g in grads:
        if not isinstance(g, DTensor) or g.device_mesh is not mesh or g.placements != placements:
            raise ValueError(
                f"gradients placed as {placements} and {getattr(g, 'placements', 'a plain tensor')} (or over two "
                "meshes): the local-shard norm and clipping need every gradient sharded alike (a plain one would "
                "be counted once per rank)"
            )
        local.append(g.to_local())
    return local, mesh.get_group()


def _by_kind(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """`tensors` grouped by (device, dtype), in order (a foreach op takes one kind)."""
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.device, t.dtype), []).append(t)
    return out


def total_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of `grads` together, over every rank's shards (a plain 0-dim tensor). Sharded: the
    ops DTensor runs for torch.nn.utils.get_total_norm, on the local tensors -- each tensor's local norm, the
    vector of them squared, summed over the ranks (ONE all-reduce), square-rooted (each tensor's full norm),
    then the norm of that vector -- without the per-tensor DTensor dispatch. Every rank must call it."""
    local, group = _local(grads)
    if group is None:
        return torch.nn.utils.get_total_norm(local, foreach=True)
    if not local:
        raise ValueError("total_norm of no gradients under a process group")
    first = local[0].device
    norms = [n.to(first) for same in _by_kind(local).values() for n in torch._foreach_norm(same, 2.0)]  # pyright: ignore[reportPrivateImportUsage]
    # as DTensor's _NormPartial(2.0) reduction of the stacked per-tensor norms: x ** p, sum, ** (1 / p)
    partial = torch.stack(norms) ** 2.0
    torch.distributed.all_reduce(partial, group=group)
    return torch.linalg.vector_norm(partial ** (1.0 / 2.0), 2.0)


def scale_(grads: Sequence[torch.Tensor], factor: float) -> None:
    """grads *= factor, in place, on the local tensors (one foreach op, no DTensor dispatch)."""
    local, _ = _local(grads)
    if local:
        torch._foreach_mul_(local, factor)  # pyright: ignore[reportPrivateImportUsage]  (public in torch)


def clip_(grads: Sequence[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """grads *= min(1, max_norm / (norm + 1e-6)), in place, on the local tensors (as
    torch.nn.utils.clip_grads_with_norm_)."""
    local, _ = _local(grads)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for (device, _), same in _by_kind(local).items():
        torch._foreach_mul_(same, coef.to(device))  # pyright: ignore[reportPrivateImportUsage]
