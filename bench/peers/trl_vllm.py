"""TRL GRPOTrainer with vLLM colocated on one GPU: the settings, each with where it comes from.

One definition for bench/peers/trl_grpo.py (`--generation vllm`) and examples/recipes/trl_recipe.py. The values
are TRL 1.16.0's recommended one-GPU setup: its GRPO guide (docs/source/grpo_trainer.md, "Speed up training
with vLLM-powered generation", Option 1: colocate mode) and the GRPOConfig field docs
(trl/trainer/grpo_config.py). Server mode is not an option on one GPU: the guide says the server must use
different GPUs than the trainer.

What TRL then does by itself (trl/generation/vllm_generation.py, VLLMGeneration._init_vllm, not settable from
GRPOConfig): `LLM(distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
max_num_seqs=per_device_train_batch_size * steps_per_generation, logprobs_mode="processed_logprobs", seed=rank)`
in the trainer's process, the model's dtype from its folder; before each generation after an optimizer step it
copies the trained weights into vLLM (`sync_weights`, inside `_generate_single_turn`, so timed as generation).
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

VLLM_COLOCATE: dict[str, tuple[object, str]] = {
    "use_vllm": (
        True,
        "grpo_trainer.md: vLLM-powered generation (speeding_up_training.md: the first speed-up)",
    ),
    "vllm_mode": ("colocate", "grpo_trainer.md Option 1, the default mode; server mode needs separate GPUs"),
    "vllm_gpu_memory_utilization": (
        0.3,
        "GRPOConfig default; grpo_trainer.md: adjust it only against under-use or OOM. 0.3 of an 80 GB card "
        "holds the weights and the whole generation batch's KV cache of these models many times over",
    ),
    "vllm_enable_sleep_mode": (
        False,
        "GRPOConfig default; grpo_trainer.md / reducing_memory_usage.md: turn it on only on OOM (it offloads "
        "weights and KV cache around every optimizer step, which costs time)",
    ),
    "vllm_tensor_parallel_size": (1, "GRPOConfig default; one GPU"),
    "vllm_model_impl": ("vllm", "GRPOConfig default: vLLM's own model code"),
    "vllm_importance_sampling_correction": (
        True,
        "GRPOConfig default; grpo_trainer.md tip: truncated importance sampling is on by default with vLLM "
        "(it adds one log-prob forward over the generation batch per step)",
    ),
}
"""GRPOConfig fields of the vLLM-colocated setup: field -> (value, where the value comes from)."""


def vllm_config_kwargs() -> dict[str, Any]:
    """The GRPOConfig keyword arguments of VLLM_COLOCATE."""
    return {k: v for k, (v, _) in VLLM_COLOCATE.items()}


def in_process_engine() -> None:
    """vLLM's engine in this process (not a separate engine-core process): TRL's colocated weight copy reaches
    the model through `llm.llm_engine.model_executor.driver_worker` (vllm_generation.py), which needs that."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def vllm_problem() -> str:
    """Why TRL cannot use vLLM here, or "" when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not importable: install vllm==0.26.0 (pyproject's vllm extra) or put its bundle on PYTHONPATH"
    return ""
