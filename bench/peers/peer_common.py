"""Shared parts of the verl and OpenRLHF peer benchmarks (bench/peers/verl_grpo.py, openrlhf_grpo.py).

What both hold equal to relayrl's side (bench/rl_step.py, run in the same call on the same GPUs):
- the model: one random-weight Qwen2 folder of bench/rl_step.py's shape (`0.5b` = its "qwen0.5b-char", `7b` =
  "qwen7b-char": Qwen2.5-0.5B / 7B bodies with the char tokenizer's ~100-token vocabulary, bf16), built once per
  call; the peers read a sibling folder with the same weight files (symlinks) whose tokenizer's chat template is
  the identity ("{{ content }}"), so every side sees the raw add2 prompt ("12+34="), as relayrl does;
- the batch: 64 prompts x 8 samples, <= 256 new tokens, temperature 1, top-p 1, samples end at EOS;
- the step: GRPO advantages (group mean / std), PPO-clip 0.2, token-mean loss, no reference model / KL,
  one optimizer step per batch (1 epoch, 1 mini-batch), AdamW lr 1e-5 betas (0.9, 0.95), constant schedule,
  grad-norm clip 1.0;
- the reward: tests/trainers/data/digit_reward.py (the fraction of digit characters of the response), which
  relayrl and OpenRLHF load as it is and verl through bench/peers/verl_reward.py (the same function).

Each peer runs as its own command (a subprocess with a timeout, its own process group, killed whole on
timeout); its log goes to $OUT/<peer>-<shape>-<gpus>gpu.log. Step times: each framework's own per-step timer
(relayrl timing/step, verl timing_s/step, OpenRLHF the sum of its timing/* parts), and the wall time between
consecutive step log lines as a check. The first `warmup` steps are dropped; the median of the rest is the
step time. Ratio = peer median step / relayrl median step (relayrl's speed relative to the peer's).

Memory (`offload_mode`, the scripts' `--offload auto`): full-parameter training keeps 16 bytes a parameter of
model state on the GPUs (fp32 masters, fp32 gradients, two fp32 AdamW moments), 97 GiB at the 7B shape (6.53B
parameters with the char vocabulary). "none": the states stay on the GPUs (they take <= 35% of a card: every
0.5B case and 7B over 4 GPUs); "states": the update runs on the GPU and the states leave it while the engine
generates (7B on one card of >= 125 GiB: an H200); "full": the states live in CPU memory and the optimizer
step runs on the CPU (7B on one 80 GB card). Each side then uses its own documented way (relayrl_command,
verl_grpo.overrides, openrlhf_grpo.arguments).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import re
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REWARD = ROOT / "tests" / "trainers" / "data" / "digit_reward.py"
RL_SHAPES = {"0.5b": "qwen0.5b-char", "7b": "qwen7b-char"}
PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_TOKENS = 64, 8, 256, 64
LR, BETAS = 1e-5, (0.9, 0.95)
IDENTITY_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
OFFLOAD_MODES = ("none", "states", "full")
_RUNNING: list[subprocess.Popen] = []  # children of run_logged now running (killed on SIGTERM)
_STOP: list[str] = []  # set by the SIGTERM handler: run_logged returns what it has, no further side starts


def out_dir() -> Path:
    """$OUT (the coordinator's result folder), else bench/results/peers_out."""
    out = Path(os.environ.get("OUT") or ROOT / "bench" / "results" / "peers_out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", flush=True)


# ============================================================================================== memory
def param_count(shape: str) -> int:
    """Parameters of `shape`'s Qwen2 body with the char tokenizer's ~100-row tied embedding (q/k/v biases,
    two norms a layer): 0.36B at 0.5b, 6.53B at 7b."""
    sys.path.insert(0, str(ROOT))
    from bench.rl_step import SHAPES

    body = SHAPES[RL_SHAPES[shape]][0]
    h, inter, layers = body["hidden_size"], body["intermediate_size"], body["num_hidden_layers"]
    kv = h // body["num_attention_heads"] * body["num_key_value_heads"]
    attn = h * h + h + 2 * (h * kv + kv) + h * h
    return layers * (attn + 3 * h * inter + 2 * h) + 100 * h + h


def offload_mode(shape: str, gpus: int, gpu_gib: float) -> str:
    """The mode: "none" when the 16-byte-a-parameter model states per GPU take <= 35% of a card (the rest holds the
    engine); "states" when states + a bf16 engine copy + 15 GiB fit one card; else "full" (module doc)."""
    n = param_count(shape)
    states = 16 * n / gpus / 2**30
    if states <= 0.35 * gpu_gib:
        return "none"
    if states + 2 * n / 2**30 + 15 <= gpu_gib:
        return "states"
    return "full"


def nvidia_smi(*args: str) -> str | None:
    """nvidia-smi's output for `args` (so this process makes no CUDA context); None without nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout


def gpu_memory_gib() -> float:
    """The smallest visible card's memory (nvidia-smi, so this process makes no CUDA context); 0 without one."""
    try:
        out = nvidia_smi("--query-gpu=memory.total", "--format=csv,noheader,nounits")
        mib = [float(x) for x in (out or "").split() if x.strip()]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            idx = [int(i) for i in visible.split(",") if i.strip().isdigit()]
            mib = [mib[i] for i in idx if i < len(mib)] or mib
        return min(mib) / 1024 if mib else 0.0
    except ValueError:
        return 0.0


def resolve_offload(choice: str, shape: str, gpus: int) -> str:
    """`--offload auto` -> offload_mode for the visible cards (80 GiB assumed when none is found); else as
    given."""
    if choice != "auto":
        return choice
    return offload_mode(shape, gpus, gpu_memory_gib() or 80.0)


# ============================================================================================== model + data
def build_models(shape: str, folder: Path) -> tuple[Path, Path]:
    """The random model folder of `shape` (for relayrl) and the peers' sibling (same weight files, identity
    chat template). Built on the GPU in bf16 when there is one (a 7B shape inits in seconds there)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    from bench.rl_step import SHAPES
    from relayrl.models.tiny import build_tiny_tokenizer

    model_dir, peer_dir = folder / "model", folder / "model_peer"
    tok = build_tiny_tokenizer()
    body, dtype, *_ = SHAPES[RL_SHAPES[shape]]
    kwargs: dict[str, Any] = dict(body)
    kwargs.setdefault("vocab_size", len(tok))
    kwargs.update(
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    config = Qwen2Config(**kwargs)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if dtype == "bf16" else torch.float32)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    peer_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.suffix in (".safetensors",) or f.name.endswith(".index.json"):
            (peer_dir / f.name).symlink_to(f)
        else:
            shutil.copy(f, peer_dir / f.name)
    ptok = AutoTokenizer.from_pretrained(peer_dir)
    ptok.chat_template = IDENTITY_TEMPLATE
    ptok.save_pretrained(peer_dir)
    log(
        f"built {shape} ({RL_SHAPES[shape]}, {dtype}) on {device} in {time.perf_counter() - t0:.1f}s: {model_dir}"
    )
    return model_dir, peer_dir


def build_models_in_child(shape: str, folder: Path, timeout_s: float = 300) -> tuple[Path, Path]:
    """build_models in a child process, so that this process holds no CUDA context (memory on GPU 0) while
    the sides run."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; import peer_common as pc; "
        "pc.build_models(sys.argv[2], Path(sys.argv[3]))"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).resolve().parent), shape, str(folder)],
        check=True,
        timeout=timeout_s,
    )
    return folder / "model", folder / "model_peer"


def models_in(folder: Path, shape: str) -> tuple[Path, Path]:
    """The model folders of `shape` under `folder` (e.g. a --model-dir shared by the commands of one machine):
    reused when a previous build finished (its `.complete` marker), else built there."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / ".complete").is_file():
        for sub in ("model", "model_peer"):
            shutil.rmtree(folder / sub, ignore_errors=True)
        build_models_in_child(shape, folder)
        (folder / ".complete").write_text(shape + "\n")
    else:
        log(f"reusing the {shape} model folders in {folder}")
    return folder / "model", folder / "model_peer"


def prompt_rows(n: int) -> list[dict[str, str]]:
    """relayrl's add2 rows ({"input": "12+34=", "label": "46"}), the ones its own run draws from."""
    sys.path.insert(0, str(ROOT))
    from relayrl.tasks import get_task

    return get_task("add2").make_rows("train", n, 0)


# ============================================================================================== processes
def run_logged(
    cmd: list[str],
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
    step_line: Callable[[str], dict[str, float] | None],
    cwd: Path | None = None,
    stop_after: int = 0,
) -> dict[str, Any]:
    """Run `cmd` in its own process group, tee its output to `log_path`, and collect one dict per step line
    (`step_line` parses it; the wall time since the previous step line is added as "line_gap"). Kill the
    whole group on timeout, or once `stop_after` step lines were seen (0: run to the end)."""
    log(f"run: {' '.join(cmd)}  (timeout {timeout_s:.0f}s, log {log_path})")
    steps: list[dict[str, float]] = []
    t0 = last = time.perf_counter()
    tail: list[str] = []
    status = "ok"
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        assert proc.stdout is not None
        _RUNNING.append(proc)
        deadline = t0 + timeout_s

        def handle(line: str) -> bool:
            """Log one output line; True once the steps asked for were seen."""
            nonlocal tail, last
            fh.write(line + "\n")
            fh.flush()
            tail = [*tail, line.rstrip()][-60:]
            parsed = step_line(line)
            if parsed is None:
                return False
            now = time.perf_counter()
            parsed["line_gap"] = now - last
            last = now
            steps.append(parsed)
            log(f"step {len(steps)}: " + ", ".join(f"{k}={v:.3f}" for k, v in parsed.items()))
            return bool(stop_after and len(steps) >= stop_after)

        # raw reads split into lines here: a line already read into a file object's buffer would wait
        # unseen for the next output (select sees only the pipe), e.g. the last step line before a stall
        fd = proc.stdout.fileno()
        sel = selectors.DefaultSelector()
        sel.register(fd, selectors.EVENT_READ)
        pending, eof = b"", False
        while True:
            if _STOP:
                status = f"stopped ({_STOP[0]})"
                break
            if time.perf_counter() > deadline:
                status = f"timeout after {timeout_s:.0f}s"
                break
            if eof or not sel.select(timeout=1.0):
                if proc.poll() is not None:
                    break
                if eof:
                    time.sleep(0.2)
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                eof = True
                sel.unregister(fd)
                if pending and handle(pending.decode(errors="replace")):
                    status = "ok (stopped after the steps asked for)"
                    break
                pending = b""
                continue
            *lines, pending = (pending + chunk).split(b"\n")
            if any(handle(raw.decode(errors="replace")) for raw in lines):
                status = "ok (stopped after the steps asked for)"
                break
        sel.close()
        rc = proc.poll()
        if rc is None:
            kill_group(proc)
            rc = proc.wait()
        else:
            kill_group(proc)  # the children it left (Ray's services, engines)
        with contextlib.suppress(ValueError):
            _RUNNING.remove(proc)
    wall = time.perf_counter() - t0
    if _STOP and status == "ok":  # the SIGTERM handler killed the child: not the child's own failure
        status = f"stopped ({_STOP[0]})"
    if status == "ok" and rc != 0:
        status = f"exit code {rc}"
    if status != "ok" and not status.startswith("ok"):
        log(f"FAILED ({status}); last lines of {log_path}:\n" + "\n".join(tail[-40:]))
    return {
        "status": status,
        "rc": rc,
        "wall_s": round(wall, 1),
        "steps": steps,
        "log": str(log_path),
        "tail": tail[-40:] if not status.startswith("ok") else [],
    }


def stop_on_sigterm() -> None:
    """On SIGTERM (the cell driver's budget, bench/peers/run_cells.py): kill the running children's process
    groups at once, and let run_logged return the steps seen so far, so the script writes its partial row."""

    def handler(signum: int, frame: Any) -> None:
        _STOP.append("SIGTERM")
        for p in list(_RUNNING):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    signal.signal(signal.SIGTERM, handler)


def stopped() -> bool:
    return bool(_STOP)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL the process group `proc` leads (it was started with start_new_session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    time.sleep(1)


def stop_ray() -> None:
    """`ray stop --force` (a peer killed mid-run can leave a local Ray cluster that the next side would
    join); quiet when Ray is not installed or nothing runs. Skipped when RAY_ADDRESS is "local": then each
    peer command starts its own local Ray instance and two peers may run side by side on one host (one per
    GPU), where a host-wide `ray stop` would kill the other peer's cluster mid-run (seen 2026-11-27 12:43:
    verl's raylet died when the OpenRLHF command ended); the peer's driver process exiting stops its own."""
    if os.environ.get("RAY_ADDRESS") == "local":
        print(
            "peers: RAY_ADDRESS=local: not running `ray stop --force` (side-by-side Ray instances)",
            flush=True,
        )
        return
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], capture_output=True, timeout=60
        )


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a peer's processes: the repository root on PYTHONPATH (rewards import from it),
    vLLM's in-process engine (the carried vLLM bundle's setting), NVLink multicast off."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT)])
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("WANDB_MODE", "disabled")
    env.setdefault("RAY_DEDUP_LOGS", "0")
    for k in (
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "VLLM_NO_USAGE_STATS",
        "DO_NOT_TRACK",
    ):
        env.setdefault(k, "1")  # no network there: fail at once instead of waiting on a connection
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env.update(extra or {})
    return env


# ============================================================================================== relayrl side
def relayrl_command(
    shape: str,
    gpus: int,
    steps: int,
    model_dir: Path,
    out_json: Path,
    offload: str = "none",
    replicate: bool = False,
) -> list[str]:
    """relayrl's bench/rl_step.py run (GRPO, its native engine, same model folder) as a child command: local
    mode on 1 GPU, Ray mode with the policy over `gpus` GPUs and colocated engines otherwise. `offload`
    (offload_mode, docs/distributed.md "Memory knobs"): "states" = --dist.offload_optimizer_in_rollout with
    --dist.engine_sleep yes (AdamW states in CPU memory and the KV cache freed while the other half of the
    step runs; the update on the GPU); "full" = --dist.offload (FSDP2 CPU offload, Ray mode: shards, gradients
    and AdamW states in pinned CPU memory, the optimizer step on the CPU) with --dist.engine_sleep yes. At the 7B
    shape model.gradient_checkpointing is on (as both peers run it). `replicate` (several GPUs, offload "none"):
    --dist.replicate, every rank the whole model instead of FSDP2 shards (docs/distributed.md)."""
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
    kwargs: dict[str, Any] = dict(
        device="cuda",
        shape=RL_SHAPES[shape],
        steps=steps,
        model_dir=str(model_dir),
        dist_mode="ray" if gpus > 1 or offload == "full" else "local",
        policy_gpus=gpus,
        offload=offload == "full",
    )
    if offload != "none":  # the KV cache freed for the update, as both peers' engines sleep for theirs
        kwargs.update(engine_sleep="yes", offload_optimizer_in_rollout=offload == "states")
    if replicate:
        if gpus < 2 or offload != "none":
            raise ValueError(f"replicate needs several GPUs and offload none, got {gpus} GPU(s), {offload!r}")
        kwargs.update(replicate=True)
    # Both peers run 7B with gradient checkpointing; relayrl's 16k-token micro-batches of 7B ran out of an
    # H100's memory without it (2026-11-28).
    if shape == "7b":
        kwargs.update(gradient_checkpointing=True)
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); from bench.rl_step import run; "
        "row = run(**json.loads(sys.argv[2])); open(sys.argv[3], 'w').write(json.dumps(row)); "
        "print('relayrl step:', json.dumps(row['per_step']), flush=True)"
    )
    return [sys.executable, "-c", code, str(ROOT), json.dumps(kwargs), str(out_json)]


def run_relayrl(
    shape: str,
    gpus: int,
    steps: int,
    model_dir: Path,
    timeout_s: float,
    offload: str = "none",
    tag: str = "",
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """relayrl's side: writes $OUT/relayrl-<shape>-<gpus>gpu[-tag].{json,log} (rl_step's row) and returns
    run_logged's result with the per-step times; `env` is added to the peers' environment (e.g. the GPU)."""
    out = out_dir()
    name = f"relayrl-{shape}-{gpus}gpu" + (f"-{tag}" if tag else "")
    out_json = out / f"{name}.json"
    res = run_logged(
        relayrl_command(shape, gpus, steps, model_dir, out_json, offload),
        peer_env(env),
        out / f"{name}.log",
        timeout_s,
        lambda line: None,
        cwd=ROOT,
    )
    res["offload"] = offload
    if out_json.is_file():
        row = json.loads(out_json.read_text())
        res["steps"] = [dict(s) for s in row["per_step"]]
        res["relayrl_row"] = {k: v for k, v in row.items() if k != "per_step"}
    return res


class Budget:
    """The command's wall-clock budget (the GPU machine stops a command at 10 minutes): each side gets at most
    its own timeout and never more than what is left, less `reserve` seconds for writing the results."""

    def __init__(self, total_s: float, reserve_s: float = 20.0) -> None:
        self.end = time.perf_counter() + total_s
        self.reserve = reserve_s

    def left(self, cap: float) -> float:
        return max(1.0, min(cap, self.end - time.perf_counter() - self.reserve))


# ============================================================================================== summary
def summarise(steps: list[dict[str, float]], warmup: int, key: str = "step") -> dict[str, Any]:
    """Median / mean of `key` over the steps after `warmup`, tokens per step and per second."""
    timed = steps[warmup:] if len(steps) > warmup else steps
    if not timed:
        return {"steps_timed": 0}
    vals = [s[key] for s in timed]
    out: dict[str, Any] = {
        "steps_timed": len(timed),
        "step_median_s": round(statistics.median(vals), 4),
        "step_mean_s": round(statistics.mean(vals), 4),
    }
    if all("line_gap" in s for s in timed):
        out["line_gap_median_s"] = round(statistics.median(s["line_gap"] for s in timed), 4)
    if all(s.get("gen_tokens") for s in timed):
        tokens = statistics.mean(s["gen_tokens"] for s in timed)
        out["gen_tokens_per_step"] = round(tokens, 1)
        out["gen_tokens_per_s"] = round(tokens / out["step_mean_s"], 1)
    return out


def versions(names: tuple[str, ...]) -> dict[str, str]:
    """Python and package versions, and the relayrl commit: RELAYRL_COMMIT when set (a copy of the tree on a
    GPU machine, whose .git, when it has one, can be older than the files: a run there on 2026-11-28 read
    "f913623-dirty" for the tree of d1960ea), else git's HEAD ("-dirty" when relayrl/ has local changes)."""
    out = {"python": platform.python_version()}
    commit = os.environ.get("RELAYRL_COMMIT", "")
    if not commit:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            dirty = subprocess.run([*git, "status", "--porcelain", "relayrl"], capture_output=True, text=True)
            commit = head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    out["relayrl"] = commit or "unknown"
    for n in names:
        try:
            out[n] = importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            out[n] = "not installed"
    return out


def gpu_name() -> str:
    names = [n.strip() for n in (nvidia_smi("--query-gpu=name", "--format=csv,noheader") or "").splitlines()]
    names = [n for n in names if n]
    return f"{len(names)} x {names[0]}" if names else "no GPU"


def write_result(name: str, row: dict[str, Any]) -> Path:
    path = out_dir() / f"{name}.json"
    path.write_text(json.dumps(row, indent=2) + "\n")
    return path


def compare(peer: str, row: dict[str, Any]) -> None:
    """Fill row["ratio"] and print the table."""
    r, p = row.get("relayrl", {}), row.get(peer, {})
    if r.get("step_median_s") and p.get("step_median_s"):
        row["ratio"] = round(p["step_median_s"] / r["step_median_s"], 2)
    print(
        f"\n{peer} GRPO vs relayrl rl: {row['shape']} shape, {row['gpus']} GPU(s) ({row['device']}), "
        f"{PROMPTS} prompts x {SAMPLES} samples, <= {NEW_TOKENS} new tokens; median of the steps after "
        f"{row['warmup']} warm-up"
    )
    print(
        f"{'side':<10}{'status':<34}{'median step s':>14}{'mean step s':>12}{'line gap s':>11}"
        f"{'gen tok/step':>13}{'gen tok/s':>11}"
    )
    for side, s in (("relayrl", r), (peer, p)):
        print(
            f"{side:<10}{str(s.get('status', '-'))[:33]:<34}{s.get('step_median_s', float('nan')):>14.3f}"
            f"{s.get('step_mean_s', float('nan')):>12.3f}{s.get('line_gap_median_s', float('nan')):>11.3f}"
            f"{s.get('gen_tokens_per_step', float('nan')):>13.0f}{s.get('gen_tokens_per_s', float('nan')):>11.0f}"
        )
    if "ratio" in row:
        print(f"ratio = {peer} median step / relayrl median step = {row['ratio']:.2f}x")


FLOAT = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"


def grab(line: str, key: str) -> float | None:
    """The number after `key` followed by ':' (verl's "k:v - k:v" and OpenRLHF's "'k': v" forms)."""
    m = re.search(re.escape(key) + r"'?\s*:\s*(?:np\.float\d+\()?" + FLOAT, line)
    return float(m.group(1)) if m else None
