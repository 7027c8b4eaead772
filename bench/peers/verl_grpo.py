"""Peer benchmark: verl's GRPO (FSDP + vLLM rollout) vs `relayrl rl`, same model, prompts, reward and batch.

    python bench/peers/verl_grpo.py --gpus 1 --shape 0.5b            # both sides, 1 GPU
    python bench/peers/verl_grpo.py --gpus 4 --shape 7b              # both sides, 4 GPUs
    python bench/peers/verl_grpo.py --gpus 1 --shape 0.5b --steps 2 --sides verl   # quick probe

Held equal (bench/peers/peer_common.py): the random model folder, the add2 prompts as raw text, 64 prompts x 8
samples, <= 256 new tokens ending at EOS, temperature 1, GRPO (group mean/std), PPO-clip 0.2, token-mean loss,
no reference / KL, one AdamW step per batch (lr 1e-5, betas 0.9/0.95, wd 0, constant, clip 1.0), the digit
reward (bench/peers/verl_reward.py wraps tests/trainers/data/digit_reward.py).

verl (0.9.1, `python -m verl.trainer.main_ppo`, its hybrid engine: actor and vLLM rollout on the same GPUs),
set as its Performance Tuning Guide (docs/perf/perf_tuning.rst, "Last updated: 07/17/2025") says:
- rollout: vLLM, async mode (verl's default), tensor_model_parallel_size 1 (guide: the smallest TP, more
  replicas; one replica per GPU), gpu_memory_utilization 0.6 (guide: 0.5-0.7), max_num_batched_tokens 8192 and
  chunked prefill (guide: > 2048; verl's defaults), max_num_seqs 512 (guide: raise it when the cache is under-used;
  512 = the whole batch in one wave), CUDA graphs on (enforce_eager False, verl's default), prefix caching on
  (verl's default), free_cache_engine (sleep during training, verl's default);
- training: FSDP2 (guide: "Migrating to FSDP2"), use_dynamic_bsz True (guide), ppo_max_token_len_per_gpu
  16384 (guide: >= 2 x (prompt + response) = 640, "increase it to get higher throughput"; 16384 = relayrl's own
  micro-batch token budget for this shape), log_prob_max_token_len_per_gpu 32768 (guide: forward-only can be
  ~2x), gradient checkpointing on (guide), forward_prefetch True (guide), torch.compile of the log-prob
  function on (verl's default), balance_batch on (verl's default);
- memory (`--offload`, default auto = peer_common.offload_mode for the visible cards): "none" (0.5B; 7B over 4
  GPUs: 24 GiB of states a GPU) keeps everything on the GPUs; "states" (7B on one card of >= 125 GiB) sets
  fsdp_config.param_offload + optimizer_offload, verl's offload that parks the fp32 weights and AdamW states
  in CPU memory while vLLM generates and loads them back for the update (guide: gpu_memory_utilization "if
  model parameters and optimizer states are not offloaded"); "full" (7B on one 80 GB card, where that update
  would need ~104 GB on the GPU: verl's engine loads every state back, workers/engine/fsdp/transformer_impl.py
  `to`) sets fsdp_config.offload_policy=True instead (verl's "Only for FSDP2: offload param/grad/optimizer
  during train", FSDP2's CPUOffloadPolicy: the optimizer step runs on the CPU), as relayrl's dist.offload.
Held equal beyond the guide: torch's fused AdamW kernel, relayrl's optimizer (optim.override_optimizer_config
{fused: True}, passed to torch.optim.AdamW; verl's default is torch's per-tensor loop, which at 7B under
offload_policy would run the CPU step over 6.5B parameters ~11x slower, bench measurement in
relayrl/training/optim.py).
Not as the guide says, and why: use_remove_padding (guide: True) is False by default here, because its fast
path is flash-attn's varlen kernels and flash-attn has no wheel for this torch 2.11 / CUDA 13 image (PyPI has the
sdist only; building it needs the CUDA toolkit and hours); attention runs through PyTorch SDPA
(override_config.attn_implementation=sdpa). `--remove-padding` turns it on anyway (SDPA with transformers'
packed-sequence block mask: correct, but dense attention over each packed micro-batch). LigerKernel and
use_fused_kernels are off (optional extras, not installed). Validation and checkpoints are off on both sides.

Step time: verl's own `timing_s/step` per step from its console logger, and the wall time between step lines.
Writes $OUT/verl-<shape>-<gpus>gpu.json (+ the logs).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_cli
import peer_common as pc

REWARD_WRAPPER = Path(__file__).resolve().parent / "verl_reward.py"


def write_data(folder: Path, rows: int) -> Path:
    """verl's RLHFDataset parquet: chat-message prompts (the identity template gives back the raw text)."""
    import pandas as pd

    recs = [
        {
            "data_source": "digits",
            "prompt": [{"role": "user", "content": r["input"]}],
            "reward_model": {"style": "rule", "ground_truth": r["label"]},
            "extra_info": {"index": i},
        }
        for i, r in enumerate(pc.prompt_rows(rows))
    ]
    path = folder / "train.parquet"
    pd.DataFrame(recs).to_parquet(path)
    return path


def overrides(
    model: Path, data: Path, gpus: int, shape: str, steps: int, tmp: Path, rmpad: bool, offload: str = "none"
) -> list[str]:
    """verl's Hydra overrides for one run (the module doc says where each comes from)."""
    if offload not in pc.OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {pc.OFFLOAD_MODES}, got {offload!r}")
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=True",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={data}",
        f"data.val_files={data}",
        f"data.train_batch_size={pc.PROMPTS}",
        f"data.max_prompt_length={pc.PROMPT_TOKENS}",
        f"data.max_response_length={pc.NEW_TOKENS}",
        "data.filter_overlong_prompts=False",
        "data.truncation=error",
        "data.shuffle=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        f"actor_rollout_ref.model.use_remove_padding={rmpad}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.optim.lr={pc.LR}",
        f"actor_rollout_ref.actor.optim.betas=[{pc.BETAS[0]},{pc.BETAS[1]}]",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.actor.optim.lr_scheduler_type=constant",
        "actor_rollout_ref.actor.optim.clip_grad=1.0",
        "actor_rollout_ref.actor.optim.override_optimizer_config={fused:True}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={pc.PROMPTS}",
        "actor_rollout_ref.actor.ppo_epochs=1",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.use_kl_loss=False",
        "actor_rollout_ref.actor.entropy_coeff=0",
        f"actor_rollout_ref.actor.fsdp_config.param_offload={offload == 'states'}",
        f"actor_rollout_ref.actor.fsdp_config.optimizer_offload={offload == 'states'}",
        f"actor_rollout_ref.actor.fsdp_config.offload_policy={offload == 'full'}",
        "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={pc.SAMPLES}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
        f"actor_rollout_ref.rollout.max_num_seqs={pc.PROMPTS * pc.SAMPLES}",
        "actor_rollout_ref.rollout.enable_chunked_prefill=True",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=32768",
        f"reward.custom_reward_function.path={REWARD_WRAPPER}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.critic_warmup=0",
        "trainer.total_epochs=1",
        f"trainer.total_training_steps={steps}",
        f"trainer.n_gpus_per_node={gpus}",
        "trainer.nnodes=1",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
        "trainer.project_name=peers",
        "trainer.experiment_name=verl_grpo",
        f"hydra.run.dir={tmp / 'hydra'}",
    ]


def step_line(line: str) -> dict[str, float] | None:
    """verl's console logger: "step:N - key:value - ..." (Ray prefixes the actor's name)."""
    if "step:" not in line or "timing_s/step:" not in line:
        return None
    step = pc.grab(line, "timing_s/step")
    if step is None:
        return None
    out = {"step": step}
    for key, name in (
        ("timing_s/gen", "gen"),
        ("timing_s/update_actor", "update"),
        ("timing_s/old_log_prob", "old_log_prob"),
    ):
        v = pc.grab(line, key)
        if v is not None:
            out[name] = v
    resp = pc.grab(line, "response_length/mean")
    if resp is not None:
        out["gen_tokens"] = resp * pc.PROMPTS * pc.SAMPLES
    return out


def run_verl(
    peer_model: Path,
    gpus: int,
    shape: str,
    steps: int,
    timeout_s: float,
    rmpad: bool,
    peer_path: str = "",
    offload: str = "none",
) -> dict[str, Any]:
    out = pc.out_dir()
    with tempfile.TemporaryDirectory(prefix="verl_") as t:
        tmp = Path(t)
        data = write_data(tmp, steps * pc.PROMPTS + pc.PROMPTS)
        cmd = [
            sys.executable,
            "-m",
            "verl.trainer.main_ppo",
            *overrides(peer_model, data, gpus, shape, steps, tmp, rmpad, offload),
        ]
        (out / f"verl-{shape}-{gpus}gpu.cmd").write_text(" \\\n  ".join(cmd) + "\n")
        env = pc.peer_env({"HYDRA_FULL_ERROR": "1", "RAY_TMPDIR": str(tmp / "ray")})
        # verl's rollout is vLLM's HTTP server in a Ray actor: with the in-process engine (0, relayrl's and
        # OpenRLHF's setting) it stalled after printing its arguments (2026-11-27 10:21); with vLLM's own
        # engine process (1, vLLM's default) it loaded and captured its CUDA graphs (12:43)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = os.environ.get("VERL_VLLM_MULTIPROCESSING", "1")
        if peer_path:  # this peer's own packages first (e.g. the transformers release it pins)
            env["PYTHONPATH"] = os.pathsep.join([peer_path, env["PYTHONPATH"]])
        return pc.run_logged(
            cmd, env, out / f"verl-{shape}-{gpus}gpu.log", timeout_s, step_line, cwd=tmp, stop_after=steps
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    peer_cli.add_args(parser, "verl")
    parser.add_argument("--remove-padding", action="store_true", help="verl use_remove_padding=True (SDPA)")
    args = parser.parse_args()
    peer_cli.finish_args(args, "verl")
    row: dict[str, Any] = {
        "peer": "verl",
        "shape": args.shape,
        "rl_step_shape": pc.RL_SHAPES[args.shape],
        "gpus": args.gpus,
        "device": pc.gpu_name(),
        "warmup": args.warmup,
        "steps": args.steps,
        "batch": f"{pc.PROMPTS}x{pc.SAMPLES}, <= {pc.NEW_TOKENS} new tokens",
        "verl_remove_padding": args.remove_padding,
        "versions": pc.versions(("torch", "transformers", "vllm", "ray", "verl", "tensordict", "flash_attn")),
    }

    def run_peer(peer_model: Path, timeout_s: float, offload: str) -> dict[str, Any]:
        return run_verl(
            peer_model,
            args.gpus,
            args.shape,
            args.steps,
            timeout_s,
            args.remove_padding,
            args.peer_path,
            offload,
        )

    peer_cli.run_sides(args, "verl", row, run_peer)


if __name__ == "__main__":
    main()
