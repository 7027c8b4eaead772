# pyright: reportMissingImports=false
# (bench/ is put on sys.path at run time, below)
"""bench/decode_phases.py on the CPU: the probe's round decomposition on a real engine round (its counts, its
identity, the engine's samples unchanged and its methods restored), and the nvidia-smi summary parser."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import decode_phases  # noqa: E402

from relayrl.rollout import GenerationRequest, SamplingParams, build_engine, generate_all  # noqa: E402
from relayrl.rollout.native import NativeEngine  # noqa: E402


def _requests(new: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            prompt_ids=[3 + i, 5, 7, 9 + i],
            params=SamplingParams(n=1, temperature=1.0, max_new_tokens=new, seed=i),
        )
        for i in range(6)
    ]


def test_probe_splits_a_round_into_its_steps_and_leaves_the_engine_as_it_was(tiny_model, tiny_tokenizer):
    engine = build_engine(
        "native", tiny_model.eval(), tiny_tokenizer, max_slots=8, max_seq_len=64, eos_token_id=[], driver="loop",
        prefix_cache=False, sync_every=4,
    )  # fmt: skip
    assert isinstance(engine, NativeEngine)
    try:
        plain = generate_all(engine, _requests(11))
        rep, probed = decode_phases.run_probed(engine, lambda: generate_all(engine, _requests(11)))
        # 11 tokens: 1 from the prefill + 10 decode steps, synced every 4 steps -> retires after 4, 8, 10
        assert rep["steps"] == 10 and rep["syncs"] == 3 and rep["prefills"] == 1
        assert sum(rep["steps_by_kv"].values()) == 10 and set(rep["steps_by_kv"]) == {"16"}  # 4 + 11 < 16
        # in-round step = replay + gaps (on a CPU the host stamps are the timeline: an identity, to rounding)
        parts = rep["replay_ms_per_step"] + rep["gap_in_batch_ms_per_step"] + rep["gap_at_sync_ms_per_step"]
        assert abs(rep["decode_ms_per_step"] - parts) <= 3e-4
        assert rep["decode_ms_per_step"] > 0 and rep["prefill_ms"] > 0 and rep["tail_ms"] >= 0
        assert rep["head_ms"] + rep["prefill_ms"] + 10 * rep["decode_ms_per_step"] + rep["tail_ms"] <= (
            rep["wall_ms"] + 1e-3
        )
        host = rep["host_ms"]
        assert host["retire_wait"] == 0.0 and host["enqueue"] > 0 and host["admit"] > 0
        # the probe wraps the instance only, and only while it is open; samples are unchanged by it
        assert not {"_admit", "_decode_once", "_retire"} & set(vars(engine))
        assert [c.token_ids for r in probed for c in r.completions] == [  # pyright: ignore[reportAttributeAccessIssue]
            c.token_ids for r in plain for c in r.completions
        ]
    finally:
        engine.close()


def test_clock_summary_keeps_this_gpus_rows_and_reports_ranges():
    out = "\n".join(
        [
            "GPU-a, 1980, 650.5, 60, 0x0000000000000000",
            "GPU-b, 1500, 300.0, 40, 0x0000000000000004",
            "GPU-a, 1755, 700.1, 66, 0x0000000000000004",
            "GPU-a, 1830, 690.0, 64, 0x0000000000000004",
            "garbage line",
            "GPU-c, 1400, [N/A], 50, [N/A]",
        ]
    )
    got = decode_phases.summarize_clocks(out, "GPU-a")
    assert got["samples"] == 3 and got["matched"] and got["gpus"] == ["GPU-a"]
    assert got["sm_mhz_min_med_max"] == [1755.0, 1830.0, 1980.0]
    assert got["power_w_min_med_max"] == [650.5, 690.0, 700.1]
    assert got["throttle_reasons"] == ["0x0000000000000000", "0x0000000000000004"]
    every = decode_phases.summarize_clocks(out, "GPU-unknown")  # no row of ours: all rows, said so
    assert every["samples"] == 5 and not every["matched"] and every["gpus"] == ["GPU-a", "GPU-b", "GPU-c"]
    assert "error" in decode_phases.summarize_clocks("", "GPU-a", "Failed to initialize NVML")
    na = decode_phases.summarize_clocks("GPU-c, 1400, [N/A], 50, [N/A]", "GPU-c")  # no power reading
    assert na["sm_mhz_min_med_max"] == [1400.0] * 3 and na["power_w_min_med_max"] is None


def test_replay_table_times_each_kv_buckets_graph_alone_and_queued(monkeypatch):
    """The table's bookkeeping with stand-ins for the CUDA pieces (a fake clock advanced 2 ms by every replay;
    events stamp it): alone = queued = 2 ms for every bucket of the largest batch, a failed capture named."""
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = 0.0

        def record(self) -> None:
            self.t = clock[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other: Event) -> float:
            return other.t - self.t

    class Graph:
        def replay(self) -> None:
            clock[0] += 2.0

    class Graphs:
        graphs = {(8, 16, "sample"): Graph(), (8, 32, "sample"): None, (4, 16, "sample"): Graph()}

        def ensure(self, key) -> None:
            assert key in self.graphs

    class Engine:
        graphs, graph_batch_sizes, kv_buckets = Graphs(), (4, 8), (16, 32)

    monkeypatch.setattr(decode_phases.torch.cuda, "Event", Event)
    monkeypatch.setattr(decode_phases.torch.cuda, "synchronize", lambda: None)
    table = decode_phases.replay_table(Engine(), queued=4, reps=3)
    assert table["batch"] == 8 and set(table["by_kv"]) == {"16", "32"}
    row = table["by_kv"]["16"]
    assert row["alone_ms"] == 2.0 and row["queued_ms"] == 2.0 and row["host_us_per_replay"] >= 0
    assert "error" in table["by_kv"]["32"]


def test_clock_sampler_runs_nvidia_smi_in_the_background_and_summarises(tmp_path, monkeypatch):
    """A stand-in nvidia-smi (one process, as the real one): the field probe, the looping query, stop()."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(
        "#!" + sys.executable + "\n"
        "import sys, time\n"
        "if not any(a.startswith('--loop-ms') for a in sys.argv):\n"
        "    sys.exit(0 if 'clocks_event_reasons' in ' '.join(sys.argv) else 6)\n"
        "while True:\n"
        "    print('GPU-x, 1980, 500.0, 55, 0x0', flush=True)\n"
        "    time.sleep(0.01)\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(decode_phases.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode_phases, "_my_uuid", lambda: "GPU-x")
    sampler = decode_phases.ClockSampler(period_ms=10).start()
    assert sampler.proc is not None and "clocks_event_reasons.active" in " ".join(sampler.proc.args)
    time.sleep(0.3)
    got = sampler.stop()
    assert got["matched"] and got["samples"] >= 1 and got["sm_mhz_min_med_max"] == [1980.0] * 3
    assert sampler.stop() is got  # idempotent
