"""Driver-to-rank transfer on Ray (relayrl.distributed.launch.rows): a record stored row by row gives back
exactly what its own `select` gives (bitwise), only the rows asked for are fetched, the batch is reused inside
the experience; and one RL step on Ray (2 policy ranks, reference, critic) makes the driver serialise about
one experience's worth of bytes for the log-prob / value passes and the updates together.

Before the row store, `RayRole.submit` put each call's whole argument: the batch for each of the three passes
and the experience for each of the two updates (~3.4x the experience's bytes here; every rank then read all
of it). The bound below (1.3x: the rows' raw bytes plus Ray's per-object overhead, ~15% at these tiny rows of
~80 tokens) fails on that code.
"""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from relayrl.distributed.launch.rows import FETCH, RowStore
from relayrl.workers.base import Experience, SequenceBatch, my_update_parts

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from transfer import build_cfg, measure

pytestmark = pytest.mark.slow  # a Ray cluster


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _experience(rows: int = 7, width: int = 12) -> Experience:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, width + 1, (rows,), generator=g)
    attn = torch.arange(width)[None, :] < lengths[:, None]
    batch = SequenceBatch(
        input_ids=torch.randint(0, 50, (rows, width), generator=g) * attn,
        attention_mask=attn,
        action_mask=attn & (torch.rand(rows, width, generator=g) > 0.3),
        rollout_logprobs=-torch.rand(rows, width, generator=g) * attn,
    )
    return Experience(
        tokens=batch,
        advantages=torch.randn(rows, width, generator=g),
        rewards=torch.randn(rows, generator=g),
        ref_logprobs=-torch.rand(rows, width, generator=g),
    )


def _assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), f.name
        elif x is None:
            assert y is None, f.name
        else:
            _assert_same(x, y)


def test_stored_rows_select_exactly_the_record_s_rows(ray_cluster):
    exp = _experience()
    store = RowStore()
    batch_rows = store.put(exp.tokens)
    rows = store.put(exp)
    assert rows.nested["tokens"] is batch_rows and store.put(exp) is rows  # each record is put once
    assert rows.lengths == exp.lengths and rows.width == exp.width
    for pick in ([0], [2, 3, 4], [6, 1], list(range(7))):
        _assert_same(rows.select(pick), exp.select(pick))
        _assert_same(batch_rows.select(pick), exp.tokens.select(pick))
    before = FETCH["rows"]
    parts = my_update_parts(rows, 2)  # one rank: every row, fetched once for both mini-batches
    assert FETCH["rows"] - before == 7
    _assert_same(parts[0][0], exp.select([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="no rows"):
        rows.select([])


@pytest.mark.timeout(400)
def test_one_rl_step_serialises_the_experience_about_once(ray_cluster, tiny_model_path, tmp_path):
    cfg = build_cfg(tiny_model_path, tmp_path / "run", ranks=2, new_tokens=64)
    got = measure(cfg)
    assert got["driver_bytes_per_experience_byte"] < 1.3, got
