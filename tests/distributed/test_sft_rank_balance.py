"""SFT on 2 gloo ranks with a token budget: each rank packs its own token-balanced share of the step
(relayrl.data.packing.make_collate with parts=2), and the run still equals one process per step.

Tolerance: dp_fixtures.assert_metrics_close (rtol 1e-4, atol 1e-5), the data-parallel tests' own: the ranks'
micro-batches now hold other samples than the one process's packs, so the same global sums (loss_sum, count,
gradients) are added in another order (fp32 rounding); a lost sample or a per-rank denominator moves the
loss by > 1e-2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dp_fixtures import (  # pyright: ignore[reportMissingImports]  (tests/helpers: pytest pythonpath)
    assert_metrics_close,
    run_sft,
)

pytestmark = pytest.mark.slow  # a 2-rank Ray run compared with one rank


def _uneven_rows(path: Path) -> Path:
    """32 rows of 1 to 16 words: samples of very different lengths, so how a step is split matters."""
    rows = [{"input": f"q{i} " * (1 + i % 4), "output": "ab " * (1 + (7 * i) % 13)} for i in range(32)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(300)
def test_sft_two_ranks_packed_per_rank_equal_one_rank(ray_cluster, tiny_model_path, tmp_path):
    data = _uneven_rows(tmp_path / "train.jsonl")
    packed = ("--train.packing", "true", "--train.max_tokens_per_micro_batch", "48")
    one = run_sft(tiny_model_path, data, tmp_path / "one", *packed, batch_size=8)
    two = run_sft(
        tiny_model_path,
        data,
        tmp_path / "two",
        *packed,
        "--dist.mode",
        "ray",
        "--dist.num_gpus_per_node",
        "2",
        batch_size=8,
    )
    train = [r for r in two if "train/loss" in r]
    assert len(train) == 4
    for a, b in zip(one, two, strict=True):
        assert_metrics_close(a, b, f"step {a['step']}")
    for r in train:  # both ranks worked, within one sample of each other (the longest is 56 tokens, 7 to 56)
        assert r["perf/rank_tokens_min"] > 0
        assert r["perf/rank_tokens_max"] - r["perf/rank_tokens_min"] <= 56, r
        assert r["perf/rank_tokens_max"] + r["perf/rank_tokens_min"] == pytest.approx(
            r["perf/tokens_per_s"] * r["perf/step_s"]
        )
        assert r["timing/pack_s"] >= 0
    assert all(r["perf/rank_tokens_min"] == r["perf/rank_tokens_max"] for r in one if "train/loss" in r)
