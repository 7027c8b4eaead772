"""Run a list of peer-benchmark cells in ONE command within one wall-clock budget, relayrl's side of every cell in
the same command (bench/peers/README.md has the plan of GPU calls).

    python bench/peers/run_cells.py --cells verl:7b:1,openrlhf:7b:1 --budget 580
    python bench/peers/run_cells.py --cells verl:0.5b:4 --budget 580
    python bench/peers/run_cells.py --cells verl:7b:1,openrlhf:7b:1 --dry-run     # the plan, nothing runs
    python bench/peers/run_cells.py --cells verl:7b:1,openrlhf:0.5b:4 --prepare-only   # model folders + ops

A cell is peer:shape:gpus (peer verl or openrlhf, shape 0.5b or 7b, gpus 1 or more). Every side runs
`--steps` steps (4) and drops the first `--warmup` (1): the median of 3 timed steps, warmed alike.

Schedule:
- the model folders: built once per shape under --models (default /tmp/peers_models/<shape>), reused by
  every later command on the same machine (peer_common.models_in). Meanwhile, with an OpenRLHF cell,
  DeepSpeed's FusedAdam and DeepSpeedCPUAdam are JIT-built once (openrlhf_grpo.prebuild_ops): --torch-adam
  auto then uses FusedAdam (and --ds.enable_sleep, OpenRLHF's Hybrid Engine) when it built, else DeepSpeed's
  torch AdamW;
- the 1-GPU phase: every 1-GPU cell's peer on a GPU of its own and relayrl's 1-GPU run of each shape on
  another, all at once (CUDA_VISIBLE_DEVICES; RAY_ADDRESS=local: each command its own Ray instance;
  OMP_NUM_THREADS = the host's cores / the jobs running; unset for a job alone). That relayrl run is the
  relayrl side of every 1-GPU cell of its shape (same command, same model folder, same card type). With
  offload "states" and a GPU to spare, relayrl's "full" offload runs beside it too (recorded as relayrl_alt,
  not the cell's number). Jobs beyond the GPU count wait for a free GPU;
- then each multi-GPU cell alone on the first `gpus` GPUs: relayrl's side (once per shape x gpus), then the
  peer's.
Budget: each job's timeout is its share of the time left, in proportion to its estimate (EST_S), raised to
1.5x its estimate while the later units keep half of theirs (relayrl writes its steps only at the end); the peer's
script gets that as --budget, so it stops its own child and writes its row in time; 20 s later the driver
sends SIGTERM (the script kills its children at once and writes the steps logged so far), then SIGKILL.
A plan whose estimate (the model folders plus every unit) exceeds --budget gets a warning at the start and in
--dry-run, naming the last job and the budget that fits: a peer cut off before its first timed step leaves its
cell without a number.
At the start and after each unit of jobs, processes still holding GPU memory that a job of this script
started (their environment holds RELAYRL_PEERS_CELLS: e.g. a peer's engine orphaned by a killed run) are
killed by pid and logged; no other process is touched.

Output ($OUT): each job's files (`<peer>-<shape>-<gpus>gpu.{json,log,cmd}`, `relayrl-<shape>-<gpus>gpu.{json,
log}`, `<job>.driver.log`), and cells.json (rewritten after every job) + cells.md: per cell the peer's and
relayrl's median step, the ratio (peer / relayrl), statuses, offload mode, versions and card.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_common as pc

HERE = Path(__file__).resolve().parent
PEERS = ("verl", "openrlhf")
# seconds a job takes, start-up included, for 1 warm-up + 3 timed steps: measured at 0.5b on one H200
# (2026-11-27: verl 302 s to its first step + ~12 s a step, OpenRLHF 165 s + ~15 s, relayrl ~50 s in all);
# the rest are estimates (7B: vLLM's start-up 131 s in bench/rollout.py, steps 4-6x the 0.5B ones). Seen
# since (2026-11-28, 4 x H100): OpenRLHF 0.5B x 4 210 s to its first step + ~10 s a step, relayrl 0.5B x 4
# 59 s in all; verl 7B x 1 with offload "full" on an 80 GB card started its first step after ~390 s and had
# not finished it at 525 s (more than these estimates allow: run it on an H200, offload "states"). On 4 x H200
# (2026-11-28): verl 7B x 1 "states" 338 s to its first step line + ~31 s a step (433 s in all), OpenRLHF 7B x 1
# 358 s + ~40 s (483 s), verl 0.5B x 4 233 s + ~6 s (258 s), OpenRLHF 7B x 4 199 s + ~21 s (263 s); relayrl
# 7B x 1 78 s, 0.5B x 4 48 s, 7B x 4 63 s in all. Later that day, with no OMP_NUM_THREADS inherited: verl
# 7B x 4 339 s + ~12 s (380 s); verl 0.5B x 4 ~345 s to the end of its warm-up step (cut off at 383 s); relayrl
# 0.5B x 4 47 s, 7B x 4 56 s
EST_S = {
    ("relayrl", "0.5b", 1): 60,
    ("relayrl", "0.5b", 4): 100,
    ("relayrl", "7b", 1): 300,
    ("relayrl", "7b", 4): 180,
    ("verl", "0.5b", 1): 340,
    ("verl", "0.5b", 4): 420,
    ("verl", "7b", 1): 560,
    ("verl", "7b", 4): 520,
    ("openrlhf", "0.5b", 1): 230,
    ("openrlhf", "0.5b", 4): 260,
    ("openrlhf", "7b", 1): 480,
    ("openrlhf", "7b", 4): 420,
}
BUILD_S = {"0.5b": 15, "7b": 60}
GRACE_S = 20.0  # a peer script's budget ends this long before the driver's SIGTERM
RESERVE_S = 15.0  # kept at the end for the table
MIN_UNIT_S = 30.0  # the least a unit of jobs is given


@dataclasses.dataclass(frozen=True)
class Cell:
    peer: str
    shape: str
    gpus: int

    @property
    def name(self) -> str:
        return f"{self.peer}-{self.shape}-{self.gpus}gpu"


@dataclasses.dataclass
class Job:
    side: str  # relayrl, verl or openrlhf
    shape: str
    gpus: int
    offload: str
    tag: str = ""  # relayrl's second offload mode: "alt"
    devices: str = ""  # CUDA_VISIBLE_DEVICES, set when it starts
    result: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.side}-{self.shape}-{self.gpus}gpu" + (f"-{self.tag}" if self.tag else "")

    @property
    def est(self) -> float:
        return EST_S.get((self.side, self.shape, 1 if self.gpus == 1 else 4), 400)


def parse_cells(text: str, gpus_available: int) -> list[Cell]:
    cells = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in PEERS or parts[1] not in pc.RL_SHAPES or not parts[2].isdigit():
            raise SystemExit(
                f"--cells: {item!r} is not peer:shape:gpus (peer {'|'.join(PEERS)}, shape "
                f"{'|'.join(sorted(pc.RL_SHAPES))}, gpus an int), e.g. verl:7b:1"
            )
        cell = Cell(parts[0], parts[1], int(parts[2]))
        if not 1 <= cell.gpus <= gpus_available:
            raise SystemExit(f"--cells: {item} needs {cell.gpus} GPUs; this machine has {gpus_available}")
        if cell in cells:
            raise SystemExit(f"--cells: {item} is listed twice")
        cells.append(cell)
    if not cells:
        raise SystemExit("--cells: no cell given")
    return cells


def plan(
    cells: list[Cell], gpus_available: int, offload: Callable[[str, int], str], replicate: bool = False
) -> list[list[Job]]:
    """Units of jobs, run one unit after the other: first the 1-GPU jobs together (peers, then relayrl per
    shape, then relayrl's alternative offload where a GPU is left), then each multi-GPU job alone. With
    `replicate`, relayrl's multi-GPU run of a shape that fits one card without offload (so every rank can hold
    the whole training state) runs a second time with dist.replicate (tag "replicate": recorded beside the
    cell, not its number)."""
    one = [c for c in cells if c.gpus == 1]
    units: list[list[Job]] = []
    if one:
        jobs = [Job(c.peer, c.shape, 1, offload(c.shape, 1)) for c in one]
        shapes = sorted({c.shape for c in one})
        jobs += [Job("relayrl", s, 1, offload(s, 1)) for s in shapes]
        for s in shapes:
            if offload(s, 1) == "states" and len(jobs) < gpus_available:
                jobs.append(Job("relayrl", s, 1, "full", tag="alt"))
        units.append(jobs)
    done: set[tuple[str, int]] = set()
    for c in (c for c in cells if c.gpus > 1):
        if (c.shape, c.gpus) not in done:
            units.append([Job("relayrl", c.shape, c.gpus, offload(c.shape, c.gpus))])
            if replicate and offload(c.shape, c.gpus) == "none" and offload(c.shape, 1) == "none":
                units.append([Job("relayrl", c.shape, c.gpus, "none", tag="replicate")])
            done.add((c.shape, c.gpus))
        units.append([Job(c.peer, c.shape, c.gpus, offload(c.shape, c.gpus))])
    return units


def unit_est(unit: list[Job], gpus_available: int) -> float:
    """A unit's expected wall time: its jobs spread over the GPUs, longest first."""
    if len(unit) == 1:
        return unit[0].est
    load = [0.0] * max(1, gpus_available)
    for job in sorted(unit, key=lambda j: -j.est):
        i = load.index(min(load))
        load[i] += job.est
    return max(load)


def unit_span(left: float, est: float, later: float) -> float:
    """Seconds a unit gets: its share of the `left` seconds in proportion to its estimate `est` against the
    later units' `later`, raised to 1.5x its estimate while the later units keep half of theirs (relayrl
    writes its steps only at its end; a unit that ends early leaves its time to the next); >= MIN_UNIT_S."""
    span = min(max(left * est / (est + later), 1.5 * est), left - 0.5 * later)
    return max(MIN_UNIT_S, span)


def job_env(job: Job, concurrent: int) -> dict[str, str]:
    """The job's environment: its GPUs, its own Ray instance; OMP_NUM_THREADS = the host's cores over the
    jobs running at once when they are several (so no job's threads take the others' cores), and unset
    for a job alone, as each framework's users run it: Ray then gives each actor its CPUs' threads. (Set
    to the host's cores for a job alone, as it was until 2026-11-28, every Ray actor of that job
    inherited it: 4 ranks x 64 threads on a 64-core host; docs/benchmarks.md.)"""
    env = pc.peer_env({"CUDA_VISIBLE_DEVICES": job.devices, "RAY_ADDRESS": "local", MARKER: str(os.getpid())})
    if concurrent > 1:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 2) // concurrent))
    else:
        env.pop("OMP_NUM_THREADS", None)
    return env


class Driver:
    """Runs the plan: `command(job, model_dir, timeout_s)` gives each job's command (tests swap in stubs)."""

    def __init__(self, args: argparse.Namespace, cells: list[Cell], gpus_available: int) -> None:
        self.args, self.cells, self.gpus = args, cells, gpus_available
        self.out = pc.out_dir()
        self.end = time.perf_counter() + args.budget
        self.torch_adam = args.torch_adam == "yes"
        self.prebuilt: dict[str, str] = {}
        self.builder: threading.Thread | None = None
        self.models: dict[str, Path] = {}
        self.units = plan(cells, gpus_available, self.offload, args.replicate)
        self.lock = threading.Lock()
        self.ops_lock = threading.Lock()
        self.table: list[dict[str, Any]] = []

    def offload(self, shape: str, gpus: int) -> str:
        if self.args.offload != "auto":
            return self.args.offload
        return pc.offload_mode(shape, gpus, self.args.gpu_gib or pc.gpu_memory_gib() or 80.0)

    def left(self) -> float:
        return self.end - time.perf_counter() - RESERVE_S

    # ---------------------------------------------------------------------------------------- commands
    def command(self, job: Job, model_dir: Path, timeout_s: float) -> list[str]:
        a = self.args
        if job.side == "relayrl":
            out_json = self.out / f"{job.name}.json"
            return pc.relayrl_command(
                job.shape,
                job.gpus,
                a.steps,
                model_dir / "model",
                out_json,
                job.offload,
                job.tag == "replicate",
            )
        cmd = [
            sys.executable,
            str(HERE / f"{job.side}_grpo.py"),
            *("--gpus", str(job.gpus), "--shape", job.shape, "--steps", str(a.steps)),
            *("--warmup", str(a.warmup), "--sides", job.side, "--model-dir", str(model_dir)),
            *("--budget", f"{max(30.0, timeout_s - GRACE_S):.0f}", "--timeout", f"{timeout_s:.0f}"),
            *("--offload", job.offload),
        ]
        if job.side == "openrlhf":
            cmd += ["--torch-adam", "yes" if self.torch_adam else "no"]
        return cmd

    # ---------------------------------------------------------------------------------------- running
    def run_job(self, job: Job, deadline: float, concurrent: int) -> None:
        if job.side == "openrlhf":
            self.ops_built()  # its optimizer follows the DeepSpeed ops' build (its GPU waits meanwhile)
        timeout_s = max(MIN_UNIT_S / 3, deadline - time.perf_counter())
        model_dir = self.models[job.shape]
        cmd = self.command(job, model_dir, timeout_s)
        pc.log(f"{job.name} on GPU(s) {job.devices}: timeout {timeout_s:.0f}s, offload {job.offload}")
        res = pc.run_logged(
            cmd, job_env(job, concurrent), self.out / f"{job.name}.driver.log", timeout_s, lambda line: None
        )
        if job.side == "relayrl":
            path = self.out / f"{job.name}.json"
            steps = [dict(s) for s in json.loads(path.read_text())["per_step"]] if path.is_file() else []
            job.result = {**pc.summarise(steps, self.args.warmup), "status": res["status"], "steps": steps}
        else:
            path = self.out / f"{job.side}-{job.shape}-{job.gpus}gpu.json"
            row = json.loads(path.read_text()) if path.is_file() else {}
            side = row.get(job.side) or {"status": f"no result ({res['status']})"}
            job.result = {**side, "versions": row.get("versions", {}), "device": row.get("device", "")}
            if res["status"] != "ok" and not str(side.get("status", "")).startswith("ok"):
                job.result["driver_status"] = res["status"]
        job.result.update(offload=job.offload, devices=job.devices, wall_s=res["wall_s"])
        with self.lock:
            self.write_table()

    def run_unit(self, unit: list[Job], later: float) -> None:
        """Start the unit's jobs on free GPUs (waiting for one when all are taken), all bounded by the unit's
        share of the time left."""
        deadline = time.perf_counter() + unit_span(self.left(), unit_est(unit, self.gpus), later)
        free = list(range(self.gpus))
        threads: list[tuple[threading.Thread, list[int]]] = []
        for job in sorted(unit, key=lambda j: (-j.gpus, -j.est)):  # longest first, as unit_est
            while len(free) < job.gpus:
                time.sleep(0.5)
                for t, ids in [x for x in threads if not x[0].is_alive()]:
                    free += ids
                    threads.remove((t, ids))
            ids, free = free[: job.gpus], free[job.gpus :]
            job.devices = ",".join(map(str, ids))
            t = threading.Thread(target=self.run_job, args=(job, deadline, min(len(unit), self.gpus)))
            t.start()
            threads.append((t, ids))
        for t, _ in threads:
            t.join()
        kill_gpu_leftovers()

    def prepare(self) -> None:
        """The model folders (one child per shape, in turn); with an OpenRLHF cell and --torch-adam auto, the
        DeepSpeed ops build meanwhile in a thread that only the OpenRLHF jobs wait for (ops_built)."""
        if self.args.torch_adam == "auto" and any(c.peer == "openrlhf" for c in self.cells):
            import openrlhf_grpo  # pyright: ignore[reportMissingImports]

            def prebuild() -> None:
                self.prebuilt = openrlhf_grpo.prebuild_ops(min(300.0, max(30.0, self.left() / 3)))

            self.builder = threading.Thread(target=prebuild)
            self.builder.start()
        for shape in sorted({c.shape for c in self.cells}):
            self.models[shape] = Path(self.args.models) / shape
            pc.models_in(self.models[shape], shape)

    def ops_built(self) -> None:
        with self.ops_lock:
            if self.builder is None:
                return
            self.builder.join()
            self.builder = None
            self.torch_adam = self.prebuilt.get("fused_adam") != "ok"
            pc.log(
                f"DeepSpeed ops: {self.prebuilt}; OpenRLHF: {'torch AdamW' if self.torch_adam else 'FusedAdam'}"
            )

    def estimate(self) -> float:
        """The plan's expected wall time: the model folders it builds, then every unit at its estimate."""
        shapes = {c.shape for c in self.cells}
        return sum(BUILD_S[s] for s in shapes) + sum(unit_est(u, self.gpus) for u in self.units)

    def over_budget(self) -> str:
        """A warning when the plan's estimate exceeds --budget ("" when it fits): the later jobs then get less
        than their estimate, and a peer cut off before its first timed step leaves its cell without a number."""
        est = self.estimate()
        if est <= self.args.budget:
            return ""
        names = ", ".join(j.name for j in self.units[-1])
        return (
            f"the plan's estimate {est:.0f} s exceeds --budget {self.args.budget:.0f} s: the later jobs "
            f"(last: {names}) get less than their estimate and may stop before a timed step; raise --budget to "
            f">= {est:.0f} or split the cells over several commands"
        )

    def run(self) -> list[dict[str, Any]]:
        if warning := self.over_budget():
            pc.log(f"WARNING: {warning}")
        kill_gpu_leftovers()  # an earlier command's
        self.prepare()
        ests = [unit_est(u, self.gpus) for u in self.units]
        for i, unit in enumerate(self.units):
            if self.left() < MIN_UNIT_S:
                pc.log(f"budget spent: not started: {', '.join(j.name for j in unit)}")
                for j in unit:
                    j.result = {"status": "not started (budget spent)", "offload": j.offload}
                continue
            self.run_unit(unit, sum(ests[i + 1 :]))
        self.ops_built()
        self.write_table()
        print_table(self.table)
        return self.table

    # ---------------------------------------------------------------------------------------- results
    def relayrl_job(self, shape: str, gpus: int, tag: str = "") -> Job | None:
        for unit in self.units:
            for j in unit:
                if j.side == "relayrl" and (j.shape, j.gpus, j.tag) == (shape, gpus, tag):
                    return j
        return None

    def write_table(self) -> None:
        rows = []
        for c in self.cells:
            peer = next(
                j for u in self.units for j in u if (j.side, j.shape, j.gpus) == (c.peer, c.shape, c.gpus)
            )
            rl, alt = self.relayrl_job(c.shape, c.gpus), self.relayrl_job(c.shape, c.gpus, "alt")
            p, r = peer.result, rl.result if rl else {}
            rl_offload = rl.offload if rl else ""
            if alt is not None and not r.get("step_median_s") and alt.result.get("step_median_s"):
                r, rl_offload = (
                    alt.result,
                    f"{alt.offload} (its {rl_offload} run failed)",
                )  # e.g. out of memory
            row: dict[str, Any] = {
                "cell": c.name,
                "peer_step_s": p.get("step_median_s"),
                "relayrl_step_s": r.get("step_median_s"),
                "ratio": (
                    round(p["step_median_s"] / r["step_median_s"], 2)
                    if p.get("step_median_s") and r.get("step_median_s")
                    else None
                ),
                "peer_steps_timed": p.get("steps_timed", 0),
                "relayrl_steps_timed": r.get("steps_timed", 0),
                "peer_status": p.get("status", "pending"),
                "relayrl_status": r.get("status", "pending"),
                "offload": peer.offload,
                "relayrl_offload": rl_offload,
                "peer_gpus": peer.devices,
                "relayrl_gpus": rl.devices if rl else "",
                "versions": p.get("versions", {}),
                "card": p.get("device") or pc.gpu_name(),
            }
            if alt is not None:
                row["relayrl_alt"] = {
                    "offload": alt.offload,
                    **{k: alt.result.get(k) for k in ("step_median_s", "status")},
                }
            rep = self.relayrl_job(c.shape, c.gpus, "replicate")
            if rep is not None:
                row["relayrl_replicate"] = {k: rep.result.get(k) for k in ("step_median_s", "status")}
            rows.append(row)
        self.table = rows
        meta = {
            "budget_s": self.args.budget,
            "steps": self.args.steps,
            "warmup": self.args.warmup,
            "deepspeed_ops": self.prebuilt,
            "openrlhf_optimizer": "torch AdamW" if self.torch_adam else "FusedAdam",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        (self.out / "cells.json").write_text(json.dumps({**meta, "cells": rows}, indent=2) + "\n")
        (self.out / "cells.md").write_text(markdown(rows) + "\n")


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| cell | peer step s | relayrl step s | ratio | timed steps (peer / relayrl) | offload | status (peer / relayrl) | versions | card |"
    lines = [head, "|" + "---|" * 9]

    def f(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, float) else ("-" if v is None else str(v))

    for r in rows:
        v = r["versions"]
        ver = ", ".join(
            f"{k} {v[k]}" for k in ("verl", "openrlhf", "deepspeed", "vllm", "torch", "relayrl") if k in v
        )
        lines.append(
            f"| {r['cell']} | {f(r['peer_step_s'])} | {f(r['relayrl_step_s'])} | "
            f"{'-' if r['ratio'] is None else str(r['ratio']) + 'x'} | {r['peer_steps_timed']} / "
            f"{r['relayrl_steps_timed']} | {r['offload']}{'' if r['relayrl_offload'] in ('', r['offload']) else ' / relayrl ' + r['relayrl_offload']} | {r['peer_status']} / {r['relayrl_status']} | {ver} | "
            f"{r['card']} |"
        )
    for r in rows:
        rep = r.get("relayrl_replicate")
        if rep:
            lines.append(
                f"\n{r['cell']}: relayrl with dist.replicate (every rank the whole model) "
                f"{f(rep.get('step_median_s'))} s ({rep.get('status', 'pending')})"
            )
    return "\n".join(lines)


def print_table(rows: list[dict[str, Any]]) -> None:
    print("\n" + markdown(rows), flush=True)


MARKER = "RELAYRL_PEERS_CELLS"  # in every job's environment, so in every process its jobs start


def kill_gpu_leftovers() -> None:
    """Kill, by pid, processes still holding GPU memory that a job of this driver (or of an earlier one)
    started: those whose environment holds MARKER (a peer's engine orphaned by a killed run would take the
    next job's memory). Any other process on the GPUs is left alone."""
    out = pc.nvidia_smi("--query-compute-apps=pid", "--format=csv,noheader")
    if out is None:
        return
    killed = 0
    for pid in {int(x) for x in out.split() if x.strip().isdigit()} - {os.getpid()}:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if not any(e.startswith(MARKER.encode() + b"=") for e in environ):
            continue
        pc.log(f"killing pid {pid}: a job's process left holding GPU memory")
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            continue
    if killed:
        time.sleep(5)


def gpu_count() -> int:
    return sum(1 for x in (pc.nvidia_smi("-L") or "").splitlines() if x.startswith("GPU "))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--cells", required=True, help="comma list of peer:shape:gpus, e.g. verl:7b:1,openrlhf:7b:1"
    )
    parser.add_argument("--budget", type=float, default=580, help="seconds for the whole command")
    parser.add_argument("--steps", type=int, default=4, help="steps per side")
    parser.add_argument("--warmup", type=int, default=1, help="leading steps of each side not timed")
    parser.add_argument("--offload", default="auto", choices=["auto", *pc.OFFLOAD_MODES], help="every side's")
    parser.add_argument(
        "--torch-adam", default="auto", choices=["auto", "yes", "no"], help="OpenRLHF's optimizer"
    )
    parser.add_argument("--models", default="/tmp/peers_models", help="model folders, reused across commands")
    parser.add_argument("--gpus-available", type=int, default=0, help="default: nvidia-smi's count")
    parser.add_argument(
        "--gpu-gib", type=float, default=0, help="a card's memory for --offload auto (nvidia-smi)"
    )
    parser.add_argument(
        "--replicate",
        action="store_true",
        help="also run relayrl's multi-GPU side of each shape without offload with dist.replicate (beside the cell)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="build the cells' model folders (and DeepSpeed's ops) into --models for later commands, then stop",
    )
    args = parser.parse_args(argv)
    if args.steps - args.warmup < 3:
        raise SystemExit(f"--steps {args.steps} --warmup {args.warmup}: fewer than 3 timed steps")
    gpus = args.gpus_available or gpu_count()
    if gpus < 1:
        raise SystemExit("no GPU found (nvidia-smi -L); --gpus-available N with --dry-run to see the plan")
    cells = parse_cells(args.cells, gpus)
    driver = Driver(args, cells, gpus)
    if args.dry_run:
        for i, unit in enumerate(driver.units):
            print(
                f"unit {i + 1} (~{unit_est(unit, gpus):.0f} s): "
                + ", ".join(f"{j.name} [{j.offload}]" for j in unit)
            )
            for j in unit:
                print("   ", " ".join(driver.command(j, Path(args.models) / j.shape, j.est)))
        print(f"estimated wall time: {driver.estimate():.0f} s (budget {args.budget:.0f} s)")
        if warning := driver.over_budget():
            print(f"WARNING: {warning}")
        return []
    if args.prepare_only:
        driver.prepare()
        driver.ops_built()
        pc.log(
            f"prepared: {sorted(driver.models)} in {args.models}; DeepSpeed ops {driver.prebuilt or 'not built'}"
        )
        return []
    return driver.run()


if __name__ == "__main__":
    main()
