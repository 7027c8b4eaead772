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
- Overlap Comm: --ds.overlap_comm ("Sufficient GPU memory"); no --ds.adam_offload ("when you have enough
  memory": off), except 7B on 1 GPU, where the fp32 AdamW states of 7.6B params do not fit (then on);
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
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_common as pc


def write_data(folder: Path, rows: int) -> Path:
    path = folder / "prompts.jsonl"
    with open(path, "w") as fh:
        for r in pc.prompt_rows(rows):
            fh.write(json.dumps({"input": r["input"], "label": r["label"]}) + "\n")
    return path


def arguments(model: Path, data: Path, gpus: int, shape: str, steps: int, tmp: Path) -> list[str]:
    offload = shape == "7b" and gpus == 1
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
    if offload:
        args.append("--ds.adam_offload")
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
    import torch

    if not torch.cuda.is_available():
        return ""
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def run_openrlhf(
    peer_model: Path,
    gpus: int,
    shape: str,
    steps: int,
    timeout_s: float,
    torch_adam: bool,
    peer_path: str = "",
) -> dict[str, Any]:
    out = pc.out_dir()
    with tempfile.TemporaryDirectory(prefix="openrlhf_") as t:
        tmp = Path(t)
        data = write_data(tmp, steps * pc.PROMPTS + pc.PROMPTS)
        cmd = [
            sys.executable,
            "-m",
            "openrlhf.cli.train_ppo_ray",
            *arguments(peer_model, data, gpus, shape, steps, tmp),
        ]
        if torch_adam:  # DeepSpeed's offload_states (--ds.enable_sleep) asserts FusedAdam (2026-11-27 12:58)
            cmd.remove("--ds.enable_sleep")
        (out / f"openrlhf-{shape}-{gpus}gpu.cmd").write_text(" \\\n  ".join(cmd) + "\n")
        env = pc.peer_env({"RAY_TMPDIR": str(tmp / "ray")})
        env.setdefault("TORCH_CUDA_ARCH_LIST", cuda_arch())
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
    parser.add_argument("--gpus", type=int, default=1, choices=[1, 2, 4, 8])
    parser.add_argument("--shape", default="0.5b", choices=sorted(pc.RL_SHAPES))
    parser.add_argument("--steps", type=int, default=0, help="steps per side (default 6 at 0.5b, 4 at 7b)")
    parser.add_argument(
        "--warmup", type=int, default=-1, help="leading steps not timed (default 2 / 1 at 7b)"
    )
    parser.add_argument("--peer-path", default="", help="a folder put first on the peer's PYTHONPATH only")
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole command (all sides)")
    parser.add_argument("--sides", default="relayrl,openrlhf", help="comma list: relayrl, openrlhf")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per side before it is killed")
    parser.add_argument(
        "--torch-adam",
        default="auto",
        choices=["auto", "yes", "no"],
        help="DeepSpeed torch AdamW instead of FusedAdam (a JIT CUDA build): auto = when no nvcc",
    )
    args = parser.parse_args()
    args.steps = args.steps or (6 if args.shape == "0.5b" else 4)
    args.warmup = args.warmup if args.warmup >= 0 else (2 if args.shape == "0.5b" else 1)
    budget = pc.Budget(args.budget)
    torch_adam = args.torch_adam == "yes" or (args.torch_adam == "auto" and not has_nvcc())
    name = f"openrlhf-{args.shape}-{args.gpus}gpu"
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
    pc.write_result(name, row)
    with tempfile.TemporaryDirectory(prefix="peers_model_") as t:
        model, peer_model = pc.build_models_in_child(args.shape, Path(t))
        for side in args.sides.split(","):
            pc.stop_ray()
            if side == "relayrl":
                res = pc.run_relayrl(args.shape, args.gpus, args.steps, model, budget.left(args.timeout))
            else:
                res = run_openrlhf(
                    peer_model,
                    args.gpus,
                    args.shape,
                    args.steps,
                    budget.left(args.timeout),
                    torch_adam,
                    args.peer_path,
                )
            row[side] = {**pc.summarise(res["steps"], args.warmup), **res}
            pc.write_result(name, row)  # partial results as each side ends
        pc.stop_ray()
    pc.compare("openrlhf", row)
    print(f"wrote {pc.write_result(name, row)}")


if __name__ == "__main__":
    main()
