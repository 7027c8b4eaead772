"""Process bodies of the tensor-parallel engine tests (spawned over a real gloo group; importable by name in
the children, which test modules under --import-mode=importlib are not)."""

from __future__ import annotations

import asyncio
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.rollout.base import GenerationRequest, SamplingParams, generate_all

SPEC = TinyModelSpec(hidden=64, layers=2, heads=8, kv_heads=4, intermediate=128, seed=0)
"""Qwen2-shaped, 8 query / 4 KV heads and 128 MLP columns: divisible by TP 1, 2 and 4."""

ENGINE = {"max_slots": 8, "max_seq_len": 64, "sync_every": 4}


def requests() -> list[GenerationRequest]:
    """Greedy, seeded sampling with n > 1, and seeded top-p / top-k: every sampling mode."""
    return [
        GenerationRequest(
            prompt_ids=[5, 9, 13, 17, 21], params=SamplingParams(temperature=0, max_new_tokens=12)
        ),
        GenerationRequest(
            prompt_ids=[7, 8, 9], params=SamplingParams(n=3, temperature=1.0, seed=11, max_new_tokens=10)
        ),
        GenerationRequest(
            prompt_ids=[30, 31, 32, 33, 34, 35, 36],
            params=SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, seed=5, max_new_tokens=9),
        ),
    ]


def tiny_model() -> torch.nn.Module:
    return build_tiny_model(build_tiny_tokenizer(), SPEC)


def untied_model() -> torch.nn.Module:
    """The tiny model with its own lm_head (the embedding's rows reversed and scaled: a different head)."""
    model: Any = tiny_model()
    model.config.tie_word_embeddings = False
    weight = model.model.embed_tokens.weight.detach().flip(0) * 1.5
    model.lm_head.weight = torch.nn.Parameter(weight.contiguous())
    return model


def outputs(results) -> list[list[tuple[list[int], list[float]]]]:
    return [[(c.token_ids, c.logprobs) for c in r.completions] for r in results]


def init(rank: int, world: int, store_path: str, timeout_s: float | None = None) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    store = dist.FileStore(store_path, world)
    extra: dict[str, Any] = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, **extra)


def engine_worker(
    rank: int, world: int, store_path: str, out: str, untied: bool = False, buffered: bool = False
) -> None:
    """TP = world over the whole group: the leader generates, the followers follow; rank 0 saves what it got
    and every rank saves its decode step count (lock step). `untied`: `untied_model` (its own lm_head).
    `buffered`: the row-parallel layers sum through a FastAllReduce whose kernel is a gloo stand-in (a copy
    all-reduced), for [<= max_slots, hidden] products; saves how many sums took that path."""
    from relayrl.rollout.native_tp import TPNativeEngine, shard_model
    from relayrl.rollout.tp_allreduce import FastAllReduce

    init(rank, world, store_path)
    try:
        group = dist.group.WORLD
        shard = shard_model(untied_model() if untied else tiny_model(), rank=rank, size=world, group=group)
        calls = [0]

        def standin(view: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            total = view.clone()
            dist.all_reduce(total, group=group)
            return total

        opts: dict[str, Any] = dict(ENGINE)
        if buffered:
            rows, hidden = ENGINE["max_slots"], shard.config.hidden_size
            opts["allreduce"] = FastAllReduce(torch.zeros(rows * hidden), standin, standin, 0, "standin")
        engine = TPNativeEngine(shard, group=group, **opts)
        got = None
        if rank == 0:
            got = outputs(generate_all(engine, requests()))
            engine.release()
        else:
            engine.follow()
        rows = int(shard.get_parameter("lm_head.weight").shape[0])
        torch.save(
            {
                "outputs": got,
                "steps": engine.decode_steps,
                "kv": engine.runner.n_kv,
                "head_rows": rows,
                "buffered": calls[0],
            },
            f"{out}.{rank}",
        )
        engine.close()
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    finally:
        dist.destroy_process_group()


def refresh_worker(rank: int, world: int, store_path: str, out: str) -> None:
    """A policy FSDP2-sharded over `world` ranks, TP = world engine shards refreshed from it after an
    optimizer step: the canary before / after the refresh, and the engine's outputs after it (rank 0)."""
    from relayrl.distributed.fsdp import ShardSpec, full_tensors
    from relayrl.distributed.fsdp import shard_model as fsdp_shard
    from relayrl.distributed.weights.tensor_parallel import TensorParallelWeights, tp_groups
    from relayrl.rollout.native_tp import TPNativeEngine

    init(rank, world, store_path)
    try:
        policy = tiny_model()
        tw = TensorParallelWeights(policy, dtype=torch.float32, group=tp_groups(world))
        fsdp_shard(policy, ShardSpec(device=torch.device("cpu")))
        engine = TPNativeEngine(tw.model, group=tw.group, **ENGINE)
        opt = torch.optim.SGD(policy.parameters(), lr=0.5)
        ids = torch.tensor([[5, 9, 13, 17, 21, 25, 29]])
        policy(input_ids=ids).logits.float().pow(2).mean().backward()
        opt.step()
        stale = tw.max_abs_diff()
        seconds = tw.load_into(engine, version=1)
        canary = tw.max_abs_diff()
        full = {n: t.clone() for n, t in full_tensors(policy)}  # the trained weights, for the TP=1 reference
        got = None
        if rank == 0:
            got = outputs(generate_all(engine, requests()))
            engine.release()
        else:
            engine.follow()
        torch.save(
            {
                "outputs": got,
                "stale": stale,
                "canary": canary,
                "seconds": seconds,
                "full": full if rank == 0 else None,
                "steps": engine.decode_steps,
                "kv": engine.runner.n_kv,
            },
            f"{out}.{rank}",
        )
        engine.close()
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    finally:
        dist.destroy_process_group()


def allreduce_gpu_worker(rank: int, world: int, store_path: str, out: str) -> None:
    """One GPU a rank, NCCL: random [256, 3584] bf16 summed by NCCL and by tp_allreduce's symmetric-memory
    one-shot, two-shot and auto paths, eagerly and replayed from a CUDA graph; saves which path each set up
    (None: it fell back to NCCL) and whether its sums equal NCCL's bit for bit."""
    from relayrl.rollout.tp_allreduce import setup_fast_all_reduce

    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # never NVLink multicast
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    try:
        group = dist.group.WORLD
        gen = torch.Generator(device=device).manual_seed(100 + rank)
        x = torch.randn(256, 3584, generator=gen, device=device).to(torch.bfloat16)
        want = x.clone()
        dist.all_reduce(want, group=group)
        res: dict[str, Any] = {}
        kept = []  # every buffer stays alive: no pool reuse between set-ups
        for impl in ("one_shot", "two_shot", "auto"):
            fast = setup_fast_all_reduce(group, device, torch.bfloat16, 256, 3584, impl)
            res[impl] = entry = {"name": None if fast is None else fast.name}
            if fast is None:
                continue
            kept.append(fast)
            view = fast.slot(256, 3584)
            view.copy_(x)
            entry["eager_equal"] = bool(torch.equal(fast.reduce(view), want))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture, as torch.cuda.graph asks
                view.copy_(x)
                fast.reduce(view)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                view.copy_(x)
                got = fast.reduce(view)
            got.zero_()
            graph.replay()
            torch.cuda.synchronize(device)
            entry["graph_equal"] = bool(torch.equal(got, want))
        torch.save(res, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


COUNT_ENGINE = {"max_slots": 8, "max_seq_len": 64, "sync_every": 4, "prefix_cache": False}


def count_requests() -> list[GenerationRequest]:
    """Plain seeded sampling (mode "sample": the vocab-parallel sampler's two all-reduces a step, no gather)
    of different lengths: samples finish in different rounds."""
    return [
        GenerationRequest(
            prompt_ids=[3 + i, 9, 13 + 2 * i],
            params=SamplingParams(temperature=1.0, seed=i, max_new_tokens=6 + 3 * i),
        )
        for i in range(4)
    ]


def count_rounds(engine: Any, run_round: Any) -> dict:
    """One round of `run_round()` under bench/tp_phases.RoundCounter: its report (bench/ put on sys.path here:
    the children import this module by name)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from tp_phases import RoundCounter

    with RoundCounter(engine) as counter:
        got = run_round()
    rep = counter.report()
    rep["outputs"] = got
    rep["control_device"] = str(getattr(engine, "control_device", "none"))
    rep["control_messages"] = getattr(engine, "control_messages", 0)
    rep["decode_steps"] = engine.decode_steps
    return rep


CANCEL_AFTER_STEPS = 4
"""`cancel_round`: the leader cancels the last (longest) request once the engine ran this many decode steps."""


def cancel_round(engine: Any, reqs: list[GenerationRequest]) -> list:
    """Generate `reqs` on the loop driver, cancelling the last request's task once the engine ran
    CANCEL_AFTER_STEPS more decode steps (between two rounds: the driver yields to the loop there); outputs, None
    where cancelled."""

    async def main() -> list:
        start = engine.decode_steps
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in reqs]
        while engine.decode_steps < start + CANCEL_AFTER_STEPS:
            await asyncio.sleep(0)
        tasks[-1].cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        return [None if isinstance(r, BaseException) else outputs([r])[0] for r in done]

    return asyncio.run(main())


def count_worker(rank: int, world: int, store_path: str, out: str) -> None:
    """TP = world engine (COUNT_ENGINE) generating `count_requests` under a RoundCounter on every rank: saves
    each rank's counts (collectives and host reads by phase); then the same requests again with the leader
    cancelling one mid-way (`cancel_round`): its outputs, each rank's decode steps and round messages."""
    from relayrl.rollout.native_tp import TPNativeEngine, shard_model

    init(rank, world, store_path, timeout_s=60)  # ranks out of step fail in a minute instead of hanging
    try:
        group = dist.group.WORLD
        shard = shard_model(tiny_model(), rank=rank, size=world, group=group)
        engine = TPNativeEngine(shard, group=group, **COUNT_ENGINE)

        def run_round() -> Any:
            if rank == 0:
                got = outputs(generate_all(engine, count_requests()))
                engine.release()
                return got
            engine.follow()
            return None

        report = count_rounds(engine, run_round)
        steps, messages = engine.decode_steps, engine.control_messages
        got = None
        if rank == 0:
            got = cancel_round(engine, count_requests())
            engine.release()
        else:
            engine.follow()
        report["cancel"] = dict(outputs=got, steps=engine.decode_steps - steps,
                                messages=engine.control_messages - messages,
                                left=(len(engine._shadows), len(engine._callers), engine.pool.available()))  # fmt: skip
        torch.save(report, f"{out}.{rank}")
        engine.close()
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    finally:
        dist.destroy_process_group()
