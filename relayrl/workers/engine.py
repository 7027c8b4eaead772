"""EngineWorker: a rollout engine of its own (`dist.num_engines` N > 0, ray mode), beside the trainer's GPUs.

    rollout(samples, seed, eval=False) -> list[Trajectory]   this engine's share of the prompts (merged in
                                                             rank order: the engines' shares concatenate back)
    weight_layout() -> Layout | None                         what its receiver expects (checked by the controller)
    join_weights(channel, layout)                            enter the weight group (after the policy's rank 0)
    receive_weights(version)                                 take the policy's new weights (a broadcast from
                                                             the policy's rank 0), as weight version `version`
    weight_checksum() -> float                               sum of |w| over the weights (tests compare it)

Each engine actor holds a full copy of the policy in the inference dtype (bf16 on a GPU) and the same engine
and agent executor the policy builds when the engine is colocated (relayrl.workers.builders), so rollout
results do not depend on where the engine runs: request seeds derive from (step seed, prompt index).

Weights (relayrl/distributed/weights/, the broadcast transport): after each update the policy refreshes its
full replica (a cast-copy, or FSDP all-gathers across its ranks) and its rank 0 broadcasts every parameter, in
`named_parameters()` order, to the engines over NCCL (gloo on CPUs); each engine's receiver takes them:
- an engine over this actor's own module (native / hf): `ModuleReceiver`, straight into its parameters while
  its rounds are paused, so requests in flight (async training) continue under the new weights, their later
  tokens tagged with the new version;
- an engine whose model lives in worker processes (`WorkerLoading`: vllm, `dist.engine_tp` GPUs, one worker
  process per GPU): the actor holds no model of its own (the engine loads the policy's folder itself), and each
  worker enters the weight group itself, as rank 1 + engine rank x engine_tp + its tp rank, receiving the
  broadcast straight into its model's loader (`VLLMReceiver`). The weight group then has 1 + num_engines x
  engine_tp ranks (`weight_ranks`);
- a tensor-parallel native engine (`dist.engine_tp` > 1, rollout.engine native): the role has num_engines x
  engine_tp actors of one GPU, each block of engine_tp consecutive actors one engine (rollout/native_tp.py);
  each actor holds its shard, receives every broadcast tensor and keeps its slice (`TensorParallelReceiver`),
  and its block's first actor generates the engine's share (`generate_tp_share`) while the others follow.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import torch

from relayrl.agents.base import AgentExecutorBase, Trajectory
from relayrl.agents.rewards.base import decode_all
from relayrl.config.components import ModelConfig
from relayrl.config.rl import EvalConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.distributed.group import merged, my_share, rank, shares, world
from relayrl.distributed.weights.base import Channel, Layout, WeightReceiver
from relayrl.distributed.weights.broadcast import ModuleReceiver
from relayrl.distributed.weights.tensor_parallel import TensorParallelReceiver, tp_groups
from relayrl.distributed.weights.vllm import VLLMReceiver
from relayrl.models.loading import load_tokenizer, resolve_device
from relayrl.rollout.base import RolloutEngine, SamplingParams, WorkerLoading
from relayrl.rollout.build import engine_capabilities
from relayrl.rollout.native_tp import TPNativeEngine, shard_model
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
    executor: AgentExecutorBase,
    base: SamplingParams,
    samples: list[PromptSample],
    seed: int,
    budget: int,
    share: tuple[int, int] | None = None,
    decode_queries: bool = False,
) -> list[Trajectory]:
    """This rank's contiguous share of `samples` (balanced by prompt + `budget` tokens), n trajectories per
    prompt, grouped; request seeds derive from `seed` and each prompt's dataset index (exact resume).
    `share` (index, parts): share `index` of `parts` instead of this rank's of all ranks (TP engine groups).
    `decode_queries`: also set each trajectory's `query_text` (the decode of all its ids, special tokens kept:
    what a reward_func file or remote RM reads), here on the rank, in parallel with the other ranks."""
    weights = [len(s.prompt_ids) + budget for s in samples]
    part = my_share(weights) if share is None else shares(weights, share[1])[share[0]]
    mine = [samples[i] for i in part]

    async def run() -> list[list[Trajectory]]:
        jobs = [
            executor.execute(s, replace(base, seed=(seed * 1_000_003 + s.index * 7919) % (2**31)))
            for s in mine
        ]
        return list(await asyncio.gather(*jobs))

    with torch.no_grad():
        groups = asyncio.run(run())
    out = [t for g in groups for t in g]
    if decode_queries and out:
        for t, text in zip(out, decode_all(executor.tokenizer, [t.token_ids for t in out]), strict=True):
            t.query_text = text
    return out


def generate_tp_share(
    engine: TPNativeEngine,
    executor: AgentExecutorBase,
    base: SamplingParams,
    samples: list[PromptSample],
    seed: int,
    budget: int,
    decode_queries: bool = False,
) -> list[Trajectory]:
    """A tensor-parallel engine's ranks (blocks of tp consecutive ranks of the role): the block's leader
    generates the block's share of `samples` (`generate_share`) and releases the followers, which run its
    rounds (`follow`) and return nothing; the shares concatenate back in rank order."""
    if not engine.is_leader:
        engine.follow()
        return []
    tp = engine.tp_size
    try:
        share = (rank() // tp, world() // tp)
        return generate_share(executor, base, samples, seed, budget, share, decode_queries)
    finally:
        engine.release()


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
    decode_queries: bool = False
    """Set `Trajectory.query_text` on this rank (`generate_share`): the reward source reads the decode of all
    ids (a reward_func file, a remote RM) and the trajectories go to the driver through Ray."""
    tp: int = 1
    """GPUs of this engine (tensor parallelism): vllm's workers in this actor, or (native) this actor is one
    of the engine's tp shard actors."""


def weight_receiver(
    engine: RolloutEngine, model: torch.nn.Module | None, engine_rank: int, tp: int
) -> WeightReceiver:
    """The receiving end of the weight group for `engine`: its workers' (WorkerLoading), else its module's."""
    if isinstance(engine, WorkerLoading):
        return VLLMReceiver(engine, engine_rank, tp)
    if model is None:
        raise ValueError(
            f"{type(engine).__name__} loads its own weights but cannot take them in worker processes "
            "(relayrl.rollout.base.WorkerLoading): it cannot be a separate engine; leave dist.num_engines 0"
        )
    return ModuleReceiver(engine, model, engine_rank)


class EngineWorker:
    """A separate rollout engine (see module doc)."""

    def __init__(self, spec: EngineSpec) -> None:
        setup_process(spec.seed)
        self.spec = spec
        self.device = resolve_device(spec.device)
        m = spec.model
        self.tokenizer = load_tokenizer(
            m.tokenizer_name_or_path or m.name_or_path, trust_remote_code=m.trust_remote_code
        )
        caps = engine_capabilities(spec.rollout.engine)
        # an engine that loads its own weights (vllm, in its tp workers) needs no copy here; native / hf
        # generate from this actor's copy; a TP native engine's shard actor from its slices of it
        self.tp_group = None
        if not caps.own_weights and spec.tp > 1:
            self.tp_group = tp_groups(spec.tp)
            full = build_frozen(m, torch.device("cpu"), like=self.device)
            tp_rank = rank() % spec.tp
            self.model = shard_model(
                full, rank=tp_rank, size=spec.tp, group=self.tp_group, device=self.device
            )
            del full
        else:
            self.model = None if caps.own_weights else build_frozen(m, self.device)
        tp = spec.tp if caps.tensor_parallel else 0
        self.engine, self.executor = build_generation(
            spec.rollout,
            spec.eval,
            self.model,
            self.tokenizer,
            source=m,
            task_name=spec.task_name,
            step_timeout=spec.step_timeout,
            tp=tp,
            group=self.tp_group,
        )
        self.receiver: WeightReceiver = (
            TensorParallelReceiver(self.engine, self.model, rank(), self.tp_group)
            if self.tp_group is not None and self.model is not None
            else weight_receiver(self.engine, self.model, rank(), tp)
        )

    @merged("concat")
    def rollout(self, samples: list[PromptSample], seed: int, eval: bool = False) -> list[Trajectory]:
        """n trajectories per prompt of this engine's share of `samples` (see `generate_share`)."""
        base = sampling_params(self.spec.rollout, self.spec.eval, eval=eval)
        budget = self.spec.rollout.max_new_tokens
        q = self.spec.decode_queries
        if isinstance(self.engine, TPNativeEngine):
            return generate_tp_share(self.engine, self.executor, base, samples, seed, budget, q)
        return generate_share(self.executor, base, samples, seed, budget, decode_queries=q)

    def weight_layout(self) -> Layout | None:
        """(name, shape, dtype) of every parameter in broadcast order (checked against the sender's); None when
        the receiver takes whatever HF-named tensors the sender's layout lists (vllm; checked on the first
        receive)."""
        return self.receiver.layout()

    def join_weights(self, channel: Channel, layout: Layout) -> None:
        """Enter the weight group after the policy's rank 0 (rank 1 + this engine's rank; workers: 1 + engine
        rank x tp + tp rank), keeping the sender's `layout`."""
        self.receiver.join(channel, layout)

    @torch.no_grad()
    def receive_weights(self, version: int) -> None:
        """Every parameter from the policy's rank 0, while no round runs; then version `version`."""
        self.receiver.receive(version)

    @merged("concat")
    @torch.no_grad()
    def weight_checksum(self) -> list[float]:
        """[sum of |w| over every parameter, in float64], one per engine (native / hf)."""
        if self.model is None:
            raise RuntimeError("weight_checksum: the engine's weights live in its workers")
        return [float(sum(p.detach().double().abs().sum() for p in self.model.parameters()))]

    def close(self) -> None:
        self.engine.close()
