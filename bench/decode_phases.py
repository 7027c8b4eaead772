"""Where a native engine's round goes, step by step: the decomposition behind bench/fp8_rollout.py --phases.

bench/rollout_engines.time_rounds reports `decode_ms_per_step` = (median round - a separate prefill-only round)
/ (new tokens - 1), and bench/fp8_check.profile_decode the graph replay of ONE key (the largest batch, the
LAST kv bucket) as single synchronised replays. Their difference ("host time outside the graph": 0.61 ms a
step for fp8 against 0.18 for bf16 on an H200) mixes three things the round really does differently: the kv
buckets the round replays (half of a 128 -> 256-token round runs the 256 bucket), replays queued back to back
instead of one at a time, and what happens between replays (the host's sync every `sync_every` steps, the
prefill inside the round). This module measures each in the round itself.

`PhaseProbe(engine)` (a context manager) wraps three bound methods of ONE NativeEngine instance (its code is
unchanged; the wrappers are instance attributes, removed on exit) and stamps every phase on the host
(time.perf_counter) and, on CUDA, on the GPU's stream (timing events, all measured from one reference event
recorded right after a synchronize at `begin()`, so GPU and host times share one origin):

    _admit        admission + prefill (only calls that ran a prefill are kept)
    _decode_once  one decode step: a graph replay (or an eager step); its kv bucket is recorded
    _retire       the sync every k steps: on CUDA a torch.cuda.synchronize() is put first so the wait for the
                  GPU (`retire_wait`) and the host's own work (`retire_host`) separate; retire would block
                  at its first device read anyway, so the timeline does not change

`report()` after the round (GPU times in ms on the shared origin; on a CPU the host stamps stand in for
them, the compute being synchronous):

    wall_ms                     begin() -> end() (end() synchronises)
    head_ms                     origin -> first prefill starts on the device (asyncio, validation, coalescing)
    prefill_ms                  first prefill start -> last prefill end (device)
    decode_ms_per_step          last prefill end -> last step end, / steps: the in-round decode step
    replay_ms_per_step          mean device span of one step (start event -> end event), and per kv bucket;
                                it holds a launch's latency when the device had to wait for that launch
    gap_in_batch_ms_per_step    device idle between two steps with no sync between them (host-bound launches)
    gap_at_sync_ms_per_step     device idle across a sync (retire, the next round's bookkeeping, first launch;
                                and between the prefill's end and the first step)
    tail_ms                     last step end -> end() (the last retire, results to the host, futures)
    host_us_per_step            host time inside _decode_once (the replay launch); a step is launch-bound
                                when this approaches replay_ms_per_step
    host_ms                     the host's totals: admit, enqueue, retire_wait, retire_host, other (the rest of
                                the wall: the driver's bookkeeping between phases and the event loop)
So decode_ms_per_step ~= replay_ms_per_step + the two gaps (to the events' resolution).

`replay_table(engine)`: each graph of the largest batch (one per kv bucket) replayed alone (median of 10
synchronised replays, what profile_decode reports) and back to back (16 queued replays between two events,
median of 3 such batches / 16), with the host us per replay() call in the queued loop.
`ClockSampler`: the GPU's SM clock, power and throttle reasons every 50 ms while the rounds run (nvidia-smi, best
effort: {"error": ...} where it cannot run), since a card that clocks down under a sustained load makes its
rounds slower than its single replays.
"""

from __future__ import annotations

import bisect
import itertools
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

import torch

Mark = tuple[float, Any]
"""(host perf_counter seconds, CUDA timing event or None)."""


class PhaseProbe:
    """Stamps a NativeEngine's admit / decode steps / retires during one round at a time (module doc)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.cuda = engine.device.type == "cuda"
        self._saved: list[str] = []
        self.reset()

    # ---- stamping -------------------------------------------------------------------------------------
    def _mark(self) -> Mark:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return time.perf_counter(), event

    def reset(self) -> None:
        """Forget the stamps (before the next round)."""
        self.origin: Mark | None = None
        self.prefills: list[tuple[Mark, Mark]] = []
        self.steps: list[tuple[Mark, Mark, int, int]] = []
        """(start, end, kv bucket, syncs before this step)."""
        self.retires: list[tuple[float, float, float]] = []
        """(host start, after the GPU wait, host end)."""
        self.finish: float | None = None

    def begin(self) -> None:
        """Synchronise and record the origin; call right before the round (generate_all)."""
        self.reset()
        if self.cuda:
            torch.cuda.synchronize()
        self.origin = self._mark()

    def end(self) -> None:
        """Synchronise and stamp the end; call right after the round returned."""
        if self.cuda:
            torch.cuda.synchronize()
        self.finish = time.perf_counter()

    # ---- the wrappers ---------------------------------------------------------------------------------
    def __enter__(self) -> PhaseProbe:
        eng = self.engine
        admit, decode_once, retire = eng._admit, eng._decode_once, eng._retire

        def _admit() -> None:
            before = eng.prefill_batches
            start = self._mark()
            admit()
            if eng.prefill_batches != before:
                self.prefills.append((start, self._mark()))

        def _decode_once(bs: int, kv_needed: int, mode: str) -> None:
            kv_len = eng.kv_buckets[bisect.bisect_left(eng.kv_buckets, kv_needed)]
            start = self._mark()
            decode_once(bs, kv_needed, mode)
            self.steps.append((start, self._mark(), kv_len, len(self.retires)))

        def _retire() -> None:
            t0 = t1 = time.perf_counter()
            if self.cuda:  # on a CPU nothing runs ahead of the host: no wait
                torch.cuda.synchronize()
                t1 = time.perf_counter()
            retire()
            self.retires.append((t0, t1, time.perf_counter()))

        for name, fn in (("_admit", _admit), ("_decode_once", _decode_once), ("_retire", _retire)):
            setattr(eng, name, fn)
            self._saved.append(name)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self._saved:
            delattr(self.engine, name)  # the class's methods show through again
        self._saved.clear()

    # ---- the report -----------------------------------------------------------------------------------
    def _t(self, mark: Mark) -> float:
        """A mark's time in ms from the origin: the device's (its event) on CUDA, else the host's."""
        assert self.origin is not None, "PhaseProbe.begin() was not called"
        if mark[1] is not None:
            return float(self.origin[1].elapsed_time(mark[1]))
        return (mark[0] - self.origin[0]) * 1e3

    def report(self) -> dict:
        """The round's decomposition (module doc); after end()."""
        assert self.origin is not None and self.finish is not None, "call begin() and end() around the round"
        if not self.steps:
            raise RuntimeError("PhaseProbe: the round ran no decode step (nothing to decompose)")
        n = len(self.steps)
        wall = (self.finish - self.origin[0]) * 1e3
        spans = [(self._t(a), self._t(b), kv, syncs) for a, b, kv, syncs in self.steps]
        first_decode = spans[0][0]
        pre = [(self._t(a), self._t(b)) for a, b in self.prefills]
        pre_before = [p for p in pre if p[1] <= first_decode + 1e-6]
        prefill_end = max((p[1] for p in pre_before), default=first_decode)
        prefill_start = min((p[0] for p in pre_before), default=first_decode)
        gap_in, gap_sync = 0.0, max(0.0, first_decode - prefill_end)  # the round's bookkeeping after admit
        for (_, end, _, syncs), (start, _, _, syncs_next) in itertools.pairwise(spans):
            gap = max(0.0, start - end)
            if syncs_next == syncs:
                gap_in += gap
            else:
                gap_sync += gap
        by_kv: dict[int, list[float]] = {}
        for start, end, kv, _ in spans:
            by_kv.setdefault(kv, []).append(end - start)
        last_end = spans[-1][1]
        host_admit = sum(b[0] - a[0] for a, b in self.prefills) * 1e3
        host_enqueue = sum(b[0] - a[0] for a, b, _, _ in self.steps) * 1e3
        wait = sum(t1 - t0 for t0, t1, _ in self.retires) * 1e3
        rhost = sum(t2 - t1 for _, t1, t2 in self.retires) * 1e3
        r = lambda x: round(x, 4)  # noqa: E731
        return dict(
            steps=n,
            syncs=len(self.retires),
            prefills=len(self.prefills),
            wall_ms=r(wall),
            head_ms=r(prefill_start),
            prefill_ms=r(prefill_end - prefill_start),
            decode_ms_per_step=r((last_end - prefill_end) / n),
            replay_ms_per_step=r(sum(e - s for s, e, _, _ in spans) / n),
            replay_ms_by_kv={str(k): r(statistics.mean(v)) for k, v in sorted(by_kv.items())},
            steps_by_kv={str(k): len(v) for k, v in sorted(by_kv.items())},
            gap_in_batch_ms_per_step=r(gap_in / n),
            gap_at_sync_ms_per_step=r(gap_sync / n),
            tail_ms=r(wall - last_end),
            host_us_per_step=r(host_enqueue / n * 1e3),
            host_ms=dict(
                admit=r(host_admit),
                enqueue=r(host_enqueue),
                retire_wait=r(wait),
                retire_host=r(rhost),
                other=r(wall - host_admit - host_enqueue - wait - rhost),
            ),
        )


def run_probed(engine, generate: Callable[[], object]) -> tuple[dict, object]:
    """One round `generate()` under a PhaseProbe of `engine`: (its report, generate's result)."""
    with PhaseProbe(engine) as probe:
        probe.begin()
        out = generate()
        probe.end()
    return probe.report(), out


def replay_table(engine, queued: int = 16, reps: int = 10) -> dict:
    """The largest batch's graph at every kv bucket: alone (median ms of `reps` synchronised replays) and
    queued (`queued` back-to-back replays between two events, median of 3 / queued; the host us per replay()
    call in that loop). CUDA graphs only; {} without them."""
    graphs = engine.graphs
    if graphs is None:
        return {}
    bs = max(engine.graph_batch_sizes)
    out: dict = {}
    with torch.no_grad():
        for kv in engine.kv_buckets:
            key = (bs, kv, "sample")
            graphs.ensure(key)
            if graphs.graphs.get(key) is None:
                out[str(kv)] = {"error": "no graph (its capture failed)"}
                continue
            graph = graphs.graphs[key]
            assert graph is not None
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            alone = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                alone.append(a.elapsed_time(b))
            batched, host = [], []
            for _ in range(3):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                t0 = time.perf_counter()
                for _ in range(queued):
                    graph.replay()
                host.append((time.perf_counter() - t0) / queued * 1e6)
                b.record()
                b.synchronize()
                batched.append(a.elapsed_time(b) / queued)
            out[str(kv)] = dict(
                alone_ms=round(statistics.median(alone), 4),
                queued_ms=round(statistics.median(batched), 4),
                host_us_per_replay=round(statistics.median(host), 1),
            )
    return {"batch": bs, "by_kv": out}


def _my_uuid() -> str:
    """The current CUDA device's UUID as nvidia-smi prints it ("GPU-..."), "" where torch cannot say."""
    try:
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except Exception:
        return ""
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


class ClockSampler:
    """nvidia-smi every `period_ms` in the background (each GPU's SM clock MHz, power W, temperature C and,
    where the driver names them, the active clock-event (throttle) reasons) between start() and stop(); stop()
    summarises this process's GPU (matched by UUID; every GPU's rows when none matches), or {"error": ...}."""

    BASE = "uuid,clocks.sm,power.draw,temperature.gpu"
    REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
    """The throttle-mask field's new and old names: the first this nvidia-smi accepts is used, else none."""

    def __init__(self, period_ms: int = 50) -> None:
        self.period_ms = period_ms
        self.proc: subprocess.Popen | None = None
        self.error: str | None = None
        self.summary: dict | None = None

    def _fields(self, exe: str) -> str | None:
        for fields in (*(f"{self.BASE},{r}" for r in self.REASONS), self.BASE):
            cmd = [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
            try:
                if subprocess.run(cmd, capture_output=True, timeout=5).returncode == 0:
                    return fields
            except (OSError, subprocess.SubprocessError):
                continue
        return None

    def start(self) -> ClockSampler:
        exe = shutil.which("nvidia-smi")
        if exe is None or not torch.cuda.is_available():
            self.error = "nvidia-smi not found" if exe is None else "no CUDA device"
            return self
        fields = self._fields(exe)
        if fields is None:
            self.error = "nvidia-smi --query-gpu failed for every field set"
            return self
        cmd = [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits", f"--loop-ms={self.period_ms}"]
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            self.error = f"{type(e).__name__}: {e}"
        return self

    def stop(self) -> dict:
        """End the sampling (idempotent) and summarise it."""
        if self.proc is None:
            return {"error": self.error or "not started"}
        if self.summary is not None:
            return self.summary
        self.proc.terminate()
        try:
            out, err = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.summary = summarize_clocks(out, _my_uuid(), err)
        return self.summary


def _num(text: str) -> float:
    """A number of nvidia-smi's csv, NaN where it printed none ("[N/A]", "[Not Supported]")."""
    try:
        return float(text)
    except ValueError:
        return float("nan")


def summarize_clocks(out: str, uuid: str, err: str = "") -> dict:
    """nvidia-smi's csv lines (uuid, SM MHz, W, C[, reasons]) -> min / median / max of each number and the
    throttle masks seen, for the rows of `uuid` (all rows when none is that GPU's)."""
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        if not parts[0].startswith("GPU-"):
            continue
        rows.append((parts[0], _num(parts[1]), _num(parts[2]), _num(parts[3]), ",".join(parts[4:])))
    mine = [row for row in rows if row[0] == uuid]
    rows = mine or rows
    if not rows:
        return {"error": f"no samples (nvidia-smi said: {err.strip()[:200] or out.strip()[:200]!r})"}

    def stats(i: int) -> list[float] | None:
        vals = [float(row[i]) for row in rows if row[i] == row[i]]  # NaN (the card reports "[N/A]") left out
        return [min(vals), statistics.median(vals), max(vals)] if vals else None

    return dict(
        samples=len(rows), gpus=sorted({row[0] for row in rows}), matched=bool(mine),
        sm_mhz_min_med_max=stats(1), power_w_min_med_max=stats(2), temp_c_min_med_max=stats(3),
        throttle_reasons=sorted({row[4] for row in rows if row[4]}),
    )  # fmt: skip


def phases_line(name: str, rounds: list[dict], table: dict | None = None, clocks: dict | None = None) -> str:
    """One line: the in-round step and its parts (medians over the probed rounds), the replay table."""
    if not rounds:
        return f"phases [{name}] none"

    def med(key: str) -> float:
        return round(statistics.median(r[key] for r in rounds), 3)

    kv = rounds[len(rounds) // 2]["replay_ms_by_kv"]
    tab = ""
    if table and table.get("by_kv"):
        tab = " | graphs alone/queued ms " + ", ".join(
            f"kv{k} {v.get('alone_ms')}/{v.get('queued_ms')} ({v.get('host_us_per_replay')} us host)"
            for k, v in table["by_kv"].items()
        )
    clk = ""
    if clocks and "sm_mhz_min_med_max" in clocks:
        clk = f" | SM MHz {clocks['sm_mhz_min_med_max']} W {clocks['power_w_min_med_max']}"
    return (
        f"phases [{name}] in-round decode {med('decode_ms_per_step')} ms/step = replay "
        f"{med('replay_ms_per_step')} (by kv {kv}) + gaps in batch {med('gap_in_batch_ms_per_step')} + at sync "
        f"{med('gap_at_sync_ms_per_step')} | host {med('host_us_per_step')} us/step | head {med('head_ms')} "
        f"prefill {med('prefill_ms')} tail {med('tail_ms')} wall {med('wall_ms')} ms{tab}{clk}"
    )
