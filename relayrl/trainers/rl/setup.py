"""What a `relayrl rl` run (and `relayrl eval`) sets up before any role starts.

run = prepare_run(cfg, default_dir="runs/rl")
    the config validated (relayrl.trainers.rl.validate), the run folder prepared and checked against a
    run it continues, config.yaml written, the process seeded, the tokenizer loaded, the prompt sets
    built (task rows or datasets) and their labels checked against the reward; train.max_steps 0 becomes
    one pass over the training prompts
-> RunSetup(cfg, run_dir, tokenizer, prompts)

driver_threads(cfg) -> int          the controller process's torch CPU threads (run_rl sets them first)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from relayrl.config.base import save_yaml
from relayrl.config.rl import ResolvedRL, RLConfig
from relayrl.models.loading import load_tokenizer, resolve_source
from relayrl.trainers.rl.prompts import Prompts, build_prompts, check_labels
from relayrl.trainers.rl.validate import validate_rl
from relayrl.training.setup import check_config_change, prepare_run_dir
from relayrl.workers.builders import setup_process


@dataclass(kw_only=True, slots=True)
class RunSetup:
    """A run ready to start its roles."""

    cfg: ResolvedRL
    """The validated, resolved config (train.max_steps resolved too)."""
    run_dir: Path
    """The run folder (config.yaml written)."""
    tokenizer: Any
    """The policy's tokenizer (HF PreTrainedTokenizer)."""
    prompts: Prompts
    """Training and eval prompt sets."""


def prepare_run(cfg: RLConfig, *, default_dir: str = "runs/rl") -> RunSetup:
    """See the module doc. `default_dir`: the run folder when train.output_dir is empty."""
    cfg = validate_rl(cfg)
    run_dir = prepare_run_dir(Path(cfg.train.output_dir or default_dir), cfg.ckpt, "relayrl rl")
    a = cfg.algo  # the policy's schedule spans max_steps x epochs x mini_batches optimizer steps
    check_config_change(run_dir, cfg, "relayrl rl", updates_per_step=a.epochs * a.mini_batches)
    save_yaml(cfg, run_dir / "config.yaml")
    setup_process(cfg.train.seed)
    m = cfg.model
    resolve_source(m.name_or_path)  # a missing path fails here, naming model.name_or_path
    tokenizer = load_tokenizer(
        m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
    )
    prompts = build_prompts(cfg, run_dir, tokenizer)
    check_labels(cfg, prompts)
    if cfg.train.max_steps == 0:  # one pass over the training prompts
        steps = -(-len(prompts.train) // cfg.rollout.prompts_per_step)
        cfg = ResolvedRL(replace(cfg, train=replace(cfg.train, max_steps=steps)))
        print(
            f"relayrl rl: train.max_steps 0 = one pass over the {len(prompts.train)} training prompts: "
            f"{steps} steps of {cfg.rollout.prompts_per_step} prompts"
        )
    return RunSetup(cfg=cfg, run_dir=run_dir, tokenizer=tokenizer, prompts=prompts)


DRIVER_THREADS_GPU = 8
"""The driver's torch CPU threads on a GPU run (at most). Its CPU tensor work (collating trajectories, shaping
rewards, advantages) is many small ops, which a 64-thread pool slows: on one H200 host (64 cores) the 1-GPU
weak-scaling row's experience pass took 0.335 s at 512 samples with up to 64 threads, while the recipe's GRPO runs
(OMP_NUM_THREADS=8) took 0.02 s for the same pass at 512 samples (2026-11-27, docs/distributed.md). With
dist.offload the optimizer steps on the CPU (in this process in local mode), so those runs keep up to 64."""


def driver_threads(cfg: RLConfig) -> int:
    """torch CPU threads for the controller process: 2 on a CPU run (its ranks share the cores), at most
    DRIVER_THREADS_GPU on a GPU run, at most 64 with dist.offload; never more than torch's default."""
    cap = 2 if cfg.train.device == "cpu" else (64 if cfg.dist.offload else DRIVER_THREADS_GPU)
    return max(1, min(torch.get_num_threads(), cap))
