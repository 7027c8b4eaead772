"""EngineWorker: a rollout engine of its own (`dist.num_engines` N > 0, ray mode), beside the trainer's GPUs.

    rollout(samples, seed, eval=False) -> list[Trajectory]   this engine's share of the prompts (merged in
                                                             rank order: the engines' shares concatenate back)
    join_weights(address, port, world)                       enter the weight group (rank 1 + engine rank)
    receive_weights(version)                                 take the policy's new weights (a broadcast from
                                                             the policy's rank 0), as weight version `version`
    weight_checksum() -> float                               sum of |w| over the weights (tests compare it)

Each engine actor holds a full copy of the policy in the inference dtype (bf16 on a GPU) and the same engine
and agent executor the policy builds when the engine is colocated (relayrl.workers.builders), so rollout
results do not depend on where the engine runs: request seeds derive from (step seed, prompt index).

Weights (relayrl/distributed/weight_group.py): after each update the policy refreshes its full replica (a
cast-copy, or FSDP all-gathers across its ranks) and its rank 0 broadcasts every parameter, in
`named_parameters()` order, to the engines over NCCL (gloo on CPUs); each engine receives in the same order
straight into its parameters while its rounds are paused (`engine.paused()`), so requests in flight (async
training) continue under the new weights, their later tokens tagged with the new version.

vLLM (`rollout.engine vllm`): the actor holds no model of its own; it starts vLLM over the policy's folder with
`dist.engine_tp` GPUs (tensor parallelism: the actor's placement bundle has that many GPUs, and vLLM runs one
worker process per GPU), and each vLLM worker enters the weight group itself, as rank
1 + engine rank x engine_tp + its tp rank, receiving the broadcast straight into its model's loader
(relayrl/workers/vllm_receiver.py). The weight group then has 1 + num_engines x
engine_tp ranks (`weight_ranks`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import torch

from relayrl.agents.base import Trajectory
from relayrl.config.components import ModelConfig
from relayrl.config.rl import EvalConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.distributed.group import merged, my_share, rank
from relayrl.rollout.base import SamplingParams
from relayrl.training.setup import resolve_device
from relayrl.workers.builders import build_frozen, build_generation, setup_process


def sampling_params(rollout: RolloutConfig, evaluation: EvalConfig, *, eval: bool = False) -> SamplingParams:
    """Training (or eval) sampling settings of a step (seed set per request)."""
    if eval:
        return SamplingParams(
            n=evaluation.n_samples, temperature=evaluation.temperature, max_new_tokens=rollout.max_new_tokens
        )
    return SamplingParams(
        n=rollout.n_samples,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=rollout.max_new_tokens,
    )


def generate_share(
    executor: Any, base: SamplingParams, samples: list[PromptSample], seed: int, budget: int
) -> list[Trajectory]:
    """This rank's contiguous share of `samples` (balanced by prompt + `budget` tokens), n trajectories per
    prompt, grouped; request seeds derive from `seed` and each prompt's dataset index (exact resume)."""
    mine = [samples[i] for i in my_share([len(s.prompt_ids) + budget for s in samples])]

    async def run() -> list[list[Trajectory]]:
        jobs = [
            executor.execute(s, replace(base, seed=(seed * 1_000_003 + s.index * 7919) % (2**31)))
            for s in mine
        ]
        return list(await asyncio.gather(*jobs))

    with torch.no_grad():
        groups = asyncio.run(run())
    return [t for g in groups for t in g]


@dataclass(kw_only=True, slots=True)
class EngineSpec:
    """What an engine actor reads."""

    model: ModelConfig
    """The policy's weights at the start (later ones arrive by broadcast)."""
    rollout: RolloutConfig
    """Engine, sampling, agent executor."""
    eval: EvalConfig
    """Eval sampling."""
    seed: int = 0
    """Process seed."""
    device: str = "auto"
    """auto / cpu / cuda."""
    task_name: str = ""
    """Built-in multi-turn task driving a `multi` agent."""
    step_timeout: float = 60.0
    """Timeout of one agent environment step."""
    tp: int = 1
    """GPUs of this engine (tensor parallelism; vllm only)."""


def weight_ranks(num_engines: int, tp: int) -> int:
    """Ranks of the weight group: the policy's rank 0 + every engine's tp workers."""
    return 1 + num_engines * tp


class EngineWorker:
    """A separate rollout engine (see module doc)."""

    def __init__(self, spec: EngineSpec) -> None:
        from relayrl.models.loading import load_tokenizer

        setup_process(spec.seed)
        self.spec = spec
        self.device = resolve_device(spec.device)
        m = spec.model
        self.tokenizer = load_tokenizer(
            m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
        )
        self.vllm = spec.rollout.engine == "vllm"
        # vllm loads the folder itself (in its tp workers); native / hf generate from this actor's copy
        self.model = None if self.vllm else build_frozen(m, self.device)
        self.engine, self.executor = build_generation(
            spec.rollout,
            spec.eval,
            self.model,
            self.tokenizer,
            source=m,
            task_name=spec.task_name,
            step_timeout=spec.step_timeout,
            tp=spec.tp if self.vllm else 0,
        )
        self.group: Any = None

    @merged("concat")
    def rollout(self, samples: list[PromptSample], seed: int, eval: bool = False) -> list[Trajectory]:
        """n trajectories per prompt of this engine's share of `samples` (see `generate_share`)."""
        base = sampling_params(self.spec.rollout, self.spec.eval, eval=eval)
        return generate_share(self.executor, base, samples, seed, self.spec.rollout.max_new_tokens)

    def join_weights(
        self, address: str, port: int, world: int, backend: str, timeout_s: float, layout: list | None = None
    ) -> None:
        """Enter the weight group as rank 1 + this engine's rank (the policy's rank 0 is rank 0); vllm: its
        workers enter as ranks 1 + engine rank x tp + tp rank, keeping the sender's `layout`."""
        if self.vllm:
            from relayrl.workers.vllm_receiver import join_weight_group

            first = 1 + rank() * self.spec.tp
            self.engine.run_in_workers(
                join_weight_group, address, port, first, world, backend, timeout_s, layout
            )
            return
        from relayrl.distributed.weight_group import WeightGroup

        self.group = WeightGroup(
            address, port, rank=1 + rank(), world=world, backend=backend, timeout_s=timeout_s
        )

    def weight_layout(self) -> list[tuple[str, tuple[int, ...], str]] | None:
        """(name, shape, dtype) of every parameter in broadcast order (checked against the sender's); None for
        vllm, which loads whatever HF-named tensors the sender's layout lists (checked on the first receive)."""
        if self.vllm:
            return None
        return [(n, tuple(p.shape), str(p.dtype)) for n, p in self.model.named_parameters()]

    @torch.no_grad()
    def receive_weights(self, version: int) -> None:
        """Every parameter from the policy's rank 0, in place, while no round runs; then version `version`."""
        if self.vllm:
            from relayrl.workers.vllm_receiver import receive_weights

            self.engine.load_in_workers(receive_weights, version=version)
            return
        with self.engine.paused():
            for p in self.model.parameters():
                self.group.broadcast(p.data)
            self.engine.load_weights(None, version=version)

    @merged("concat")
    @torch.no_grad()
    def weight_checksum(self) -> list[float]:
        """[sum of |w| over every parameter, in float64], one per engine (native / hf)."""
        if self.model is None:
            raise RuntimeError("weight_checksum: a vllm engine's weights live in its workers")
        return [float(sum(p.detach().double().abs().sum() for p in self.model.parameters()))]

    def close(self) -> None:
        self.engine.close()
