"""bench/rollout.py on the CPU (its smoke mode) and its arithmetic: the floors and the profile's category table."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import rollout  # noqa: E402
from rollout_engines import param_counts, shape_config, w3_lengths  # noqa: E402
from rollout_profile import card_peaks, category, floors_ms, summarize_cuda_trace  # noqa: E402


def test_cpu_smoke_run_times_every_workload_after_a_warm_up(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--shapes", "tiny", "--device", "cpu", "--engines", "native", "--rounds", "2", "--prompts", "4",
            "--new-tokens", "6", "--n-prompts", "2", "--n", "3", "--n-new-tokens", "5", "--w3-prompts", "5",
            "--w3-max-new", "12", "--out", str(out)]  # fmt: skip
    assert rollout.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["workload"] for r in rows] == ["w1", "w2", "w3"]
    for r in rows:
        assert len(r["seconds"]) == 2 and r["tok_s_min"] <= r["tok_s_median"] <= r["tok_s_max"]
        assert r["warmup_s"] > 0 and r["prefill_s"] > 0
    assert rows[0]["tokens"] == 4 * 6 and rows[1]["tokens"] == 2 * 3 * 5
    assert rows[2]["tokens"] == sum(w3_lengths(5, 12))
    # the native engine reports its own step count: w1 runs 6 - 1 decode steps after the prefill
    assert rows[0]["engine_counters"]["decode_steps"] == 5


def test_w3_lengths_are_fixed_by_the_seed_and_vary():
    a, b = w3_lengths(512, 512), w3_lengths(512, 512)
    assert a == b and min(a) >= 16 and max(a) == 512
    assert 150 < sum(a) / len(a) < 210 and len(set(a)) > 100


def test_floors_by_hand_for_the_7b_shape_on_an_h200():
    config = shape_config("7b")
    counts = param_counts(config)
    # q, o: 3584 x 3584; k, v: 3584 x 512; MLP 3 x 3584 x 18944; 28 layers; LM head 3584 x 152064
    per_layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944
    assert counts["matmul"] == 28 * per_layer + 3584 * 152064
    peaks = dict(tflops=989.0, tbs=4.8)
    f = floors_ms(config, counts, peaks, batch=256, ctx=256.0)
    assert f["compute_floor_ms"] == pytest.approx(2 * counts["matmul"] * 256 / 989e12 * 1e3, rel=1e-12)
    kv = 256 * 256 * 2 * 28 * 4 * 128 * 2
    assert f["bandwidth_floor_ms"] == pytest.approx((counts["matmul"] * 2 + kv) / 4.8e12 * 1e3, rel=1e-12)
    assert f["floor_ms"] == max(f["compute_floor_ms"], f["bandwidth_floor_ms"])
    assert floors_ms(config, counts, dict(tflops=None, tbs=None), batch=1, ctx=1.0) == {}


def test_peaks_come_from_the_flags_off_cuda():
    p = card_peaks("cpu", 100.0, 2.0)
    assert (p["tflops"], p["tbs"]) == (100.0, 2.0)


def test_profile_table_splits_the_decode_window_into_categories_and_gaps():
    """Two graph replays (correlation 1, 2) with kernels at [0, 4) and [6, 9) us, an eager memcpy at [8, 9)
    (overlapping a kernel) and a prefill kernel after the window: window 9 us, busy 7 us, gaps 2 us."""
    ev = [
        dict(cat="cuda_runtime", name="cudaGraphLaunch", args=dict(correlation=1)),
        dict(cat="cuda_runtime", name="cudaGraphLaunch", args=dict(correlation=2)),
        dict(cat="kernel", name="nvjet_tst_128x64_gemm", ts=0.0, dur=3.0, args=dict(correlation=1)),
        dict(cat="kernel", name="fmha_cutlassF_bf16", ts=3.0, dur=1.0, args=dict(correlation=1)),
        dict(
            cat="kernel",
            name="cunn_SoftMaxForward<LogSoftMaxForwardEpilogue>",
            ts=6.0,
            dur=1.0,
            args=dict(correlation=2),
        ),
        dict(cat="kernel", name="vectorized_elementwise_kernel", ts=7.0, dur=2.0, args=dict(correlation=2)),
        dict(cat="gpu_memcpy", name="Memcpy DtoH", ts=8.0, dur=1.0, args=dict(correlation=9)),
        dict(cat="kernel", name="flash_fwd_prefill", ts=20.0, dur=5.0, args=dict(correlation=7)),  # outside
    ]
    t = summarize_cuda_trace(ev, steps=2)
    cats = {c: v["ms_per_step"] * 1e3 * 2 for c, v in t["categories"].items()}  # back to us over the window
    assert t["window_ms"] == pytest.approx(9e-3) and t["cuda_graphs"]
    assert cats["matmul"] == pytest.approx(3.0) and cats["attention"] == pytest.approx(1.0)
    assert cats["sampling"] == pytest.approx(1.0) and cats["norm+elementwise"] == pytest.approx(2.0)
    assert cats["memcpy"] == pytest.approx(1.0)
    assert cats["idle/launch gaps"] == pytest.approx(2.0)  # [4, 6): nothing ran
    assert sum(v["percent"] for k, v in t["categories"].items() if k != "memcpy") == pytest.approx(100.0)


def test_category_names():
    assert category("aten::addmm") == "matmul" and category("sm90_xmma_gemm_bf16") == "matmul"
    assert category("aten::_log_softmax") == "sampling" and category("aten::_softmax") == "attention"
    assert category("Memcpy HtoD", "gpu_memcpy") == "memcpy"


class _FakeLLM:
    """Stands in for vllm.LLM: records its arguments; `generate` returns each request's max_tokens tokens."""

    made: list[dict] = []

    def __init__(self, model: str, **kwargs):
        from types import SimpleNamespace as NS

        _FakeLLM.made.append(dict(model=model, **kwargs))
        self.llm_engine = NS(
            vllm_config=NS(
                scheduler_config=NS(
                    max_num_seqs=kwargs.get("max_num_seqs", 1024), max_num_batched_tokens=8192
                ),
                cache_config=NS(enable_prefix_caching=True, gpu_memory_utilization=0.9),
                model_config=NS(max_model_len=kwargs.get("max_model_len", 32768), enforce_eager=False),
                compilation_config=NS(cudagraph_mode="FULL_AND_PIECEWISE"),
            )
        )

    def generate(self, prompts, params, use_tqdm=False):
        from types import SimpleNamespace as NS

        outs = []
        for p, sp in zip(prompts, params, strict=True):
            toks = [(p["prompt_token_ids"][0] + i) % 7 for i in range(sp.max_tokens)]
            lps = [{t: NS(logprob=-1.0)} for t in toks] if sp.logprobs is not None else None
            outs.append(NS(outputs=[NS(token_ids=toks, logprobs=lps) for _ in range(sp.n)]))
        return outs


@pytest.fixture()
def fake_vllm(monkeypatch):
    import importlib.machinery
    import types

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.LLM = _FakeLLM
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the bench sets it unless given
    _FakeLLM.made = []
    return _FakeLLM


def test_vllm_default_sets_nothing_and_tuned_covers_the_batch(tmp_path, fake_vllm):
    out = tmp_path / "r.json"
    argv = ["--shapes", "tiny", "--device", "cpu", "--engines", "vllm-default,vllm-tuned", "--rounds", "3",
            "--prompts", "4", "--new-tokens", "6", "--n-prompts", "3", "--n", "4", "--n-new-tokens", "5",
            "--w3-prompts", "5", "--w3-max-new", "9", "--out", str(out)]  # fmt: skip
    assert rollout.main(argv) == 0
    default, tuned = fake_vllm.made
    assert set(default) == {"model", "dtype", "skip_tokenizer_init", "seed", "load_format"}
    assert default["load_format"] == "dummy"  # the folder holds only the shape's config
    assert tuned["max_num_seqs"] == 12 >= 3 * 4  # the largest batch: w2's 3 prompts x 4 samples
    assert tuned["compilation_config"]["cudagraph_capture_sizes"][-1] == 12
    assert tuned["max_model_len"] == 128 + 9 and tuned["max_num_batched_tokens"] == 32768
    assert tuned["gpu_memory_utilization"] == 0.92 and tuned["enable_prefix_caching"] is True
    rows = json.loads(out.read_text())["rows"]
    assert [(r["engine"], r["workload"]) for r in rows] == [
        (e, w) for e in ("vllm-default", "vllm-tuned") for w in ("w1", "w2", "w3")
    ]
    assert all(len(r["seconds"]) == 3 and r["tokens"] > 0 for r in rows)
