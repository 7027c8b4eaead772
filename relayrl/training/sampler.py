"""The resumable data order every trainer uses: which sample indices make each optimizer step."""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ResumableSampler:
    """Endless, resumable stream of per-step index lists over `num_samples` items.

    Epoch e visits a permutation seeded by (seed, e) (or 0..n-1 when shuffle is off) in chunks of
    `batch_size`; a short tail is dropped (every step has the same number of samples). The state is just
    {"epoch", "position"}, so a resumed run sees exactly the batches the uninterrupted run would have.
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

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
