"""Where a tensor-parallel native engine's round goes, per rank: bench/tp_decode.py --phases and the CPU count test.

`RoundCounter(engine)` (a context manager, on every rank of a TP engine, or on a one-GPU engine for the TP 1
baseline) wraps five bound methods of ONE engine instance (`_round`, `_admit`, `_decode_once`, `_retire` and,
on a TPNativeEngine, its round messages `_send` / `_receive`) and the collectives of `torch.distributed`
(broadcast, all_reduce, all_gather, broadcast_object_list, ...), plus the host reads of a tensor
(`Tensor.item`, `.tolist`, `.cpu`, `.numpy`). Each is counted under the phase it ran in:

    control   a TP round message (leader: `_send`; follower: `_receive`, which also holds the WAIT for the
              leader's message, so its host time is the follower's idle time at a round start)
    step      one decode step (`_decode_once`: a graph replay on GPUs, whose collectives are inside the
              graph and so not seen here; the eager step on a CPU, whose collectives are)
    admit     admission and prefill
    retire    the sync every `sync_every` steps (the host reads that wait for the device)
    round     the rest of a round's host bookkeeping (compaction, batch size, sampling mode, ...)
    outside   anything else while the counter is on (the driver, the follow loop, the event loop)

A host read of a tensor on a CUDA device is a device sync; one of a CPU tensor is not (both are counted,
apart: `syncs` vs `cpu_reads`). Host times (time.perf_counter) are kept per phase, and per round the host
time of its first decode-step launch (`first_launch`): perf_counter is CLOCK_MONOTONIC on Linux, one clock
for every process of a host, so rank 0 can subtract the leader's from each follower's (`launch_lag_ms`: how
long after the leader's GPU started a round the follower's could, which the leader's GPU spends waiting at
the round's first all-reduce).

`report()`: counts per phase (and per round / per step), host ms per phase, the launch times.
`tp_rounds(engine, run_round, n, device)` runs n rounds under a RoundCounter and decode_phases.PhaseProbe
(the GPU's view: replay per step, gaps in a batch and at syncs) on every rank; `summary(per_rank)` reduces
every rank's reports on rank 0 (medians, the follower's launch lag).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast_object_list", "all_gather_object", "gather_object", "barrier", "send", "recv")  # fmt: skip
"""torch.distributed functions counted (the package's attributes: the calls this project makes)."""
READS = ("item", "tolist", "cpu", "numpy")
"""torch.Tensor methods that bring a value to the host."""
PHASES = ("control", "step", "admit", "retire", "round", "outside")


def _tensor_device(args: tuple, kwargs: dict) -> str:
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device.type
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            return a[0].device.type
    dev = kwargs.get("device")
    return torch.device(dev).type if dev is not None else "none"


class RoundCounter:
    """Counts and times an engine's rounds by phase (module doc)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.phase = "outside"
        self.collectives: dict[str, dict[str, int]] = {p: {} for p in PHASES}
        """phase -> "name@device" -> calls."""
        self.syncs: dict[str, int] = dict.fromkeys(PHASES, 0)
        self.cpu_reads: dict[str, int] = dict.fromkeys(PHASES, 0)
        self.host_s: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.rounds = self.steps = 0
        self.first_launch: list[float] = []
        """Host perf_counter of each round's first decode-step launch."""
        self._launched = True
        self._saved_engine: list[str] = []
        self._saved_dist: dict[str, Any] = {}
        self._saved_tensor: dict[str, Any] = {}
        """name -> torch.Tensor's own attribute before patching (None: it was inherited)."""
        self._t0 = 0.0

    # ---- phase bookkeeping ----------------------------------------------------------------------------
    def _enter(self, phase: str) -> tuple[str, float]:
        now = time.perf_counter()
        self.host_s[self.phase] += now - self._t0
        prev, self.phase, self._t0 = self.phase, phase, now
        return prev, now

    def _leave(self, prev: str) -> None:
        now = time.perf_counter()
        self.host_s[self.phase] += now - self._t0
        self.phase, self._t0 = prev, now

    def _wrap_engine(self, name: str, phase: str, before: Callable[[], None] | None = None) -> None:
        eng = self.engine
        if not hasattr(eng, name):
            return
        inner = getattr(eng, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            prev, _ = self._enter(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                self._leave(prev)

        setattr(eng, name, wrapper)
        self._saved_engine.append(name)

    def _new_round(self) -> None:
        self.rounds += 1
        self._launched = False

    def _step_launch(self) -> None:
        self.steps += 1
        if not self._launched:
            self._launched = True
            self.first_launch.append(time.perf_counter())

    # ---- patching ---------------------------------------------------------------------------------------
    def __enter__(self) -> RoundCounter:
        self._t0 = time.perf_counter()
        self._wrap_engine("_round", "round", self._new_round)
        self._wrap_engine("_admit", "admit")
        self._wrap_engine("_decode_once", "step", self._step_launch)
        self._wrap_engine("_retire", "retire")
        self._wrap_engine("_send", "control")
        self._wrap_engine("_receive", "control")
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved_dist[name] = fn

            def counted(*args: Any, _fn: Any = fn, _name: str = name, **kwargs: Any) -> Any:
                key = f"{_name}@{_tensor_device(args, kwargs)}"
                table = self.collectives[self.phase]
                table[key] = table.get(key, 0) + 1
                return _fn(*args, **kwargs)

            setattr(dist, name, counted)
        for name in READS:
            meth = getattr(torch.Tensor, name)
            self._saved_tensor[name] = meth if name in vars(torch.Tensor) else None

            def read(t: torch.Tensor, *args: Any, _m: Any = meth, **kwargs: Any) -> Any:
                if t.device.type == "cuda":
                    self.syncs[self.phase] += 1
                else:
                    self.cpu_reads[self.phase] += 1
                return _m(t, *args, **kwargs)

            setattr(torch.Tensor, name, read)
        return self

    def __exit__(self, *exc: object) -> None:
        self.host_s[self.phase] += time.perf_counter() - self._t0
        for name in self._saved_engine:
            if name in vars(self.engine):
                delattr(self.engine, name)  # the class's methods show through again
        for name, fn in self._saved_dist.items():
            setattr(dist, name, fn)
        for name, meth in self._saved_tensor.items():
            if meth is None:
                delattr(torch.Tensor, name)  # inherited from the C base: let it show through again
            else:
                setattr(torch.Tensor, name, meth)
        self._saved_engine.clear()
        self._saved_dist.clear()
        self._saved_tensor.clear()

    # ---- the report -------------------------------------------------------------------------------------
    def outside_graph(self) -> dict[str, int]:
        """Collectives outside the decode steps and prefills ("name@device" -> calls): what a round costs
        beyond its CUDA graphs."""
        out: dict[str, int] = {}
        for phase in ("control", "retire", "round", "outside"):
            for key, n in self.collectives[phase].items():
                out[key] = out.get(key, 0) + n
        return out

    def report(self) -> dict:
        rounds, steps = max(1, self.rounds), max(1, self.steps)
        host_ms = {p: round(s * 1e3, 4) for p, s in self.host_s.items()}
        outside = self.outside_graph()
        return dict(
            rounds=self.rounds,
            steps=self.steps,
            collectives=self.collectives,
            collectives_outside_graph=outside,
            collectives_outside_graph_per_round=round(sum(outside.values()) / rounds, 4),
            syncs=self.syncs,
            syncs_per_round=round(sum(self.syncs.values()) / rounds, 4),
            cpu_reads=self.cpu_reads,
            host_ms=host_ms,
            host_ms_per_round={p: round(v / rounds, 4) for p, v in host_ms.items()},
            host_us_per_step=round((sum(host_ms.values()) - host_ms["step"]) / steps * 1e3, 2),
            first_launch=self.first_launch,
        )


def tp_rounds(engine: Any, run_round: Callable[[], object], n: int, device: torch.device) -> list[dict]:
    """`n` rounds (`run_round`: the leader's generate + release, a follower's follow) each under a RoundCounter
    and, on CUDA, decode_phases.PhaseProbe (the GPU's split of the round); this rank's reports."""
    from decode_phases import PhaseProbe  # bench/decode_phases.py (bench/ on sys.path)

    out = []
    for _ in range(n):
        with RoundCounter(engine) as counter, PhaseProbe(engine) as probe:
            probe.begin()
            run_round()
            probe.end()
        rep = counter.report()
        try:
            rep["gpu"] = probe.report()
        except RuntimeError as e:  # a round with no decode step (nothing to decompose)
            rep["gpu"] = {"error": str(e)}
        if device.type == "cuda":
            rep["gpu_device"] = torch.cuda.current_device()
        out.append(rep)
    return out


def summary(per_rank: list[list[dict]]) -> dict:
    """Every rank's `tp_rounds` reports (rank order, rank 0 the leader) -> medians per rank (the counter's and
    decode_phases.PhaseProbe's: `probe_host_ms` is its host split of a whole round, retire_wait the host
    waiting for the device) and the followers' launch lag behind the leader per round (ms; module doc)."""

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 4) if values else None

    ranks = []
    for reps in per_rank:
        gpu = [r["gpu"] for r in reps if "error" not in r["gpu"]]
        ranks.append(dict(
            decode_ms_per_step=med([g["decode_ms_per_step"] for g in gpu]),
            replay_ms_per_step=med([g["replay_ms_per_step"] for g in gpu]),
            gap_in_batch_ms_per_step=med([g["gap_in_batch_ms_per_step"] for g in gpu]),
            gap_at_sync_ms_per_step=med([g["gap_at_sync_ms_per_step"] for g in gpu]),
            syncs_per_round=med([r["syncs_per_round"] for r in reps]),
            collectives_outside_graph_per_round=med([r["collectives_outside_graph_per_round"] for r in reps]),
            host_us_per_step=med([r["host_us_per_step"] for r in reps]),
            host_ms_per_round={p: med([r["host_ms_per_round"][p] for r in reps]) for p in PHASES},
            probe_host_ms={k: med([g["host_ms"][k] for g in gpu]) for k in (gpu[0]["host_ms"] if gpu else {})},
            steps_by_kv=gpu[0]["steps_by_kv"] if gpu else {},
            replay_ms_by_kv={k: med([g["replay_ms_by_kv"][k] for g in gpu if k in g["replay_ms_by_kv"]])
                             for k in (gpu[0]["replay_ms_by_kv"] if gpu else {})},
        ))  # fmt: skip
    lags = []
    for k, lead in enumerate(per_rank[0]):
        for reps in per_rank[1:]:
            mine = reps[k]["first_launch"] if k < len(reps) else []
            lags += [(f - t) * 1e3 for t, f in zip(lead["first_launch"], mine, strict=False)]
    return dict(
        ranks=ranks,
        launch_lag_ms=dict(median=med(lags), max=round(max(lags), 4) if lags else None, rounds=len(lags)),
    )


def phases_text(name: str, summ: dict) -> str:
    """One line per rank: the in-round step and its parts, the host's per-round phases."""
    lines = []
    for r, s in enumerate(summ["ranks"]):
        host = ", ".join(f"{p} {v}" for p, v in s["host_ms_per_round"].items() if v)
        lines.append(
            f"tp-phases [{name}] rank {r}: in-round {s['decode_ms_per_step']} ms/step = replay "
            f"{s['replay_ms_per_step']} + gaps in batch {s['gap_in_batch_ms_per_step']} + at sync "
            f"{s['gap_at_sync_ms_per_step']} | per round: {s['collectives_outside_graph_per_round']} collectives "
            f"outside the graphs, {s['syncs_per_round']} device syncs, host ms {host}"
        )
    lag = summ["launch_lag_ms"]
    lines.append(f"tp-phases [{name}] follower launch lag ms: median {lag['median']} max {lag['max']}")
    return "\n".join(lines)
