"""The preference recipes data-parallel on a real local Ray cluster (gloo, 2 CPU ranks holding FSDP2 shards):
`--dist.mode ray --dist.num_gpus_per_node 2` gives the same per-step metrics and final weights as
`--dist.mode local` on the same global batch, for dpo (reference log-probs precomputed on the ranks, or
computed on the fly each step), rm (value head), kto (whose KL reference point z0 is all-reduced over the
ranks: each rank alone would see half the step's KL sequences and get another z0), kd (a sharded teacher)
and prm.

Each run: 2 optimizer steps of 4 pairs (one micro-batch of 2 per rank), eval at both steps. Tolerances:
losses rtol 1e-5; other metrics rel 1e-4 / abs 1e-5 (as test_data_parallel.py: the ranks sum in another
order, fp32 rounding ~1e-7 relative); final weights atol 1e-5 (lr 1e-4: AdamW moves a coordinate by at most
~lr per step, so a lost or doubled rank's gradient shows as ~1e-4, while rounding stays ~1e-7). Measured:
the final weights are bit-identical in all four cases (two ranks' partial gradients add in the same order
as one process's two micro-batches). Runtime 40-65 s, of which ~9 s start Ray (once, module-scoped).
"""

from __future__ import annotations

import math
from pathlib import Path

import preference_fixtures as pf
import pytest
from safetensors.torch import load_file

from relayrl.cli import main as cli_main
from relayrl.training.logging import read_jsonl

pytestmark = pytest.mark.slow  # preference recipes on Ray

VOLATILE = ("time", "perf/", "timing/")
LOSSES = ("train/loss", "eval/loss")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return pf.small_data(tmp_path_factory.mktemp("prefdata"))


def _run(command: str, model: Path, data_file: Path, out: Path, *extra: str) -> tuple[list[dict], dict]:
    argv = pf.cli_args(model, data_file, out, "--train.max_steps", "2", "--train.eval_every", "1",
                       "--optim.lr", "1e-4", "--dist.timeout_s", "120", *extra)  # fmt: skip
    assert cli_main([command, *argv]) == 0
    return read_jsonl(out / "metrics.jsonl"), load_file(out / "final" / "model.safetensors")


def _same_run(one: tuple[list[dict], dict], two: tuple[list[dict], dict], what: str) -> None:
    rows1, weights1 = one
    rows2, weights2 = two
    assert [r["step"] for r in rows1] == [r["step"] for r in rows2] == [1, 2], what
    for a, b in zip(rows1, rows2, strict=True):
        keys = {k for k in a if not k.startswith(VOLATILE)}
        assert keys == {k for k in b if not k.startswith(VOLATILE)}, what
        for k in sorted(keys):
            rel, abs_ = (1e-5, 0.0) if k in LOSSES else (1e-4, 1e-5)
            assert math.isclose(a[k], b[k], rel_tol=rel, abs_tol=abs_), (
                f"{what} step {a['step']} {k}: {a[k]} vs {b[k]}"
            )
    assert weights1.keys() == weights2.keys(), what  # tied copies (lm_head = embeddings) left out by both
    worst = max((weights1[k] - weights2[k]).abs().max().item() for k in weights1)
    assert worst < 1e-5, f"{what}: weights differ by {worst}"


RAY2 = ("--dist.mode", "ray", "--dist.num_gpus_per_node", "2")
CASES = {
    # name: (command, data file, extra flags, metrics that must be there)
    "dpo_precompute": ("dpo", "pairs", ("--dpo.ref_mode", "precompute"), ("train/margin", "eval/acc")),
    "dpo_on_the_fly": ("dpo", "pairs", ("--dpo.ref_mode", "on_the_fly"), ("train/margin", "eval/acc")),
    "rm": ("rm", "pairs", (), ("train/acc", "eval/margin")),
    "kto": ("kto", "unpaired", (), ("train/kl", "eval/reward_desirable")),
    # the teacher is sharded for inference on the ranks: its gathered LM head must outlive its reshard
    "kd": ("kd", "sft", ("--kd.teacher", "TEACHER"), ("train/kd", "eval/kd")),
    "prm": ("prm", "steps", ("--prm.placeholder", ";"), ("train/acc", "eval/p_good")),
}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from relayrl.models.tiny import TinyModelSpec, save_tiny

    return save_tiny(tmp_path_factory.mktemp("teacher") / "model", TinyModelSpec(seed=1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_equal_one_process(case, ray_cluster, data, tiny_model_path, teacher, tmp_path):
    command, kind, extra, expected = CASES[case]
    extra = tuple(str(teacher) if a == "TEACHER" else a for a in extra)
    local = _run(command, tiny_model_path, data[kind], tmp_path / "local", *extra)
    ray2 = _run(command, tiny_model_path, data[kind], tmp_path / "ray", *extra, *RAY2)
    assert all(k in local[0][-1] for k in expected), sorted(local[0][-1])
    base = load_file(Path(tiny_model_path) / "model.safetensors")
    moved = max((local[1][k] - base[k]).abs().max().item() for k in base if k in local[1])
    assert moved > 1e-5, "the two steps must move the weights, or equal weights prove nothing"
    _same_run(local, ray2, case)
    if command == "kto":  # z0 > 0 somewhere, else the all-reduce of the KL estimate is not exercised
        assert any(r["train/kl"] > 0 for r in local[0]), local[0]
