"""Peer benchmark: OpenRLHF's GRPO (DeepSpeed + vLLM, hybrid engine) vs `relayrl rl`, same model and batch.

    python bench/peers/openrlhf_grpo.py --gpus 1 --shape 0.5b        # both sides, 1 GPU
    python bench/peers/openrlhf_grpo.py --gpus 4 --shape 7b          # both sides, 4 GPUs
    python bench/peers/openrlhf_grpo.py --gpus 1 --shape 0.5b --steps 2 --sides openrlhf   # quick probe

Held equal (bench/peers/peer_common.py): the random model folder, the add2 prompts as raw text (no
--data.apply_chat_template), 64 prompts x 8 samples, <= 256 new tokens ending at EOS, temperature 1, GRPO
(--algo.advantage.estimator group_norm), PPO-clip 0.2, no reference / KL (--algo.kl.init_coef 0, which also
drops the reference model), one optimizer step per batch (--train.batch_size 512 = all samples, 1 epoch), AdamW
lr 1e-5 betas (0.9, 0.95) wd 0, constant schedule without warm-up, grad-norm clip 1.0, and the reward file
tests/trainers/data/digit_reward.py itself (--reward.remote_url accepts a reward_func(queries, prompts, labels)
.py file).

OpenRLHF (0.11.0, `python -m openrlhf.cli.train_ppo_ray`), set as its README's "Performance Tuning Guide" says
(Speed Optimizations, Memory Management, Batch Size Tuning and its Quick Start Template):
- Hybrid Engine: --train.colocate_all --vllm.enable_sleep --ds.enable_sleep, one vLLM engine per GPU
  (--vllm.num_engines = GPUs, --vllm.tensor_parallel_size 1: "minimize vLLM TP size"), and
  --vllm.gpu_memory_utilization 0.5 (the Quick Start Template's value for the hybrid engine);
- Prefix Caching: --vllm.enable_prefix_caching ("n_samples_per_prompt > 1");
- --vllm.sync_backend nccl ("Always"; OpenRLHF's default), CUDA graphs on (no --vllm.enforce_eager);
- Overlap Comm: --ds.overlap_comm ("Sufficient GPU memory"); no --ds.adam_offload ("When you have enough
  memory: Disable --adam_offload"). Memory (`--offload`, default auto = peer_common.offload_mode): "none" (0.5B;
  7B over 4 GPUs) as above; "states" (7B on one card of >= 125 GiB) the Hybrid Engine's --ds.enable_sleep
  alone (DeepSpeed moves the fp32 states to CPU memory while vLLM generates), which needs FusedAdam; with
  DeepSpeed's torch AdamW (below) --ds.adam_offload instead; "full" (7B on one 80 GB card, where the 97 GiB
  of fp32 weights + AdamW states cannot be on the GPU for the update) --ds.adam_offload: the fp32 states and
  the optimizer step (DeepSpeedCPUAdam, JIT-built with the host compiler) on the CPU;
- ZeRO stage 3 and gradient checkpointing, as its GRPO hybrid-engine example script
  (examples/scripts/train_grpo_ray_hybrid_engine.sh) runs;
- Batch sizes: "Maximize --micro_rollout_batch_size" / "--micro_train_batch_size": --rollout.micro_batch_size
  and --train.micro_batch_size 64 at 0.5B (64 padded samples of <= 320 tokens ~ relayrl's 16384-token
  micro-batch budget), 16 at 7B.
Not as the guide says, and why: Sample Packing (--ds.packing_samples, "Always") and Dynamic Batch
(--train.dynamic_batch_enable, which turns packing on) are off, because OpenRLHF forces
attn_implementation=flash_attention_2 with packing and flash-attn has no wheel for this torch 2.11 / CUDA 13
image (PyPI has the sdist only; building it needs the CUDA toolkit and hours): attention runs through PyTorch
SDPA (--ds.attn_implementation sdpa) on padded micro-batches. OpenRLHF imports flash_attn.bert_padding at
module level (openrlhf/models/ring_attn_utils.py), so the carried wheels hold flash-attn's pure-Python parts
(bert_padding, utils.distributed, ops.triton.cross_entropy; see bench/peers/build_wheels.sh), no CUDA kernels.
DeepSpeed builds its fused GPU Adam just in time (needs nvcc and ninja, carried as a wheel; TORCH_CUDA_ARCH_LIST
is set to the card's capability, "9.0", because DeepSpeed 0.19.5 derived "9.0a" on an H200 and failed to parse
it); without nvcc, --torch-adam auto switches to DeepSpeed's torch AdamW (its "torch_adam" optimizer parameter,
via bench/peers/ds_torch_adam/sitecustomize.py) and drops --ds.enable_sleep, whose offload_states accepts
FusedAdam only (both failures seen on an H200 on 2026-11-27; docs/benchmarks.md).
DeepCompile (--ds.deepcompile) is off: its compile time alone would exceed this benchmark's time budget.
Async training is off (both sides run synchronous, on-policy steps).

Step time: OpenRLHF's own per-step timer, the sum of the timing/* parts it logs with "Global step N"
(generation, make_experience, ppo_train, broadcast = its timing/step_total), and the wall time between step lines.
Writes $OUT/openrlhf-<shape>-<gpus>gpu.json (+ the logs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_cli
import peer_common as pc


def write_data(folder: Path, rows: int) -> Path:
    path = folder / "prompts.jsonl"
    with open(path, "w") as fh:
        for r in pc.prompt_rows(rows):
            fh.write(json.dumps({"input": r["input"], "label": r["label"]}) + "\n")
    return path


def arguments(
    model: Path,
    data: Path,
    gpus: int,
    shape: str,
    steps: int,
    tmp: Path,
    offload: str = "none",
    torch_adam: bool = False,
) -> list[str]:
    """train_ppo_ray's arguments for one run (the module doc says where each comes from). torch_adam: DeepSpeed's
    torch AdamW, whose states --ds.enable_sleep cannot offload (dropped; "states" then uses --ds.adam_offload)."""
    if offload not in pc.OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {pc.OFFLOAD_MODES}, got {offload!r}")
    micro = "64" if shape == "0.5b" else "16"
    args = [
        "--actor.num_nodes",
        "1",
        "--actor.num_gpus_per_node",
        str(gpus),
        "--ref.num_nodes",
        "1",
        "--ref.num_gpus_per_node",
        str(gpus),
        "--vllm.num_engines",
        str(gpus),
        "--vllm.tensor_parallel_size",
        "1",
        "--train.colocate_all",
        "--vllm.enable_sleep",
        "--ds.enable_sleep",
        "--vllm.gpu_memory_utilization",
        "0.5",
        "--vllm.enable_prefix_caching",
        "--vllm.sync_backend",
        "nccl",
        "--actor.model_name_or_path",
        str(model),
        "--reward.remote_url",
        str(pc.REWARD),
        "--data.prompt_dataset",
        str(data),
        "--data.input_key",
        "input",
        "--data.label_key",
        "label",
        "--data.max_samples",
        str(steps * pc.PROMPTS),
        "--data.max_len",
        str(pc.PROMPT_TOKENS + pc.NEW_TOKENS),
        "--rollout.max_new_tokens",
        str(pc.NEW_TOKENS),
        "--rollout.batch_size",
        str(pc.PROMPTS),
        "--rollout.n_samples_per_prompt",
        str(pc.SAMPLES),
        "--rollout.micro_batch_size",
        micro,
        "--rollout.temperature",
        "1.0",
        "--rollout.top_p",
        "1.0",
        "--train.batch_size",
        str(pc.PROMPTS * pc.SAMPLES),
        "--train.micro_batch_size",
        micro,
        "--train.max_epochs",
        "1",
        "--train.num_episodes",
        "1",
        "--train.seed",
        "0",
        "--algo.advantage.estimator",
        "group_norm",
        "--algo.kl.init_coef",
        "0",
        "--actor.eps_clip",
        "0.2",
        "--actor.adam.lr",
        str(pc.LR),
        "--actor.adam.betas",
        str(pc.BETAS[0]),
        str(pc.BETAS[1]),
        "--actor.adam.weight_decay",
        "0.0",
        "--actor.lr_scheduler",
        "constant",
        "--actor.lr_warmup_ratio",
        "0",
        "--actor.max_norm",
        "1.0",
        "--ds.zero_stage",
        "3",
        "--ds.param_dtype",
        "bf16",
        "--ds.attn_implementation",
        "sdpa",
        "--ds.overlap_comm",
        "--actor.gradient_checkpointing_enable",
        "--logger.logging_steps",
        "1",
        "--eval.steps",
        "-1",
        "--ckpt.save_steps",
        "-1",
        "--ckpt.output_dir",
        str(tmp / "out"),
        "--ckpt.path",
        str(tmp / "ckpt"),
    ]
    if offload == "full" or (offload == "states" and torch_adam):
        args.append("--ds.adam_offload")
    if torch_adam:  # DeepSpeed's offload_states (--ds.enable_sleep) asserts FusedAdam (2026-11-27 12:58)
        args.remove("--ds.enable_sleep")
    return args


def step_line(line: str) -> dict[str, float] | None:
    """OpenRLHF's "✨ Global step N: {...}" status line (a dict repr; numbers may print as np.float64(x))."""
    if "Global step" not in line or "timing/" not in line:
        return None
    parts = {
        k: pc.grab(line, f"timing/{k}") for k in ("generation", "make_experience", "ppo_train", "broadcast")
    }
    total = pc.grab(line, "timing/step_total")
    if total is None:
        if any(v is None for v in parts.values()):
            return None
        total = sum(v for v in parts.values() if v is not None)
    out = {"step": total, **{k: v for k, v in parts.items() if v is not None}}
    resp = pc.grab(line, "rollout/response_length_mean")
    n = pc.grab(line, "rollout/num_samples")
    if resp is not None:
        out["gen_tokens"] = resp * (n or pc.PROMPTS * pc.SAMPLES)
    return out


def has_nvcc() -> bool:
    cuda_home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    return bool(shutil.which("nvcc")) or os.access(os.path.join(cuda_home, "bin", "nvcc"), os.X_OK)


def cuda_arch() -> str:
    """The card's compute capability as DeepSpeed's JIT builder parses it ("9.0"). Unset, DeepSpeed 0.19.5
    derived "9.0a" on an H200 and died parsing it (ValueError: invalid literal for int() with base 10: '0a',
    2026-11-27 12:43), so FusedAdam never built."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired, ValueError):
        r = subprocess.run(  # nvidia-smi: no CUDA context in this process
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        caps = [c.strip() for c in r.stdout.splitlines() if re.fullmatch(r"\d+\.\d+", c.strip())]
        if caps:
            return caps[0]
    return ""


def ds_arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST for DeepSpeed's JIT builds: the environment's when DeepSpeed can parse every entry
    ("9.0", "9.0+PTX"), else the card's (cuda_arch, "9.0" when unknown). The GPU image's own value carries an
    arch-specific entry ("9.0a") that DeepSpeed 0.19.5 cannot sort (ValueError: invalid literal for int() with
    base 10: '0a', 2026-11-28 on 4 x H100: neither FusedAdam nor DeepSpeedCPUAdam built)."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    parts = env.replace(";", " ").split()
    if parts and all(re.fullmatch(r"\d+\.\d+(\+PTX)?", p) for p in parts):
        return env
    return cuda_arch() or "9.0"


def prebuild_ops(timeout_s: float = 240) -> dict[str, str]:
    """JIT-build DeepSpeed's FusedAdam (GPU; --torch-adam no needs it) and DeepSpeedCPUAdam (--ds.adam_offload
    needs it) once, side by side in child processes, into torch's extension cache that every later OpenRLHF
    run on this machine loads: {"fused_adam": "ok" or the error's last line, "cpu_adam": ...}. Needs nvcc;
    run_cells.py calls it while the model folders are built."""
    env = pc.peer_env({"TORCH_CUDA_ARCH_LIST": ds_arch_list()})
    procs = {
        op: subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"from deepspeed.ops.op_builder import {cls}; {cls}().load(); print('ok')",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for op, cls in (("fused_adam", "FusedAdamBuilder"), ("cpu_adam", "CPUAdamBuilder"))
    }
    out: dict[str, str] = {}
    for op, proc in procs.items():
        try:
            text, _ = proc.communicate(timeout=timeout_s)
            lines = [x for x in text.splitlines() if x.strip()]
            out[op] = "ok" if proc.returncode == 0 else (lines[-1] if lines else f"exit {proc.returncode}")
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out[op] = f"timeout after {timeout_s:.0f}s"
    return out


def run_openrlhf(
    peer_model: Path,
    gpus: int,
    shape: str,
    steps: int,
    timeout_s: float,
    torch_adam: bool,
    peer_path: str = "",
    offload: str = "none",
) -> dict[str, Any]:
    out = pc.out_dir()
    with tempfile.TemporaryDirectory(prefix="openrlhf_") as t:
        tmp = Path(t)
        data = write_data(tmp, steps * pc.PROMPTS + pc.PROMPTS)
        cmd = [
            sys.executable,
            "-m",
            "openrlhf.cli.train_ppo_ray",
            *arguments(peer_model, data, gpus, shape, steps, tmp, offload, torch_adam),
        ]
        (out / f"openrlhf-{shape}-{gpus}gpu.cmd").write_text(" \\\n  ".join(cmd) + "\n")
        env = pc.peer_env({"RAY_TMPDIR": str(tmp / "ray")})
        env["TORCH_CUDA_ARCH_LIST"] = ds_arch_list()  # the image's "9.0a" breaks DeepSpeed
        if peer_path:  # this peer's own packages first (e.g. the transformers release it pins)
            env["PYTHONPATH"] = os.pathsep.join([peer_path, env["PYTHONPATH"]])
        if torch_adam:  # DeepSpeed's torch AdamW instead of its JIT-built FusedAdam (see ds_torch_adam/)
            env["PYTHONPATH"] = os.pathsep.join(
                [str(Path(__file__).resolve().parent / "ds_torch_adam"), env["PYTHONPATH"]]
            )
        return pc.run_logged(
            cmd, env, out / f"openrlhf-{shape}-{gpus}gpu.log", timeout_s, step_line, cwd=tmp, stop_after=steps
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    peer_cli.add_args(parser, "openrlhf")
    parser.add_argument(
        "--torch-adam",
        default="auto",
        choices=["auto", "yes", "no"],
        help="DeepSpeed torch AdamW instead of FusedAdam (a JIT CUDA build): auto = when no nvcc",
    )
    args = parser.parse_args()
    peer_cli.finish_args(args, "openrlhf")
    torch_adam = args.torch_adam == "yes" or (args.torch_adam == "auto" and not has_nvcc())
    row: dict[str, Any] = {
        "peer": "openrlhf",
        "shape": args.shape,
        "rl_step_shape": pc.RL_SHAPES[args.shape],
        "gpus": args.gpus,
        "device": pc.gpu_name(),
        "warmup": args.warmup,
        "steps": args.steps,
        "batch": f"{pc.PROMPTS}x{pc.SAMPLES}, <= {pc.NEW_TOKENS} new tokens",
        "versions": pc.versions(("torch", "transformers", "vllm", "ray", "openrlhf", "deepspeed")),
        "deepspeed_optimizer": (
            "torch.optim.AdamW (torch_adam; --ds.enable_sleep dropped: DeepSpeed offloads FusedAdam only)"
            if torch_adam
            else "FusedAdam (JIT-built for TORCH_CUDA_ARCH_LIST)"
        ),
    }

    def run_peer(peer_model: Path, timeout_s: float, offload: str) -> dict[str, Any]:
        return run_openrlhf(
            peer_model, args.gpus, args.shape, args.steps, timeout_s, torch_adam, args.peer_path, offload
        )

    peer_cli.run_sides(args, "openrlhf", row, run_peer)


if __name__ == "__main__":
    main()
