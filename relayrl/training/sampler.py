"""The resumable data order every trainer uses: which sample indices make each optimizer step."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ResumableSampler:
    """Endless, resumable stream of per-step index lists over `num_samples` items.

    Epoch e visits a permutation seeded by (seed, e) (or 0..n-1 when shuffle is off) in chunks of
    `batch_size`; a short tail is dropped (every step has the same number of samples). The state is
    {"epoch", "position"} plus the order's geometry (num_samples, batch_size, seed, shuffle), so a resumed run
    sees exactly the batches the uninterrupted run would have; `load_state_dict` refuses a state of another
    geometry (the data changed: positions would point at other samples) or an impossible / unexpected position
    (resuming would silently skip or repeat samples).
    """

    def __init__(self, num_samples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if num_samples < batch_size:
            raise ValueError(
                f"train.batch_size={batch_size} is larger than the dataset ({num_samples} samples): "
                "lower train.batch_size or add data"
            )
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0
        self._order: list[int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
                self._order = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                self._order = list(range(self.num_samples))
        return self._order

    def next_indices(self) -> list[int]:
        """The sample indices of the next optimizer step."""
        if self.position + self.batch_size > self.num_samples:
            self.epoch, self.position, self._order = self.epoch + 1, 0, None
        chunk = self._epoch_order()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return chunk

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.next_indices()

    @property
    def batches_drawn(self) -> int:
        """Batches drawn since the start (a function of epoch and position)."""
        return batches_drawn(self.state_dict())

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(
        self, state: dict[str, int], *, expect_batches: int | None = None, where: str = "the checkpoint"
    ) -> None:
        """Continue at `state`'s position. Raises ValueError naming `where` when the state was of another data
        order (a state without geometry, from an older relayrl, is taken as is), when its position is not one a
        sampler can reach, or when `expect_batches` (the batches the resumed loop drew: one per step for the
        one-model loop) differs from the position's."""
        mine = self.state_dict()
        changed = [
            f"{k} {state[k]} -> {mine[k]}" for k in GEOMETRY if k in state and int(state[k]) != mine[k]
        ]
        if changed:
            raise ValueError(
                f"resume: {where} continues a data order of another shape ({'; '.join(changed)}): the data "
                f"changed since it was saved, so its position would point at other samples (silently skipping or "
                f"repeating some). Restore the data it was trained on, or start a new run (another "
                f"--train.output_dir, or --ckpt.resume none)"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        bs, end = self.batch_size, self.steps_per_epoch * self.batch_size
        if epoch < 0 or position < 0 or position % bs or position > end:
            raise ValueError(
                f"resume: {where} holds an impossible data position (epoch {epoch}, position {position}; "
                f"positions are multiples of the batch size {bs} up to {end}): the checkpoint is corrupt; resume "
                f"from an earlier one (--ckpt.resume <folder>/step_<N>)"
            )
        self.epoch, self.position, self._order = epoch, position, None
        if expect_batches is not None and self.batches_drawn != expect_batches:
            raise ValueError(
                f"resume: {where} recorded {expect_batches} batch(es) drawn but its data position (epoch {epoch}, "
                f"position {position}) is {self.batches_drawn} batches in: resuming would "
                f"{'skip' if self.batches_drawn > expect_batches else 'repeat'} "
                f"{abs(self.batches_drawn - expect_batches)} batch(es). The checkpoint is inconsistent; resume "
                f"from an earlier one (--ckpt.resume <folder>/step_<N>)"
            )


GEOMETRY = ("num_samples", "batch_size", "seed", "shuffle")
"""The keys of a sampler state that fix the data order (a resumed run must have the same)."""


def batches_drawn(state: dict[str, int]) -> int:
    """Batches a sampler in `state` (a `state_dict()`) has drawn since the start."""
    per_epoch = state["num_samples"] // state["batch_size"]
    return state["epoch"] * per_epoch + state["position"] // state["batch_size"]
