"""dist.replicate end to end on a real local Ray cluster (gloo, 2 CPU ranks): policy, reference and critic each
hold the whole model on every rank, the engines generate from the ranks' own weights, and the run equals the
one-rank run step by step, exactly on-policy under rollout.exact (which a sharded policy refuses); its
checkpoints are the one-rank format written once (plus every rank's RNG) and resume on one rank, continuing
exactly.

Tolerance: as tests/distributed/test_data_parallel.py (rtol 1e-4, atol 1e-5: the ranks sum the same gradients
in another order); a gradient left unsummed, or a rank's share lost, moves the loss by > 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dp_fixtures import assert_metrics_close as _close
from dp_fixtures import one_and_two_ranks, rl_cfg

from relayrl.config.base import ConfigError
from relayrl.config.dist import DistConfig
from relayrl.trainers.rl.loop import run_rl


def _cfg(model: Path, out: Path, ranks: int, **ckpt):
    return rl_cfg(model, out, ranks, replicate=ranks > 1, exact=True, **ckpt)


@pytest.mark.slow  # a 2-rank Ray run beside a 1-rank one
@pytest.mark.timeout(400)
def test_rl_on_two_replicated_ranks_equals_one_rank_and_its_checkpoint_resumes(
    ray_cluster, tiny_model_path, tmp_path
):
    one, two, info, canaries = one_and_two_ranks(
        _cfg(tiny_model_path, tmp_path / "one", 1), _cfg(tiny_model_path, tmp_path / "two", 2)
    )
    assert one.exit_code == two.exit_code == 0, two.message
    # each rank's engine generates from that rank's own trained module: nothing is gathered or copied
    assert info["ranks"] == 2 and info["engine_weights"] == "shared"
    assert canaries == [0.0, 0.0]
    assert len(one.history) == len(two.history) == 2
    for i, (a, b) in enumerate(zip(one.history, two.history, strict=True)):
        _close(a, b, f"step {i + 1}")
    for h in two.history:  # rollout.exact on replicated ranks: each engine's log-probs are its trainer's
        assert h["train/logprob_diff"] == 0.0 and h["train/ratio_mean"] == 1.0, h
    assert two.history[1]["timing/engine_refresh"] < 0.05  # nothing to gather (a sharded run: ~0.1-1 s here)
    ckpt = tmp_path / "two/checkpoints/step_1"
    for role in ("policy", "critic"):
        assert (ckpt / role / "model.safetensors").is_file(), role  # the one-rank format, from rank 0
        assert not (ckpt / role / "dcp").exists(), role
        assert (ckpt / role / "rng/rank_0.pt").is_file() and (ckpt / role / "rng/rank_1.pt").is_file(), role
    assert (tmp_path / "two/final/model.safetensors").is_file()

    resumed = run_rl(_cfg(tiny_model_path, tmp_path / "r21", 1, resume=str(ckpt)))
    assert resumed.exit_code == 0, resumed.message
    assert resumed.steps == 2 and len(resumed.history) == 1
    _close(one.history[1], resumed.history[0], "resumed 2 (replicated) -> 1")


@pytest.mark.parametrize(
    "field, value",
    [("offload", True), ("sp_size", 2), ("engine_tp", 2), ("num_engines", 1)],
)
def test_replicate_refuses_what_needs_shards(field, value):
    with pytest.raises(ConfigError, match=f"dist.replicate: not with dist.{field}"):
        DistConfig(mode="ray", replicate=True, **{field: value})
