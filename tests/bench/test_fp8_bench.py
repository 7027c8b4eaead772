# pyright: reportMissingImports=false
# (bench/ is put on sys.path at run time, below)
"""bench/fp8_rollout.py and bench/fp8_check.py on the CPU: the smoke run (both engines, their summary lines),
the GEMM check's rows on small shapes (Triton's interpreter runs the quantiser) and the profile's kernel table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import fp8_check  # noqa: E402
import fp8_rollout  # noqa: E402

from relayrl.rollout import fp8_kernels  # noqa: E402


def test_cpu_smoke_run_writes_both_engines_and_prints_one_line_each(tmp_path, capsys):
    out = tmp_path / "f.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--prompts", "2", "--new-tokens", "4", "--rounds", "1",
            "--profile", "--phases", "1", "--out", str(out)]  # fmt: skip
    assert fp8_rollout.main(argv) == 0
    data = json.loads(out.read_text())
    bf16, fp8 = data["engines"]["bf16"], data["engines"]["fp8"]
    assert fp8["fp8_gemms"] == 8 and fp8["emulated"] and not fp8["quant_kernels"] and not fp8["fused"]
    assert fp8["gemm"] == {"qkv": "cublas", "o": "cublas", "gate_up": "cutlass", "down": "cublas"}
    assert (
        0 < fp8["mismatch"]["logprob_absdiff_mean"] < 0.05 and bf16["mismatch"]["logprob_absdiff_mean"] < 1e-5
    )
    for row in (bf16, fp8):  # --phases 1: one probed round each (3 decode steps), its in-round step reported
        (probed,) = row["phases"]["rounds"]
        assert probed["steps"] == 3 and row["decode_ms_per_step_inround"] == probed["decode_ms_per_step"] > 0
    assert data["speedup_decode_step_inround"] > 0
    printed = capsys.readouterr().out.splitlines()
    lines = [ln for ln in printed if ln.startswith("[bf16]") or ln.startswith("[fp8]")]
    assert len(lines) == 2 and all(
        "tok/s" in ln and "mismatch mean" in ln and "in-round" in ln for ln in lines
    )
    assert sum(ln.startswith("phases [") for ln in printed) == 4  # the split, the prefill comparison


@pytest.mark.skipif(not fp8_kernels.usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 and triton")
def test_fused_check_row_on_a_small_shape():
    row = fp8_check.fused_check(m=3, k=64, device="cpu")
    assert row["equal"] == 1.0 and row["norm_quant_us"] > 0 and row["rescale_norm_then_quant_us"] > 0


@pytest.mark.skipif(not fp8_kernels.usable(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 and triton")
def test_gemm_check_rows_on_small_shapes():
    rows = fp8_check.gemm_check(
        rows=(3,), device="cpu", gemms={"qkv": (48, 64, True), "down": (32, 80, False)}
    )
    assert [(r["gemm"], r["m"]) for r in rows] == [("qkv", 3), ("down", 3)]
    for r in rows:
        assert "error" not in r, r
        assert r["scale_equal"] or r["gemm"] == "down"  # bf16 silu in the interpreter may move a row's max
        assert r["err_bf16"] < 0.01 and 0.01 < r["err_fp8_fast"] < 0.08 and r["acc_fast"] < 0.01


def test_kernel_table_groups_kernels_by_category():
    class Evt:
        def __init__(self, key: str, us: float, count: int) -> None:
            self.key, self.self_device_time_total, self.count = key, us, count

    class Prof:
        def key_averages(self):
            return [Evt("_quantize_rows_kernel", 40.0, 8), Evt("void cutlass::device_kernel<GemmUniversal>", 400.0, 8),
                    Evt("_decode_attention_kernel", 60.0, 4), Evt("_rms_norm_kernel", 20.0, 8),
                    Evt("cudaLaunchKernel", 0.0, 30), Evt("sample_kernel", 10.0, 2),
                    Evt("_rms_norm_quant_kernel", 8.0, 4), Evt("_chunk_amax_kernel", 6.0, 4),
                    Evt("_rescale_kernel", 2.0, 2)]  # fmt: skip

    table = fp8_check.kernel_table(Prof(), steps=2)
    assert table["by_category"] == {
        "gemm": 200.0,
        "attention": 30.0,
        "quant": 23.0,
        "norm": 10.0,
        "other": 5.0,
        "norm+quant": 4.0,
        "rescale": 1.0,
    }
    assert table["total_us"] == 273.0 and table["top"][0][:2] == [
        "void cutlass::device_kernel<GemmUniversal>",
        200.0,
    ]
