"""Peer benchmark: TRL's GRPOTrainer vs `relayrl rl` on the same model, prompts, reward and batch shape.

    .venv/bin/python bench/peers/trl_grpo.py                          # cpu-tiny (2 torch threads)
    python bench/peers/trl_grpo.py --workload gpu-equal               # Qwen2.5-0.5B shape, 256 tokens each
    python bench/peers/trl_grpo.py --workload gpu-var                 # same, samples end at EOS (<= 256)
    python bench/peers/trl_grpo.py --workload gpu-equal --generation vllm   # TRL generates with vLLM colocated

Both sides train one random-weight model folder (built once, saved with save_pretrained like
bench/rl_step.py) on the add2 prompts ("a+b=", raw text, no chat template on either side), with the same
reward function (tests/trainers/data/digit_reward.py, the fraction of digit characters: a random model gets a
non-zero, varying reward, so advantages and gradients are not all zero) and the same step: P prompts x N
samples, temperature 1, one optimizer step per generation batch (1 epoch, 1 mini-batch), GRPO advantages
(group mean / std), PPO-clip 0.2, token-mean loss over the whole step, no reference model (beta 0),
AdamW lr 1e-5 betas (0.9, 0.95), constant schedule, grad-norm clip 1.0, seed 0.

TRL is set up as its users run it without vLLM: `model.generate` over the whole generation batch, then
`per_device_train_batch_size` samples per forward/backward with gradient accumulation up to the step,
loss_type "dapo" (token mean over the accumulated step: relayrl's token_mean), bf16 autocast over fp32 weights
on a GPU, gradient checkpointing off. With one generation per optimizer step TRL skips the old-log-prob
forward (the detached current log-probs stand in); relayrl's `experience` part is its old log-probs (a
separate forward up to commit b504c0b) and advantages.

`--generation vllm` (a GPU): TRL as its GRPO guide recommends on one GPU, vLLM colocated in the trainer's
process (bench/peers/trl_vllm.py lists every vLLM setting and its source; the rest of the step as above). TRL
then copies the weights into vLLM before each generation (timed as generation) and, with truncated
importance sampling on (its default), runs the old-log-prob forward (timed as experience). The TRL side runs
under torchrun (one process), as TRL's colocated examples do; ignore-EOS becomes vLLM's `min_tokens`.

Each side runs in its own subprocess, one after the other (relayrl first), so neither's threads or CUDA
memory affect the other. Step time: relayrl's `timing/step` from its history; TRL's from a TrainerCallback,
on_step_begin to on_step_end (generation, scoring, every micro-batch, clip and optimizer step; not logging).
The first step of each is a warm-up and not timed. Ratio = TRL step time / relayrl step time (relayrl's
speed relative to TRL's). Writes bench/results/peers_trl_grpo.json (one entry per workload, `<workload>-vllm`
for `--generation vllm`, updated in place).

Needs TRL (`pip install -e '.[bench]'`; never a runtime dependency of relayrl).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REWARD = ROOT / "tests" / "trainers" / "data" / "digit_reward.py"
RESULTS = ROOT / "bench" / "results" / "peers_trl_grpo.json"
PARTS = ("step", "generation", "experience", "update")
LR = 1e-5
CPU_THREADS = 2
TRL_RECORDED = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "steps_per_generation",
    "generation_batch_size",
    "num_generations",
    "max_completion_length",
    "generation_kwargs",
    "loss_type",
    "scale_rewards",
    "beta",
    "num_iterations",
    "epsilon",
    "bf16",
    "gradient_checkpointing",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "vllm_importance_sampling_correction",
    "optim",
)
"""GRPOConfig fields written to the results (the rest are in the module doc and `trl_config`)."""


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One benchmark setting; both sides read every field from here."""

    shape: str
    """Model shape, a key of bench/rl_step.py's SHAPES (tiny: hidden 128 / 4 layers; qwen0.5b)."""
    device: str
    """cpu or cuda."""
    dtype: str
    """relayrl model.dtype (fp32 / bf16); on cuda TRL runs bf16=True (autocast over fp32 weights)."""
    prompts: int
    """Prompts per step."""
    samples: int
    """Samples per prompt (the GRPO group)."""
    new_tokens: int
    """Most new tokens per sample."""
    ignore_eos: bool
    """Every sample runs to `new_tokens` (EOS never stops it)."""
    micro_batch_tokens: int
    """relayrl algo.micro_batch_tokens (packed micro-batch token budget), as bench/rl_step.py uses."""
    trl_micro_batch: int
    """TRL per_device_train_batch_size (samples per forward/backward); gradient accumulation makes the rest."""


WORKLOADS = {
    "cpu-tiny": Workload(
        shape="tiny",
        device="cpu",
        dtype="fp32",
        prompts=16,
        samples=8,
        new_tokens=24,
        ignore_eos=False,
        micro_batch_tokens=4096,  # relayrl's default (algo.micro_batch_tokens)
        trl_micro_batch=128,  # the whole step in one pass: a tiny model has memory to spare
    ),
    "gpu-equal": Workload(
        shape="qwen0.5b",
        device="cuda",
        dtype="bf16",
        prompts=64,
        samples=8,
        new_tokens=256,
        ignore_eos=True,
        micro_batch_tokens=16384,
        trl_micro_batch=32,  # 32 x 257 x 151,936 logits per pass; 16 accumulation steps
    ),
}
# Variable lengths need a vocabulary where EOS comes up: with 151,936 random-weight tokens it almost never
# does. The same 0.5B body with the char tokenizer's ~100 tokens ends samples at EOS (mean ~110 of 256), and
# its logits are small, so TRL takes 64 samples per pass.
WORKLOADS["gpu-var"] = replace(
    WORKLOADS["gpu-equal"], shape="qwen0.5b-char", ignore_eos=False, trl_micro_batch=64
)


# ================================================================================================ shared setup
def build_model(shape: str, folder: Path) -> Path:
    """The random Qwen2 + char tokenizer HF folder of bench/rl_step.py (one definition of the shapes)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from rl_step import build_model as rl_step_build_model

    return rl_step_build_model(shape, folder)


def relayrl_config(w: Workload, model: str, run_dir: str, steps: int) -> Any:
    """The relayrl RLConfig of workload `w` (TRL reads its prompt rows from it too)."""
    from relayrl.config.presets import tiny_cpu_config

    cfg = tiny_cpu_config(model, run_dir, steps=steps, reward=str(REWARD))
    return replace(
        cfg,
        model=replace(cfg.model, dtype=w.dtype),
        train=replace(cfg.train, device=w.device, seed=0),
        optim=replace(cfg.optim, lr=LR, scheduler="constant", warmup_steps=0, max_grad_norm=1.0),
        task=replace(cfg.task, name="add2", train_rows=2000, eval_rows=0),
        rollout=replace(
            cfg.rollout,
            prompts_per_step=w.prompts,
            n_samples=w.samples,
            max_new_tokens=w.new_tokens,
            max_len=64 + w.new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
        ),
        algo=replace(
            cfg.algo,
            advantage="group_norm",
            policy_loss="ppo",
            aggregation="token_mean",
            kl_mode="none",
            epochs=1,
            mini_batches=1,
            micro_batch_tokens=w.micro_batch_tokens,
        ),
    )


def now(device: str) -> float:
    """perf_counter after the device's queued work has finished."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return time.perf_counter()


def summarise(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Means over the timed steps (the first, warm-up, step dropped), and the median step (steadier on a
    shared CPU, where one step can stall behind another job)."""
    timed = steps[1:] if len(steps) > 1 else steps
    mean = {p: round(statistics.mean(s[p] for s in timed), 4) for p in PARTS}
    tokens = statistics.mean(s["gen_tokens"] for s in timed)
    return {
        "seconds": mean,
        "step_median": round(statistics.median(s["step"] for s in timed), 4),
        "steps_timed": len(timed),
        "gen_tokens_per_step": round(tokens, 1),
        "step_tokens_per_s": round(tokens / mean["step"], 1),
        "per_step": [{k: round(v, 4) for k, v in s.items()} for s in steps],
    }


# ================================================================================================ relayrl side
def ignore_eos_in_relayrl() -> None:
    """relayrl has no setting to ignore EOS: the rollout engine's stop ids default to the tokenizer's EOS
    (relayrl/rollout/hf.py default_eos_ids, imported by native.py). Patch that default to "no stop ids" in this
    process; fail loudly if it moved, rather than silently timing variable-length samples."""
    import relayrl.rollout.native as native

    if not callable(getattr(native, "default_eos_ids", None)):
        raise RuntimeError(
            "relayrl.rollout.native.default_eos_ids is gone: update ignore_eos_in_relayrl() to the new way of "
            "running the engine without stop ids (or use relayrl's own setting, if it has one by now)"
        )
    native.default_eos_ids = lambda *args, **kwargs: []


def run_relayrl(w: Workload, model: str, steps: int) -> dict[str, Any]:
    from relayrl.trainers.rl.loop import run_rl

    if w.ignore_eos:
        ignore_eos_in_relayrl()
    n = w.prompts * w.samples
    with tempfile.TemporaryDirectory() as tmp:
        result = run_rl(relayrl_config(w, model, str(Path(tmp) / "run"), steps))
    if result.exit_code != 0:
        raise RuntimeError(f"relayrl rl stopped with exit code {result.exit_code}: {result.message}")
    per_step = []
    for h in result.history:
        t = {p: float(h.get(f"timing/{p}", float("nan"))) for p in ("step", "generation", "experience")}
        t["update"] = t["step"] - t["generation"] - t["experience"]  # update + sync (+ loop overhead)
        t["gen_tokens"] = float(h["rollout/response_len"]) * n
        t["reward"] = float(h.get("rollout/reward_mean", float("nan")))
        per_step.append(t)
    import torch

    return {
        **summarise(per_step),
        "precision": f"model.dtype={w.dtype}",
        "torch_threads": torch.get_num_threads(),
    }


# ================================================================================================ TRL side
def trl_config(w: Workload, output_dir: str, steps: int, generation: str = "generate") -> Any:
    """GRPOConfig for one optimizer step per generation batch of prompts x samples (see module doc)."""
    from trl import GRPOConfig
    from trl_vllm import vllm_config_kwargs

    n = w.prompts * w.samples
    if n % w.trl_micro_batch:
        raise ValueError(f"trl_micro_batch {w.trl_micro_batch} must divide the step's {n} samples")
    gen_kwargs = None
    if w.ignore_eos:  # EOS masked until the last token (model.generate's / vLLM SamplingParams' name for it)
        gen_kwargs = {"min_tokens" if generation == "vllm" else "min_new_tokens": w.new_tokens}
    engine: dict[str, Any] = vllm_config_kwargs() if generation == "vllm" else {"use_vllm": False}
    return GRPOConfig(
        output_dir=output_dir,
        max_steps=steps,
        per_device_train_batch_size=w.trl_micro_batch,
        gradient_accumulation_steps=n // w.trl_micro_batch,  # steps_per_generation defaults to this
        num_generations=w.samples,
        max_completion_length=w.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        generation_kwargs=gen_kwargs,
        **engine,
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        bf16=w.device == "cuda",
        use_cpu=w.device == "cpu",
        gradient_checkpointing=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )


def run_trl(w: Workload, model: str, steps: int, generation: str = "generate") -> dict[str, Any]:
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from relayrl.tasks import get_task

    class StepClock(TrainerCallback):
        """Per optimizer step: wall time, generation (model.generate or vLLM) and generate+score time, logs."""

        def __init__(self) -> None:
            self.parts = {"generation": 0.0, "gen_and_score": 0.0}
            self.steps: list[dict[str, float]] = []
            self.logs: dict[int, dict[str, float]] = {}

        def on_step_begin(self, args, state, control, **kwargs):
            self.parts = dict.fromkeys(self.parts, 0.0)
            self.t0 = now(w.device)

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append({"step": now(w.device) - self.t0, **self.parts})

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.setdefault(state.global_step, {}).update(logs or {})  # the end-of-run log shares a step

    clock = StepClock()

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *args, **kwargs):
            t0 = now(w.device)
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                clock.parts["generation"] += now(w.device) - t0

        def _generate_and_score_completions(self, *args, **kwargs):
            t0 = now(w.device)
            try:
                return super()._generate_and_score_completions(*args, **kwargs)
            finally:
                clock.parts["gen_and_score"] += now(w.device) - t0

    if not hasattr(GRPOTrainer, "_generate_single_turn"):
        print("trl_grpo: warning: this TRL has no _generate_single_turn; generation time is not split out")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = relayrl_config(w, model, tmp, steps)
        rows = get_task(cfg.task.name).make_rows("train", cfg.task.train_rows, cfg.data.seed)
        dataset = datasets.Dataset.from_list([{"prompt": r["input"]} for r in rows])  # relayrl's raw prompt
        args = trl_config(w, str(Path(tmp) / "trl"), steps, generation)
        trainer = TimedGRPOTrainer(
            model=model, reward_funcs=digit_reward(), args=args, train_dataset=dataset, callbacks=[clock]
        )
        trainer.train()
    n = w.prompts * w.samples
    per_step = []
    for i, s in enumerate(clock.steps, start=1):
        logs = clock.logs.get(i, {})
        per_step.append(
            {
                "step": s["step"],
                "generation": s["generation"],
                "experience": s["gen_and_score"] - s["generation"],  # decode, reward, advantages
                "update": s["step"] - s["gen_and_score"],  # forward/backward x micro-batches, clip, AdamW
                "gen_tokens": float(logs.get("completions/mean_length", float("nan"))) * n,
                "reward": float(logs.get("reward", float("nan"))),
            }
        )
    import torch

    summary = summarise(per_step)
    summary["config"] = {k: str(getattr(args, k)) for k in TRL_RECORDED}
    if generation == "vllm":
        from trl_vllm import VLLM_COLOCATE

        summary["vllm_settings"] = {k: {"value": v, "why": why} for k, (v, why) in VLLM_COLOCATE.items()}
    summary["precision"] = "bf16 autocast, fp32 weights" if args.bf16 else "fp32"
    summary["torch_threads"] = torch.get_num_threads()
    return summary


def digit_reward() -> Any:
    """TRL reward function over the same file relayrl loads (reward_func(queries, prompts, labels))."""
    spec = importlib.util.spec_from_file_location("digit_reward", REWARD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def digit_fraction(completions: list[str], **kwargs: Any) -> list[float]:
        blank = [""] * len(completions)  # queries = prompt + response with an empty prompt = the response
        return [float(r) for r in module.reward_func(list(completions), blank, blank)["rewards"]]

    return digit_fraction


# ================================================================================================ driver
def child(side: str, workload: str, model: str, steps: int, out: str, generation: str) -> None:
    """One side in this process; its summary to `out` as JSON."""
    import torch

    w = WORKLOADS[workload]
    if w.device == "cpu":
        torch.set_num_threads(CPU_THREADS)
    if generation == "vllm":
        from trl_vllm import in_process_engine

        in_process_engine()
    summary = run_relayrl(w, model, steps) if side == "relayrl" else run_trl(w, model, steps, generation)
    summary["device"] = torch.cuda.get_device_name(0) if w.device == "cuda" else cpu_name()
    Path(out).write_text(json.dumps(summary))
    if generation == "vllm":  # in-process vLLM (>= 0.21) can leave non-daemon threads that hang the exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def cpu_name() -> str:
    """The CPU's model name (Linux), else platform.processor()."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def run_side(side: str, workload: str, model: Path, steps: int, tmp: Path, generation: str) -> dict[str, Any]:
    out = tmp / f"{side}.json"
    env = dict(os.environ)
    if WORKLOADS[workload].device == "cpu":
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(CPU_THREADS)
    launcher = [sys.executable]
    if side == "trl" and generation == "vllm":  # one torchrun process, as TRL's colocated examples run
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"]
    cmd = [*launcher, __file__, "--side", side, "--workload", workload, "--steps", str(steps)]
    cmd += ["--generation", generation]
    print(f"--- {side}: {' '.join(cmd)} --model {model}", flush=True)
    t0 = time.perf_counter()
    subprocess.run([*cmd, "--model", str(model), "--out", str(out)], env=env, check=True)
    row = json.loads(out.read_text())
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def versions() -> dict[str, str]:
    """Python, the packages either side uses, and the relayrl commit (peer_common.versions)."""
    from peer_common import versions as peer_versions

    return peer_versions(("torch", "transformers", "trl", "accelerate", "datasets", "vllm"))


def print_table(name: str, row: dict[str, Any], generation: str) -> None:
    w, r, t = WORKLOADS[name], row["relayrl"], row["trl"]
    engine = "vLLM colocated" if generation == "vllm" else "model.generate"
    print(
        f"\nTRL GRPOTrainer ({engine}) vs relayrl rl, {name}: {w.shape} ({w.dtype}) on {row['device']}, "
        f"{w.prompts} prompts x {w.samples} samples, {'exactly' if w.ignore_eos else '<='} {w.new_tokens} new "
        f"tokens, mean of {r['steps_timed']} steps after 1 warm-up"
    )
    print(
        f"{'workload':<11}{'side':<9}"
        + "".join(f"{p + ' s':>14}" for p in PARTS)
        + f"{'median step s':>15}{'gen tok/step':>14}  ratio"
    )
    for side, s, ratio in (("relayrl", r, row["ratio"]), ("trl", t, 1.0)):
        cells = "".join(f"{s['seconds'][p]:>14.3f}" for p in PARTS)
        print(
            f"{name:<11}{side:<9}{cells}{s['step_median']:>15.3f}{s['gen_tokens_per_step']:>14,.0f}  {ratio:.2f}x"
        )
    print(
        f"generation: relayrl rollout + reward | TRL {engine}; experience: relayrl old log-probs + "
        "advantages | TRL decode + reward + advantages (+ old log-probs with vLLM); update: the rest of the step"
    )
    print(
        f"ratio = TRL step / relayrl step = {row['ratio']:.2f} on the means, {row['ratio_median']:.2f} on the "
        "medians (relayrl's speed relative to TRL's)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="cpu-tiny", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per side (after 1 warm-up step)")
    parser.add_argument(
        "--generation",
        default="generate",
        choices=["generate", "vllm"],
        help="TRL's generation: model.generate, or vLLM colocated (a GPU; settings in bench/peers/trl_vllm.py)",
    )
    parser.add_argument("--side", choices=["relayrl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:  # a child: --steps is the total here
        child(args.side, args.workload, args.model, args.steps, args.out, args.generation)
        return
    v = versions()
    if v["trl"] == "not installed":
        sys.exit("trl_grpo: TRL is not installed; pip install -e '.[bench]' (see pyproject's bench extra)")
    w = WORKLOADS[args.workload]
    if args.generation == "vllm":
        from trl_vllm import vllm_problem

        if w.device != "cuda":
            sys.exit(f"trl_grpo: --generation vllm needs a GPU workload (gpu-*), not {args.workload}")
        if problem := vllm_problem():
            sys.exit(f"trl_grpo: --generation vllm: {problem}")
    key = args.workload + ("-vllm" if args.generation == "vllm" else "")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if w.device == "cpu" and load > 0.5:
        # Measured here: with another process busy on the second core, a 2-thread `model.generate` of this
        # workload went from 0.3 s to 10 s (OpenMP threads wait on each other at every small op).
        print(f"trl_grpo: warning: load average {load:.1f} before the run; CPU step times will be noisy")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(w.shape, Path(tmp) / "model")
        sides = {}
        for side in ("relayrl", "trl"):
            sides[side] = run_side(side, args.workload, model, args.steps + 1, Path(tmp), args.generation)
            if out_dir:  # each side as soon as it is done: a failing TRL run still leaves relayrl's numbers
                (out_dir / f"peers_trl_grpo_{key}_{side}.json").write_text(json.dumps(sides[side], indent=2))
    row = {
        "workload": asdict(w),
        "trl_generation": args.generation,
        "device": sides["relayrl"].pop("device"),
        "trl_device": sides["trl"].pop("device"),
        "ratio": round(sides["trl"]["seconds"]["step"] / sides["relayrl"]["seconds"]["step"], 3),
        "ratio_median": round(sides["trl"]["step_median"] / sides["relayrl"]["step_median"], 3),
        **sides,
        "versions": v,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "load_avg_1min": [round(load, 2), round(os.getloadavg()[0], 2)],  # before, after
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    print_table(args.workload, row, args.generation)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[key] = row
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    if out_dir:
        (out_dir / f"peers_trl_grpo_{key}.json").write_text(json.dumps(row, indent=2) + "\n")
        print(f"wrote {out_dir / f'peers_trl_grpo_{key}.json'}")


if __name__ == "__main__":
    main()
