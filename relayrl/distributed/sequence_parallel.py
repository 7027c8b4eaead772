"""Sequence-parallel (SP) process groups of a role: its R ranks are R / W data-parallel (DP) groups of W
consecutive ranks each (W = dist.sp_size); the W ranks of a group hold the same micro-batches and split each
packed row's tokens (relayrl.models.sequence_parallel: Ulysses all-to-all attention, why Ulysses, the
gradient maths).

    setup_sequence_parallel(sp_size, model, role="policy")    once per process, after join_group and before
                                                              the model's layout is chosen; 1: off

Who sees what: data is split over DP groups (relayrl.distributed.group.my_data_share: rank // W of R / W
ranges), so a role's batch still goes to every rank; "concat" results keep the first rank of each SP group
(group.reports()). FSDP2 shards every model over ALL R ranks (the most memory saved; the SP group is not a
mesh dimension): FSDP averages the gradients over R, and relayrl.training.step divides its all-reduced counts
by W (each group counts its replicated loss W times), so the update is
    (1 / R) * sum over ranks g_r * R / C = sum over DP groups (sum over its W ranks g_r) / C
with C the step's true unit count: gradients summed inside an SP group (its ranks hold different tokens of
the same samples), averaged over the DP groups, exactly the 1-rank update on the same global batch.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from relayrl.distributed.group import in_group, rank, world
from relayrl.models import sequence_parallel
from relayrl.models.forward import hf_model

_groups: dict[tuple[int, int], list[Any]] = {}


def setup_sequence_parallel(sp_size: int, model: Any, role: str = "model") -> None:
    """Join this rank's SP group of `sp_size` consecutive ranks (every rank of the role calls it: creating
    the groups is collective) and check that the model's heads split over it. ValueError naming
    dist.sp_size when it does not divide the role's ranks or the heads."""
    if sp_size <= 1:
        sequence_parallel.set_group(None)
        return
    ranks = world()
    if not in_group() or ranks % sp_size:
        raise ValueError(
            f"dist.sp_size={sp_size} must divide the number of ranks of the {role} role ({ranks}; ray mode "
            "sizes it with *num_nodes x *num_gpus_per_node): pick a divisor or change the role's size"
        )
    cfg = hf_model(model).config
    heads = int(cfg.num_attention_heads)
    sequence_parallel.check_heads(heads, int(getattr(cfg, "num_key_value_heads", None) or heads), sp_size)
    key = (ranks, sp_size)
    if key not in _groups:  # every rank creates every group, in the same order (new_group is collective)
        _groups[key] = [dist.new_group(list(range(s, s + sp_size))) for s in range(0, ranks, sp_size)]
    me = rank()
    sequence_parallel.set_group(
        sequence_parallel.SPGroup(group=_groups[key][me // sp_size], size=sp_size, rank=me % sp_size)
    )
