"""The per-rank profile (relayrl.distributed.launch.profile): a hand-made torch.profiler trace split into
forward / backward / optimizer kernel time and the exposed part of each collective, and the per-call JSON
lines a rank writes when RELAYRL_PROFILE_DIR is set (nothing when it is not)."""

from __future__ import annotations

import json

import pytest

from relayrl.distributed.launch.profile import PROFILE_ENV, kernel_breakdown, profiled


def _kernel(name: str, ts: float, dur: float, corr: int | None = None) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(tid: int, ts: float, corr: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": tid, "ts": ts, "dur": 1,
            "args": {"correlation": corr}}  # fmt: skip


def test_kernels_are_split_by_launching_thread_and_optimizer_range_and_exposure():
    trace = {
        "traceEvents": [
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "autograd::engine::evaluate_function: MmBackward0",
                "tid": 2,
                "ts": 9,
                "dur": 20,
            },
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "Optimizer.step#AdamW.step",
                "tid": 1,
                "ts": 40,
                "dur": 6,
            },
            _launch(1, 0, 1),
            _launch(2, 10, 2),
            _launch(1, 41, 3),
            _kernel("ampere_sgemm_fwd", 0, 10, 1),  # forward: main thread, outside Optimizer.step
            _kernel("ampere_sgemm_bwd", 10, 20, 2),  # backward: launched by the autograd thread
            _kernel("multi_tensor_apply_adam", 40, 5, 3),  # optimizer
            _kernel("ncclDevKernel_AllGather_RING_LL", 5, 10),  # hidden under forward / backward
            _kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 28, 10),  # 8 us after compute ends
        ]
    }
    got = kernel_breakdown(trace)
    want = {
        "forward_s": 10e-6, "backward_s": 20e-6, "optimizer_s": 5e-6, "all_gather_s": 10e-6,
        "all_gather_exposed_s": 0.0, "reduce_scatter_s": 10e-6, "reduce_scatter_exposed_s": 8e-6,
        "all_reduce_s": 0.0, "all_reduce_exposed_s": 0.0, "gpu_busy_s": 43e-6, "gpu_span_s": 45e-6,
    }  # fmt: skip
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k


def test_profiled_calls_write_one_line_each_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    assert profiled("policy", 0, "rollout", lambda: 7) == 7
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path))
    for _ in range(2):
        assert profiled("critic", 1, "values", lambda: "v") == "v"
    lines = [json.loads(x) for x in (tmp_path / "critic_rank1.jsonl").read_text().splitlines()]
    assert [(x["method"], x["call"], x["rank"]) for x in lines] == [("values", 1, 1), ("values", 2, 1)]
    assert all(x["wall_s"] >= 0 and x["transfer_s"] == 0 for x in lines)
