"""ResumableSampler: the data order of every trainer (which sample indices make each optimizer step)."""

from __future__ import annotations

import itertools

import pytest
import torch

from relayrl.training.sampler import ResumableSampler


def _perm(seed: int, epoch: int, n: int) -> list[int]:
    """The documented order of epoch `epoch`: a permutation seeded by seed * 100_003 + epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def test_without_shuffle_steps_walk_the_data_in_order_and_drop_the_short_tail():
    s = ResumableSampler(7, 3, shuffle=False)
    assert s.steps_per_epoch == 2
    steps = [s.next_indices() for _ in range(5)]
    # 7 // 3 = 2 steps an epoch; sample 6 (the tail of 1) is never visited
    assert steps == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5], [0, 1, 2]]
    assert s.state_dict() == {
        "epoch": 2,
        "position": 3,
        "num_samples": 7,
        "batch_size": 3,
        "seed": 0,
        "shuffle": 0,
    }
    assert s.batches_drawn == 5


def test_each_epoch_is_the_permutation_seeded_by_seed_and_epoch():
    s = ResumableSampler(9, 3, seed=5)
    epochs = [list(itertools.chain(*(s.next_indices() for _ in range(3)))) for _ in range(3)]
    assert epochs == [_perm(5, e, 9) for e in range(3)]
    assert epochs[0] != epochs[1]  # a new order every epoch
    assert ResumableSampler(9, 3, seed=6).next_indices() != epochs[0][:3]  # and per seed


def test_a_sampler_loaded_mid_epoch_continues_exactly_like_the_uninterrupted_one():
    full = ResumableSampler(10, 3, seed=1)
    reference = [full.next_indices() for _ in range(8)]
    first = ResumableSampler(10, 3, seed=1)
    for _ in range(4):
        first.next_indices()
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)  # 3 steps in epoch 0, 1 in epoch 1
    resumed = ResumableSampler(10, 3, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.next_indices() for _ in range(4)] == reference[4:]


def test_iteration_is_endless_and_shares_the_state_with_next_indices():
    s = ResumableSampler(4, 2, shuffle=False)
    it = iter(s)
    assert [next(it) for _ in range(3)] == [[0, 1], [2, 3], [0, 1]]
    assert s.next_indices() == [2, 3]


def test_a_batch_larger_than_the_dataset_names_the_setting():
    ResumableSampler(4, 4)  # exactly one step an epoch is fine
    with pytest.raises(ValueError, match=r"train\.batch_size=5 is larger than the dataset \(4 samples\)"):
        ResumableSampler(4, 5)


def test_a_state_of_another_data_order_is_refused_naming_what_changed():
    s = ResumableSampler(10, 2, seed=1)
    for _ in range(3):
        s.next_indices()
    state = s.state_dict()
    with pytest.raises(
        ValueError, match=r"resume: step_3 continues a data order of another shape \(num_samples 10 -> 12\)"
    ):
        ResumableSampler(12, 2, seed=1).load_state_dict(state, where="step_3")  # rows added to the data
    with pytest.raises(ValueError, match=r"seed 1 -> 2"):
        ResumableSampler(10, 2, seed=2).load_state_dict(state)
    old = {"epoch": 0, "position": 6}  # a state from before the geometry was saved: taken as is
    resumed = ResumableSampler(10, 2, seed=1)
    resumed.load_state_dict(old, expect_batches=3)
    assert resumed.next_indices() == s.next_indices()


@pytest.mark.parametrize(
    ("epoch", "position", "expect", "match"),
    [
        (
            0,
            5,
            None,
            r"impossible data position \(epoch 0, position 5; positions are multiples of the batch size 2 up to 10\)",
        ),
        (0, 12, None, r"impossible data position"),
        (-1, 0, None, r"impossible data position"),
        (
            0,
            8,
            3,
            r"recorded 3 batch\(es\) drawn but its data position \(epoch 0, position 8\) is 4 batches in: resuming would skip 1",
        ),
        (0, 2, 3, r"resuming would repeat 2 batch\(es\)"),
    ],
)
def test_a_tampered_position_is_caught(epoch, position, expect, match):
    s = ResumableSampler(10, 2, seed=1)
    state = {**s.state_dict(), "epoch": epoch, "position": position}
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(state, expect_batches=expect)
