"""Process bodies of the vocabulary-parallel sampler kernel tests (tests/rollout/test_vocab_parallel_kernel*.py):
spawned over a real gloo group (CPU, Triton's interpreter) or an NCCL group (one GPU a rank); importable by name
in the children."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import tp_workers

from relayrl.rollout import sampling
from relayrl.rollout.sampling import uniform
from relayrl.rollout.vocab_parallel import sample_split, vocab_bounds

BOUNDARY = 1e-5
"""A token that differs from a reference's must have a fp64 CDF boundary within this of u (in units of the
total mass): test_sampling_fast.py's bound for the TP = 1 kernel."""

GLOO_CASE = (16, 9_001)
"""(rows, vocabulary) of the gloo test: at TP 2 each slice is a 4096-entry block and a tail, at TP 4 one
short block."""


def case(b: int, v: int, seed: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """(logits [b, v], temperature [b] with every 7th row greedy, u [b]): flat to peaked rows."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(b, 1, generator=gen) * 6 + 0.5
    logits = (torch.randn(b, v, generator=gen) * scale).to(dtype)
    temp = torch.rand(b, generator=gen) * 1.4 + 0.2
    temp[::7] = 0.0
    u = uniform(torch.arange(b, dtype=torch.long) * 7919 + seed, torch.full((b,), 11))
    return logits.to(device), temp.to(device), u.to(device)


def boundary_rows(logits, temp, u, tok, ref_tok) -> tuple[int, list[float]]:
    """(rows whose tokens differ, the largest |fp64 CDF - u| over the boundaries between each pair)."""
    diff = (tok != ref_tok).nonzero().flatten().tolist()
    gaps = []
    for r in diff:
        t = float(temp[r]) if temp[r] > 0 else 1.0
        cdf = torch.softmax(logits[r].double() / t, -1).cumsum(-1)
        lo, hi = sorted((int(tok[r]), int(ref_tok[r])))
        gaps.append(float((cdf[lo:hi] - float(u[r])).abs().max()))
    return len(diff), gaps


def both_paths(logits, temp, u, rank: int, world: int, group: Any) -> dict:
    """{mode: {"kernel" | "torch": (token, logprob)}} of this rank's slice, the sum through dist.all_reduce."""
    bounds = vocab_bounds(logits.shape[1], world)
    lo, hi = bounds[rank], bounds[rank + 1]

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    res: dict = {}
    for mode, t in (("sample", temp), ("greedy", torch.zeros_like(temp))):
        res[mode] = {}
        for name, fast in (("kernel", True), ("torch", False)):
            res[mode][name] = sample_split(logits[:, lo:hi], t, u, mode == "greedy", lo=lo, rank=rank,
                                           size=world, reduce=reduce, fast=fast)  # fmt: skip
    return res


def gloo_worker(rank: int, world: int, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        logits, temp, u = case(*GLOO_CASE, seed=world)
        torch.save(both_paths(logits, temp, u, rank, world, dist.group.WORLD), f"{out}.{rank}")
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    finally:
        dist.destroy_process_group()


def engine_kernel_worker(rank: int, world: int, store_path: str, out: str) -> None:
    """tp_workers.engine_worker with the vocab-parallel sampler's kernels forced on (sampling.fast_default
    True: Triton's interpreter on a CPU), tied head."""
    calls = [0]
    real = sampling.sampling_kernels.sample_shard

    def spy(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    sampling.fast_default = lambda logits: True  # this process only
    sampling.sampling_kernels.sample_shard = spy
    tp_workers.engine_worker(rank, world, store_path, out)
    got = torch.load(f"{out}.{rank}", weights_only=False)
    torch.save({**got, "kernel_calls": calls[0]}, f"{out}.{rank}")


B_GPU, V_GPU, STEPS_GPU = 256, 152_064, 200
"""The GPU test's shape: a 7B decode step (vocabulary 152,064 over 2 ranks: 76,032 each), 200 steps of u."""


def _step_u(b: int, step: int, device: torch.device) -> torch.Tensor:
    seeds = torch.arange(b, device=device) * 7919 + 13
    return uniform(seeds, torch.full_like(seeds, step))


def gpu_worker(
    rank: int,
    world: int,
    store_path: str,
    out: str,
    shape: tuple = (B_GPU, V_GPU, STEPS_GPU),
    cpu: bool = False,
) -> None:
    """One GPU a rank, NCCL: the kernel and torch paths of sample_split over [256, 152064] bf16 logits split
    over the ranks, STEPS_GPU uniforms (new logits every 50 steps), both checked against the fp64 inverse CDF
    of the whole row; then each path captured in a CUDA graph (its all-reduces inside) and replayed with new
    uniforms (compared with eager), and each path's graph-replay time. Saves a dict of counts and times. `cpu`: a dry run of the
    same code over gloo (Triton's interpreter, no graphs; a small `shape` (rows, vocabulary, steps))."""
    bsz, vocab, steps = shape
    if cpu:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    else:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                                device_id=device)  # fmt: skip
    try:
        group = dist.group.WORLD
        lo, hi = vocab_bounds(vocab, world)[rank : rank + 2]

        def reduce(t: torch.Tensor) -> None:
            dist.all_reduce(t, group=group)

        def run(local, temp, u, greedy_only, fast):
            return sample_split(local, temp, u, greedy_only, lo=lo, rank=rank, size=world, reduce=reduce,
                                fast=fast)  # fmt: skip

        res: dict[str, Any] = dict(draws=0, differ=0, kernel_miss=0, torch_miss=0, worst_gap=0.0, worst_lp=0.0,
                                   greedy_equal=True, greedy_lp=0.0, ranks_agree=True)  # fmt: skip
        logits = temp = cdf = None
        for step in range(steps):
            if step % 50 == 0:
                logits, temp, _ = case(bsz, vocab, seed=step, device=str(device))
                t = torch.where(temp > 0, temp, 1.0).double()
                cdf = torch.softmax(logits.double() / t[:, None], -1).cumsum(-1)
                cdf = cdf / cdf[:, -1:]
            assert logits is not None and temp is not None and cdf is not None
            u = _step_u(bsz, step, device)
            local = logits[:, lo:hi]
            k_tok, k_lp = run(local, temp, u, False, True)
            t_tok, t_lp = run(local, temp, u, False, False)
            mine = torch.stack([k_tok.float(), k_lp])
            peers = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(peers, mine, group=group)
            res["ranks_agree"] &= all(bool(torch.equal(p, peers[0])) for p in peers)
            sampled = temp > 0
            truth = torch.searchsorted(cdf, u.double()[:, None], right=True).squeeze(-1).clamp_(max=vocab - 1)
            same = k_tok == t_tok
            res["draws"] += int(sampled.sum())
            res["differ"] += int((~same & sampled).sum())
            res["worst_lp"] = max(res["worst_lp"], float((k_lp - t_lp)[same].abs().max()))
            for name, got in (("kernel", k_tok), ("torch", t_tok)):
                miss = (got != truth) & sampled
                res[f"{name}_miss"] += int(miss.sum())
                for r in miss.nonzero().flatten().tolist():
                    a, b = sorted((int(got[r]), int(truth[r])))
                    gap = float((cdf[r, a:b] - float(u[r])).abs().min())
                    res["worst_gap"] = max(res["worst_gap"], gap)
            greedy = ~sampled
            res["greedy_equal"] &= bool(torch.equal(k_tok[greedy], logits[greedy].float().argmax(-1)))
        assert logits is not None and temp is not None
        zero = torch.zeros_like(temp)
        g_tok, g_lp = run(logits[:, lo:hi], zero, u, True, True)
        r_tok, r_lp = run(logits[:, lo:hi], zero, u, True, False)
        res["greedy_equal"] &= bool(torch.equal(g_tok, r_tok)) and bool(
            torch.equal(g_tok, logits.float().argmax(-1))
        )
        res["greedy_lp"] = float((g_lp - r_lp).abs().max())
        # CUDA graphs: capture each path (its two all-reduces inside), replay with new uniforms
        local = logits[:, lo:hi].contiguous()
        u_buf = _step_u(bsz, 0, device)
        for fast in (True, False) if not cpu else ():
            name = "kernel" if fast else "torch"
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (and Triton's compile) off the capture
                for _ in range(2):
                    run(local, temp, u_buf, False, fast)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(
                graph, capture_error_mode="thread_local"
            ):  # as the engine (NCCL's watchdog)
                g_tok, g_lp = run(local, temp, u_buf, False, fast)
            equal = True
            for step in (1, 2, 3):
                u_buf.copy_(_step_u(bsz, step, device))
                graph.replay()
                e_tok, e_lp = run(local, temp, u_buf, False, fast)
                equal &= bool(torch.equal(g_tok, e_tok)) and bool(torch.equal(g_lp, e_lp))
            res[f"{name}_graph_equal"] = equal
            torch.cuda.synchronize(device)
            dist.barrier(group)
            t0 = time.perf_counter()
            for _ in range(100):
                graph.replay()
            torch.cuda.synchronize(device)
            res[f"{name}_graph_us"] = (time.perf_counter() - t0) * 1e4  # 100 replays -> us each
            del graph
        torch.save(res, f"{out}.{rank}")
        dist.barrier(group)
    finally:
        dist.destroy_process_group()
