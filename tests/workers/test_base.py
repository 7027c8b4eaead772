"""relayrl/workers/base.py: collation of trajectories into SequenceBatch, row selection, mini-batch splits.

- collate right-pads with the pad id; attention_mask marks exactly the real tokens; action_mask is the
  trajectory's (environment tokens stay masked) with column 0 forced off; rollout log-probs are copied to the
  token they belong to (the token alignment of the module doc); dtypes long / bool / bool / float32.
- collate refuses an empty batch and a trajectory whose per-token lists disagree in length.
- SequenceBatch.select / Experience.select keep the chosen rows in the given order, trimmed to their longest
  row; per-sequence tensors are indexed, per-token ones cut, None stays None.
- split_rows: contiguous, nearly equal, covering chunks; empty ones dropped.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from relayrl.agents.base import Trajectory
from relayrl.data.records import PromptSample
from relayrl.workers.base import Experience, SequenceBatch, collate, split_rows

PAD = 0


def _traj(index: int, token_ids: list[int], action: list[bool], lps: list[float] | None = None) -> Trajectory:
    lps = lps if lps is not None else [(-0.5 - 0.1 * i) if a else 0.0 for i, a in enumerate(action)]
    sample = PromptSample(index=index, prompt=f"p{index}", prompt_ids=token_ids[:2])
    return Trajectory(sample=sample, token_ids=token_ids, action_mask=action, rollout_logprobs=lps)


def test_collate_pads_masks_and_aligns():
    a = _traj(0, [5, 6, 7, 8], [False, False, True, True], [0.0, 0.0, -1.0, -2.0])
    # prompt, action, 2 environment tokens (masked), action again (multi-turn)
    b = _traj(
        1, [9, 10, 11, 12, 13, 14], [False, True, False, False, True, True], [0, -3.0, 0, 0, -4.0, -5.0]
    )
    c = _traj(2, [15, 16, 17], [False, False, True], [0.0, 0.0, -6.0])
    batch = collate([a, b, c], pad_id=PAD)

    assert batch.input_ids.dtype == torch.long
    assert batch.attention_mask.dtype == torch.bool and batch.action_mask.dtype == torch.bool
    assert batch.rollout_logprobs.dtype == torch.float32
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 8, PAD, PAD],
        [9, 10, 11, 12, 13, 14],
        [15, 16, 17, PAD, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [
        [True, True, True, True, False, False],
        [True] * 6,
        [True, True, True, False, False, False],
    ]
    assert batch.action_mask.tolist() == [
        [False, False, True, True, False, False],
        [False, True, False, False, True, True],  # the environment tokens 11, 12 are not actions
        [False, False, True, False, False, False],
    ]
    assert batch.rollout_logprobs.tolist() == [
        [0.0, 0.0, -1.0, -2.0, 0.0, 0.0],
        [0.0, -3.0, 0.0, 0.0, -4.0, -5.0],
        [0.0, 0.0, -6.0, 0.0, 0.0, 0.0],
    ]
    assert batch.lengths == [4, 6, 3]
    # padding is never an action, and an action always is a real token
    assert not (batch.action_mask & ~batch.attention_mask).any()


def test_collate_equals_a_per_row_loop():
    g = torch.Generator().manual_seed(0)
    trajs = []
    for i in range(40):  # random lengths 1..30, tokens, masks and float32-inexact log-probs
        n = int(torch.randint(1, 31, (1,), generator=g))
        act = (torch.rand(n, generator=g) > 0.4).tolist()
        lps = [
            -float(x) / 3 if a else 0.0 for x, a in zip(torch.rand(n, generator=g).tolist(), act, strict=True)
        ]
        trajs.append(_traj(i, torch.randint(1, 90, (n,), generator=g).tolist(), act, lps))
    batch = collate(trajs, pad_id=PAD)
    width = max(len(t.token_ids) for t in trajs)
    for i, t in enumerate(trajs):  # the reference: each row filled from its own lists
        n = len(t.token_ids)
        assert torch.equal(batch.input_ids[i], torch.tensor(t.token_ids + [PAD] * (width - n)))
        assert torch.equal(batch.attention_mask[i], torch.arange(width) < n)
        assert torch.equal(batch.action_mask[i, 1:n], torch.tensor(t.action_mask[1:]))
        assert not batch.action_mask[i, 0] and not batch.action_mask[i, n:].any()
        lp = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        assert torch.equal(batch.rollout_logprobs[i, :n], lp) and not batch.rollout_logprobs[i, n:].any()


def test_collate_rounds_log_probs_to_float32_like_torch_tensor():
    """collate reads the lists with np.fromiter; every float32 bit equals torch.tensor's rounding of the same
    Python floats (ties, subnormals, underflow, the largest float32 and what rounds past it, -0.0)."""
    edge = [
        1 / 3,
        -2 / 3,
        1 + 2**-24,
        1 + 3 * 2**-24,
        1e-40,
        -1e-46,
        3.4028234663852886e38,
        3.4028235e38,
        -0.0,
    ]
    lps = [0.0, *edge]
    batch = collate([_traj(0, list(range(1, len(lps) + 1)), [False] + [True] * len(edge), lps)], pad_id=PAD)
    want = torch.tensor(lps, dtype=torch.float32)
    assert torch.equal(batch.rollout_logprobs[0].view(torch.int32), want.view(torch.int32))


def test_collate_forces_column_zero_off_and_one_row():
    # a trajectory claiming its first token as an action: column 0 has no prefix, it never is one
    t = _traj(7, [3, 4, 5], [True, True, True], [-0.1, -0.2, -0.3])
    batch = collate([t], pad_id=99)
    assert batch.input_ids.tolist() == [[3, 4, 5]]
    assert batch.attention_mask.all()
    assert batch.action_mask.tolist() == [[False, True, True]]
    # the log-prob stays where the trajectory put it (token alignment: position t holds token t's)
    torch.testing.assert_close(batch.rollout_logprobs, torch.tensor([[-0.1, -0.2, -0.3]]))
    assert t.action_mask == [True, True, True]  # the trajectory itself is not changed


def test_collate_refuses_empty_and_ragged():
    with pytest.raises(ValueError, match="no trajectories"):
        collate([], pad_id=PAD)
    bad = _traj(3, [1, 2, 3], [False, True, True], [0.0, -1.0])
    with pytest.raises(ValueError, match="sample 3"):
        collate([_traj(0, [1, 2], [False, True]), bad], pad_id=PAD)
    bad_mask = _traj(4, [1, 2, 3], [False, True], [0.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="action_mask"):
        collate([bad_mask], pad_id=PAD)


def _batch() -> SequenceBatch:
    trajs = [
        _traj(0, [5, 6, 7, 8, 9], [False, False, True, True, True]),
        _traj(1, [5, 6, 7], [False, False, True]),
        _traj(2, [5, 6, 7, 8], [False, True, False, True]),
    ]
    return collate(trajs, pad_id=PAD)


def test_sequence_batch_select_orders_and_trims():
    batch = _batch()
    sub = batch.select([2, 1])
    assert sub.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 7, PAD]]  # width 4: the longest selected row
    assert sub.lengths == [4, 3]
    assert sub.action_mask.tolist() == [[False, True, False, True], [False, False, True, False]]
    torch.testing.assert_close(sub.rollout_logprobs, batch.rollout_logprobs[[2, 1], :4])
    same = batch.select(torch.tensor([0, 1, 2]))
    for name in ("input_ids", "attention_mask", "action_mask", "rollout_logprobs"):
        assert torch.equal(getattr(same, name), getattr(batch, name))
    empty = batch.select([])
    assert empty.input_ids.shape == (0, 0)


def test_experience_select_cuts_per_token_and_indexes_per_sequence():
    batch = _batch()
    b, t = batch.input_ids.shape
    adv = torch.arange(b * t, dtype=torch.float32).reshape(b, t)
    exp = Experience(
        tokens=batch,
        advantages=adv,
        rewards=torch.tensor([1.0, 2.0, 3.0]),
        values=adv + 100,
        returns=adv - 100,
    )
    sub = exp.select([1, 2])
    assert sub.tokens.input_ids.shape == (2, 4)
    torch.testing.assert_close(sub.advantages, adv[[1, 2], :4])
    torch.testing.assert_close(sub.values, adv[[1, 2], :4] + 100)
    torch.testing.assert_close(sub.returns, adv[[1, 2], :4] - 100)
    torch.testing.assert_close(sub.rewards, torch.tensor([2.0, 3.0]))
    assert sub.old_logprobs is None and sub.ref_logprobs is None


def test_records_survive_pickling():
    """They cross a Ray actor boundary by pickling."""
    batch = _batch()
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, SequenceBatch)
    for name in ("input_ids", "attention_mask", "action_mask", "rollout_logprobs"):
        assert torch.equal(getattr(back, name), getattr(batch, name))


@pytest.mark.parametrize(
    ("rows", "parts", "want"),
    [
        (5, 2, [[0, 1, 2], [3, 4]]),
        (6, 3, [[0, 1], [2, 3], [4, 5]]),
        (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),
        (3, 5, [[0], [1], [2]]),  # more parts than rows: one row each, no empty chunk
        (4, 1, [[0, 1, 2, 3]]),
        (4, 0, [[0, 1, 2, 3]]),  # parts < 1 counts as one
        (0, 3, []),
        (1, 1, [[0]]),
    ],
)
def test_split_rows(rows, parts, want):
    got = split_rows(rows, parts)
    assert got == want
    assert [r for chunk in got for r in chunk] == list(range(rows))
    if got:
        sizes = [len(c) for c in got]
        assert max(sizes) - min(sizes) <= 1
