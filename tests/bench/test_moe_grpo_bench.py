"""bench/moe_grpo.py: its CPU smoke mode (torchrun, gloo, 2 ranks: FSDP2 policy over a tiny Qwen3-MoE, native
engines colocated, routing replay off and on) and its memory estimate at the Qwen3-30B-A3B widths."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
def test_moe_grpo_cpu_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "bench" / "moe_grpo.py"), "--device", "cpu", "--shape", "tiny", "--layers", "2",
           "--prompts", "4", "--samples", "2", "--new-tokens", "8", "--steps", "1"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads((tmp_path / "moe_grpo.json").read_text())
    assert r["status"] == "ok" and r["canary"] == 0.0 and r["engine"]["weights"] == "gathered"
    # FSDP2 shards the 3-D expert tensors along the expert dimension: 4 of the 8 experts per rank
    for t in r["expert_sharding"].values():
        assert t["placement"] == "(Shard(dim=0),)" and t["local_shape"][0] * 2 == t["global_shape"][0] == 8
    assert [s["mode"] for s in r["steps"]] == ["off", "on", "off"]
    assert r["steps"][0]["stale_before_sync"] > 0  # the update moved the weights the engine then got
    for s in r["steps"]:
        assert s["samples"] == 8 and s["route_pairs"] > 0
        assert s["mismatch/logprob_absdiff_mean"] < 1e-4  # fp32 on both sides (CPU)
    on = r["steps"][1]
    assert on["route_flip_share"] == 0.0 and on["router_disagreement"] is not None


def test_budget_of_the_30b_a3b_shape(tiny_tokenizer):
    """Qwen3-30B-A3B's widths: 623.1M parameters a layer (attention 18.9M, 128 experts x 3 x 2048 x 768 =
    604.0M, router 0.26M), 2 x 151936 x 2048 embedding + head; 48 layers = 30.5B (the model card's 30.5B). On
    2 ranks (16 bytes / parameter of trainer state over 2, a 2-byte engine replica per rank) the whole depth
    needs ~297 GiB a GPU; 16 layers (10.6B) ~111 GiB, which fits an H200 (139 GiB), not an H100."""
    from moe_grpo import budget

    args = argparse.Namespace(shape="qwen3-30b-a3b", prompts=32, samples=4, prompt_len=8, new_tokens=128)
    full = budget(args, 48, tiny_tokenizer, 2)
    assert round(full["params_b"], 1) == 30.5 and full["gpu_gib_per_gpu"] > 290
    part = budget(args, 16, tiny_tokenizer, 2)
    assert round(part["params_b"], 2) == 10.59 and 100 < part["gpu_gib_per_gpu"] < 120
    assert round(part["trainer_states_gib_per_rank"], 1) == round(8 * 10.59e9 / 2**30, 1)
