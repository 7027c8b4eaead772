"""bench/tp_grpo.py and bench/tp_decode.py in their CPU smoke modes (torchrun, gloo): GRPO steps with TP native
engines colocated with an FSDP2 policy built on the meta device (TP 2 over 2 ranks, then TP 1: a whole replica
per rank), the engines holding exactly the trained weights after the last step (canary 0); the memory budget
refusing a configuration that cannot fit; the decode profile's kernel categories."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import tp_decode  # noqa: E402
from tp_decode import kernel_category  # noqa: E402
from tp_grpo import budget, param_counts, shape_of  # noqa: E402


def _torchrun(script: str, args: list[str], out: Path) -> None:
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "bench" / script), "--device", "cpu", *args]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_tp_grpo_cpu_smoke_steps_and_canary(tmp_path):
    _torchrun("tp_grpo.py", ["--shape", "tiny", "--tp", "2", "1", "--prompts", "4", "--samples", "4",
                             "--prompt-len", "8", "--new-tokens", "6", "--steps", "2"], tmp_path)  # fmt: skip
    rows = json.loads((tmp_path / "tp_grpo.json").read_text())["rows"]
    assert [(r["tp"], r["engines"], r["engine_weights"]) for r in rows] == [
        (2, 1, "tensor-parallel"),
        (1, 2, "gathered"),
    ]
    for r in rows:
        assert r["status"] == "ok" and r["canary"] == 0.0, r
        assert r["steps"][0]["stale_before_sync"] > 0  # the update moved the weights the engine then got
        assert [s["samples"] for s in r["steps"]] == [16, 16]  # every rank's trajectories, merged
        assert all(0 < s["gen_tokens"] <= 16 * 6 for s in r["steps"])  # 6 new tokens at most (or EOS)


@pytest.mark.slow
def test_tp_decode_cpu_smoke_rows_and_profile(tmp_path):
    _torchrun("tp_decode.py", ["--shape", "tiny", "--batch", "4", "--prompt-len", "8", "--new-tokens", "16",
                               "--no-unfused", "--rounds", "1", "--allreduce-impl", "nccl,custom", "--phases", "1"],
              tmp_path)  # fmt: skip
    result = json.loads((tmp_path / "tp_decode.json").read_text())
    rows = result["rows"]
    assert [(r["tp"], r["allreduce"], r["allreduce_used"]) for r in rows] == [
        (1, "none", "none"),
        (2, "nccl", "nccl"),
        (2, "custom", "nccl"),  # no symmetric memory on a CPU: the engine falls back (to gloo here)
    ]
    assert rows[2]["same_tokens_as_first_impl"] == 1.0 and rows[2]["tokens_sha"] == rows[1]["tokens_sha"]
    # --phases: one probed round of 15 steps; a TP 2 round's only traffic outside the steps is the header, the
    # requests and the stop, over gloo (bench/tp_phases.py; tests/rollout/test_native_tp_rounds.py)
    assert rows[0]["phases"]["summary"]["ranks"][0]["collectives_outside_graph_per_round"] == 0.0
    for row in rows[1:]:
        assert row["control"] == "cpu"
        for rank in row["phases"]["summary"]["ranks"]:
            assert rank["collectives_outside_graph_per_round"] == 3.0 and rank["syncs_per_round"] == 0.0
        assert row["phases"]["per_rank"][1]["rounds"][0]["collectives"]["control"] == {"broadcast@cpu": 3}
    assert result["profile"]["tp"] == 2 and result["profile"]["eager"]["wall_ms_per_step"] > 0
    assert result["profile_custom"]["allreduce"] == "custom" and result["stage"] == "done"


def test_budget_of_the_32b_shape():
    """Qwen2.5-32B's shape: 487,605,248 parameters a layer by hand (q/o 2 x 5120^2, q bias 5120, k/v 2 x (5120
    x 1024 + 1024), MLP 3 x 5120 x 27648, two norms 2 x 5120), 64 layers = 31.2B (the model card's "31.0B
    non-embedding") + 1.56B untied embedding and head = 32.8B; 16 bytes / parameter of fp32 trainer state
    over 4 ranks (122 GiB each) cannot fit an 80 GB card, and with CPU offload needs 488 GiB of host memory;
    16 of the 64 layers fit."""
    args = argparse.Namespace(shape="qwen2.5-32b", layers=0, offload=False, prompts=16, samples=8,
                              prompt_len=128, new_tokens=256)  # fmt: skip
    n = param_counts(shape_of(args))
    assert n["layer"] == 487_605_248 and n["vocab"] == 2 * 152064 * 5120
    full = budget(args, tp=4, world=4)
    assert round(full["params_b"], 1) == 32.8 and full["gpu_gib_per_gpu"] > 150
    offload = budget(argparse.Namespace(**{**vars(args), "offload": True}), tp=4, world=4)
    assert 480 < offload["host_gib_all_ranks"] < 495 and offload["gpu_gib_per_gpu"] < 40
    quarter = budget(argparse.Namespace(**{**vars(args), "layers": 16}), tp=4, world=4)
    assert quarter["gpu_gib_per_gpu"] < 60


def test_kernel_categories():
    assert kernel_category("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "all_reduce"
    )
    assert kernel_category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "gemm"
    assert kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert kernel_category("_decode_attention_kernel") == "attention"
    assert kernel_category("_rms_norm_kernel") == "norm_rope_silu"
    assert kernel_category("_rope_kv_kernel") == "norm_rope_silu"
    assert kernel_category("void at::native::vectorized_elementwise_kernel<4, exp>") == "other"


def test_tp_decode_floors_of_the_32b_shape_per_rank(monkeypatch):
    """The 32B row's floors: every decode GEMM's weights read once per step (2 bytes each) and 2 x params x batch
    FLOPs, split over the TP ranks; H200 data-sheet peaks (989 TFLOP/s, 4.8 TB/s) injected."""
    monkeypatch.setattr(tp_decode, "card_peaks", lambda device: {"tflops": 989.0, "tbs": 4.8})
    args = argparse.Namespace(shape="qwen2.5-32b", batch=256, prompt_len=128, new_tokens=256)
    one, four = (tp_decode.step_floors(args, tp, torch.device("cpu")) for tp in (1, 4))
    # decode GEMM parameters by hand: per layer q/o 2 x 5120^2, k/v 2 x 5120 x 1024, MLP 3 x 5120 x 27648; the head
    matmul = 64 * (2 * 5120**2 + 2 * 5120 * 1024 + 3 * 5120 * 27648) + 5120 * 152064
    assert one["compute_floor_ms"] == pytest.approx(2 * matmul * 256 / 989e12 * 1e3, rel=1e-12)
    # KV read: slots x mean context x (K, V) x layers x KV heads x d x 2 bytes
    kv = 256 * (128 + 128) * 2 * 64 * 8 * 128 * 2
    assert one["bandwidth_floor_ms"] == pytest.approx((2 * matmul + kv) / 4.8e12 * 1e3, rel=1e-12)
    assert four["floor_ms"] == pytest.approx(one["floor_ms"] / 4, rel=1e-12)
