"""Data-parallel FSDP2 roles on a REAL local Ray cluster (2 CPUs, gloo): 2 ranks train like 1.

One Ray cluster for the module (`ray_cluster`); each test builds its own RayLauncher on it and shuts it down
(actors and placement groups go, the cluster stays). The worker classes below live at module level: Ray
pickles them by reference, and the actors import this module (the repository root is on their PYTHONPATH).

- 2 ranks == 1 rank: 2 optimizer steps of a tiny Qwen2 (hidden 32, 2 layers) sharded over 2 ranks, each rank
  taking its contiguous share of 8 sequences (`my_share`) and splitting it into a DIFFERENT number of
  micro-batches (rank 0 one per sequence, rank 1 one for all), equal the same steps on one unsharded rank:
  per-step loss and gradient norm (both global) within rtol 1e-5, final weights within 1e-4 (see below).
- uneven shares: 3 sequences on 2 ranks, and 1 sequence on 2 ranks (rank 1's share is empty: it passes a
  padding micro-batch with num_real=0, which adds nothing), still equal 1 rank.
- engine refresh: LocalWeights(gather=True) built before sharding holds a full replica on every rank; after
  a step it is stale (canary > 0), after `refresh` (FSDP's per-unit all-gather) the canary is exactly 0 on
  every rank and the replica differs from the initial weights; with LoRA only the adapters train (the
  base weights of the replica never change) and the canary is 0 too.
- failures: a rank that raises -> RoleError naming the role, rank 1, its host and "ValueError: boom" within
  seconds; a rank that dies while its peer waits in an all-reduce -> RoleError naming rank 1 and "died"
  within 60 s (the group's collective timeout is 20 s), and `shutdown` then returns promptly; rank 0's own
  error ("Connection closed by peer") may reach the launcher first, and the culprit is still rank 1. A rank
  that hangs while its peer's all-reduce times out is named as the stuck one (not the peer that timed out).

Weight tolerance (1e-4 absolute, with lr 1e-2 and 2 steps): the sharded run sums gradients in another order
(per-rank partial sums, then a gloo reduce-scatter; different micro-batch splits), so gradients agree to fp32
rounding (~1e-7 relative) and the losses / norms to ~1e-8 relative. AdamW normalises each coordinate
(m / (sqrt(v) + eps)), so a relative gradient error d moves a coordinate by about lr * d per step; coordinates
whose gradient is near eps = 1e-8 amplify it, but the update of a coordinate is bounded by lr per step in any
case. 1e-4 is 1% of one step's largest move: a real bug (a rank's gradient lost or counted twice, a wrong
world / count scale, a missed reduce) moves weights by ~lr, two orders of magnitude above it. Measured: ~4e-6.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from relayrl.config.components import LoraConfig, OptimConfig
from relayrl.config.dist import DistConfig
from relayrl.distributed.fsdp import ShardSpec, full_tensors, is_sharded, shard_model
from relayrl.distributed.group import in_group, merged, my_share, rank, shares, world
from relayrl.distributed.launch.base import RoleError
from relayrl.distributed.launch.local import LocalLauncher
from relayrl.distributed.launch.ray import RayLauncher
from relayrl.distributed.weights.local import LocalWeights
from relayrl.models.forward import token_logprobs
from relayrl.models.tiny import TinyModelSpec, build_tiny_model, build_tiny_tokenizer
from relayrl.training.setup import build_train_step
from relayrl.training.step import LossOutput

pytestmark = pytest.mark.slow  # FSDP2 ranks as Ray actors

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
LR = 1e-2
WEIGHT_ATOL = 1e-4
LENGTHS = [7, 12, 5, 9, 14, 6, 8, 11]


def _seqs(n: int = len(LENGTHS)) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 90, (k,), generator=g) for k in LENGTHS[:n]]


def _loss(model, seqs: list[torch.Tensor]) -> LossOutput:
    """Token-level NLL: sum over the predicted tokens, counted per token."""
    lp, _ = token_logprobs(model, seqs, "padded")
    return LossOutput(loss_sum=-lp.sum(), count=sum(len(s) - 1 for s in seqs))


class Probe:
    """A trainable policy-like worker: tiny Qwen2 (optionally LoRA), FSDP2-sharded when in a group."""

    def __init__(self, *, lora: bool = False, engine: bool = False) -> None:
        self.build(lora=lora, engine=engine)

    def build(self, *, lora: bool = False, engine: bool = False) -> None:
        """(Re)build the model, optimizer and (optionally) the engine replica from the fixed seed."""
        torch.manual_seed(0)
        model = build_tiny_model(
            build_tiny_tokenizer(), TinyModelSpec(hidden=32, layers=2, heads=4, kv_heads=2)
        )
        if lora:
            from relayrl.models.loading import apply_lora

            model = apply_lora(model, LoraConfig(rank=4, alpha=8))
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.engine = LocalWeights(model, dtype=torch.float32, gather=True, device=CPU) if engine else None
        if in_group():
            shard_model(model, ShardSpec(device=CPU))
        self.model = model
        optim = OptimConfig(lr=LR, scheduler="constant", warmup_steps=0, warmup_ratio=0.0)
        self.step = build_train_step(model, optim, 10, precision="fp32", device=CPU, sharded=in_group())

    def steps(self, seqs: list[torch.Tensor], n: int) -> dict:
        """`n` optimizer steps on this rank's share of `seqs`; (loss, grad_norm) per step and the full weights."""
        share = my_share([len(s) for s in seqs])
        mine = [seqs[i] for i in share]
        if not mine:  # an empty share still runs the forwards the other ranks run
            mbs, num_real = [[seqs[0]]], 0
        elif rank() % 2 == 0:
            mbs, num_real = [[s] for s in mine], None  # one micro-batch per sequence
        else:
            mbs, num_real = [mine], None  # one micro-batch for the whole share
        history = []
        for _ in range(n):
            out = self.step.step(mbs, _loss, num_real=num_real)
            assert not out.skipped
            history.append((out.loss, out.grad_norm, out.count))
        weights = {name: t.clone() for name, t in full_tensors(self.model)}  # a collective: every rank
        return {
            "rank": rank(),
            "world": world(),
            "sharded": is_sharded(self.model),
            "rows": len(mine),
            "history": history,
            "weights": weights,
        }

    @merged("concat")
    def steps_all(self, seqs: list[torch.Tensor], n: int) -> list[dict]:
        """`steps` with every rank's result (in rank order)."""
        return [self.steps(seqs, n)]

    @merged("concat")
    def refresh_check(self, seqs: list[torch.Tensor]) -> list[dict]:
        """One step, then the engine canary before / after `refresh` (collectives: every rank runs them)."""
        ew = self.engine
        before = ew.max_abs_diff()
        share = my_share([len(s) for s in seqs])
        mine = [seqs[i] for i in share]
        self.step.step([mine] if mine else [[seqs[0]]], _loss, num_real=None if mine else 0)
        stale = ew.max_abs_diff()
        seconds = ew.refresh()
        after = ew.max_abs_diff()
        moved = {n: float((p - self.initial[n]).abs().max()) for n, p in ew.model.named_parameters()}
        return [
            {
                "rank": rank(),
                "sharded": is_sharded(self.model),
                "trained": sorted(ew.trained),
                "before": before,
                "stale": stale,
                "after": after,
                "seconds": seconds,
                "moved": moved,
            }
        ]


class Crasher:
    """A model-free worker whose rank 1 fails in the ways a real rank does."""

    @merged("concat")
    def ping(self) -> list[int]:
        return [rank()]

    def nap(self, seconds: float) -> int:
        """Rank 1 returns `seconds` after rank 0 (a slow engine)."""
        time.sleep(seconds * rank())
        return rank()

    def boom(self) -> int:
        if rank() == 1:
            raise ValueError("boom")
        return rank()

    def die_in_collective(self) -> int:
        """Rank 1 exits the process while rank 0 waits for it in an all-reduce (gloo then fails on the reset
        connection, at the latest after the group's collective timeout)."""
        if rank() == 1:
            time.sleep(0.5)  # rank 0 is waiting in the all-reduce by then
            os._exit(1)
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        return int(t.item())

    def stuck_in_collective(self) -> int:
        """Rank 1 hangs (never joins) while rank 0 waits in an all-reduce until the collective timeout."""
        if rank() == 1:
            time.sleep(3600)
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        return int(t.item())


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module (the launchers leave a cluster they did not start running)."""
    import ray

    assert not ray.is_initialized(), "an earlier test left Ray running"
    env = {k: os.environ[k] for k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM") if k in os.environ}
    pythonpath = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {**env, "PYTHONPATH": pythonpath}},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def _launcher(ranks: int = 2, timeout_s: float = 120.0) -> RayLauncher:
    cfg = DistConfig(mode="ray", num_cpus=2, gpus="no", policy_num_gpus_per_node=ranks, timeout_s=timeout_s)
    return RayLauncher(cfg, {"policy": ranks})


def _shares_of(seqs: list[torch.Tensor]) -> list[range]:
    return shares([len(s) for s in seqs], 2)


def _one_rank(seqs: list[torch.Tensor], n: int, **kw) -> dict:
    """The reference: the same worker in this process (local mode), one unsharded rank."""
    return LocalLauncher().spawn("policy", Probe, **kw).call(Probe.steps, seqs, n)


def _assert_same(ranks: list[dict], ref: dict) -> None:
    """Every rank's per-step metrics and final weights equal the 1-rank run's (see module doc)."""
    assert not ref["sharded"] and ref["world"] == 1
    for r in ranks:
        assert r["sharded"] and r["world"] == 2
        assert len(r["history"]) == len(ref["history"])
        for step, (got, want) in enumerate(zip(r["history"], ref["history"], strict=True)):
            loss, norm, count = got
            assert count == want[2], (r["rank"], step, got, want)
            assert loss == pytest.approx(want[0], rel=1e-5), (r["rank"], step, got, want)
            assert norm == pytest.approx(want[1], rel=1e-5), (r["rank"], step, got, want)
        assert r["weights"].keys() == ref["weights"].keys()
        diff = max(float((r["weights"][k] - ref["weights"][k]).abs().max()) for k in ref["weights"])
        assert diff < WEIGHT_ATOL, (r["rank"], diff)
    # the run really trained: the weights moved by ~lr from their start
    start = Probe().initial
    assert max(float((ref["weights"][k] - start[k]).abs().max()) for k in start) > LR / 2


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.timeout(120)
def test_two_ranks_equal_one_rank(ray_cluster):
    seqs = _seqs()
    launcher = _launcher()
    try:
        policy = launcher.spawn("policy", Probe)
        ranks = policy.call(Probe.steps_all, seqs, 2)
    finally:
        launcher.shutdown()
    assert [r["rank"] for r in ranks] == [0, 1]
    assert [r["rows"] for r in ranks] == [len(r) for r in _shares_of(seqs)]
    assert all(r["rows"] > 0 for r in ranks)
    _assert_same(ranks, _one_rank(seqs, 2))


@pytest.mark.timeout(120)
def test_uneven_and_empty_shares_equal_one_rank(ray_cluster):
    launcher = _launcher()
    try:
        policy = launcher.spawn("policy", Probe)
        results = {}
        for n in (3, 1):  # 3 sequences: 1 + 2 rows (lengths 7 | 12, 5); 1 sequence: rank 1's share is empty
            policy.call(Probe.build)  # a fresh model and optimizer from the same seed
            results[n] = policy.call(Probe.steps_all, _seqs(n), 2)
    finally:
        launcher.shutdown()
    assert [r["rows"] for r in results[3]] == [1, 2]
    assert [r["rows"] for r in results[1]] == [1, 0]
    for n, ranks in results.items():
        _assert_same(ranks, _one_rank(_seqs(n), 2))


@pytest.mark.timeout(120)
def test_engine_refresh_gathers_full_weights(ray_cluster):
    seqs = _seqs()
    launcher = _launcher()
    try:
        policy = launcher.spawn("policy", Probe, engine=True)
        full = policy.call(Probe.refresh_check, seqs)
        policy.call(Probe.build, lora=True, engine=True)
        lora = policy.call(Probe.refresh_check, seqs)
    finally:
        launcher.shutdown()
    for ranks in (full, lora):
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["sharded"] for r in ranks)
        for r in ranks:
            assert r["before"] == 0.0, r  # the replica starts equal to the trainer
            assert r["stale"] > 0.0, r  # a step makes it stale: the canary sees it
            assert r["after"] == 0.0, r  # refresh makes it exact, on every rank
            assert r["seconds"] >= 0.0
        assert ranks[0]["moved"] == ranks[1]["moved"]  # every rank holds the same replica
    moved = full[0]["moved"]
    assert set(full[0]["trained"]) == set(moved)  # full fine-tuning: everything trains
    assert max(moved.values()) > LR / 2
    moved, trained = lora[0]["moved"], set(lora[0]["trained"])
    assert trained and all("lora_" in n for n in trained), sorted(trained)
    assert all(v == 0.0 for n, v in moved.items() if n not in trained)  # frozen base weights never change
    assert max(moved[n] for n in trained if "lora_B" in n) > LR / 2  # the adapters did


@pytest.mark.timeout(60)
def test_each_ranks_ready_time_is_recorded(ray_cluster):
    """RayRole.ready_s: seconds from the call to each rank's result ready (the rollout phase's
    timing/rollout_rank_min / _max); rank 1 returns 1.5 s after rank 0, so the stamps are that far apart
    (tolerance: Ray's call and scheduling overhead on a busy 2-core host, under 1 s)."""
    launcher = _launcher(timeout_s=20)
    try:
        role = launcher.spawn("policy", Crasher)
        assert role.threads == [1, 1]  # each rank's CPU share (1 of the 2 CPUs): its torch threads
        assert role.call(Crasher.nap, 1.5) == 0
    finally:
        launcher.shutdown()
    first, last = role.ready_s["nap"]
    assert 0.0 <= first < 1.0 and 1.5 <= last < 2.5 + first, (first, last)


@pytest.mark.timeout(90)
def test_a_rank_runs_its_cpu_share_of_threads_whatever_omp_num_threads_it_inherits(ray_cluster):
    """Ray derives an actor's OMP_NUM_THREADS from its CPUs only when the variable is unset; inherited from the
    driver's environment it would set every rank's torch threads (64 on a 64-core host, for each of its
    ranks). The launcher gives each rank its CPU share's threads (RayRole.threads: 1 each for 2 ranks on this
    2-CPU cluster, checked in test_each_ranks_ready_time_is_recorded). Here one rank host of half a CPU whose
    environment holds OMP_NUM_THREADS=2 (torch caps its threads at the host's cores: 2 here): without
    `threads` it runs 2 (what the variable does), with threads=1 it runs 1."""
    import ray

    from relayrl.distributed.group import GroupSpec
    from relayrl.distributed.launch.ray import RankHost

    host = ray.remote(RankHost).options(num_cpus=0.5, runtime_env={"env_vars": {"OMP_NUM_THREADS": "2"}})
    actors = {"inherited": host.remote("probe", 0), "pinned": host.remote("probe", 0, threads=1)}
    try:
        threads = {}
        for name, actor in actors.items():
            addr, port, _ = ray.get(actor.endpoint.remote(), timeout=60)
            group = GroupSpec(rank=0, world=1, addr=addr, port=port, backend="gloo", timeout_s=20)
            threads[name] = ray.get(actor.start.remote(group, Crasher, (), {}), timeout=60)[2]
        assert threads == {"inherited": 2, "pinned": 1}
    finally:
        for actor in actors.values():
            ray.kill(actor)


@pytest.mark.timeout(60)
def test_raising_rank_is_named_with_host_and_error(ray_cluster):
    launcher = _launcher(timeout_s=20)
    try:
        role = launcher.spawn("policy", Crasher)
        t0 = time.monotonic()
        with pytest.raises(RoleError) as err:
            role.call(Crasher.boom)
        elapsed = time.monotonic() - t0
        assert role.call(Crasher.ping) == [0, 1]  # a raised error leaves the role usable
    finally:
        launcher.shutdown()
    msg = str(err.value)
    for part in ("policy", "rank 1", "host", "ValueError: boom"):
        assert part in msg, msg
    assert elapsed < 10, elapsed


@pytest.mark.timeout(90)
def test_dead_rank_is_named_and_shutdown_does_not_hang(ray_cluster):
    launcher = _launcher(timeout_s=20)  # also the gloo collective timeout of the role's group
    try:
        role = launcher.spawn("policy", Crasher)
        t0 = time.monotonic()
        with pytest.raises(RoleError) as err:
            role.call(Crasher.die_in_collective)
        elapsed = time.monotonic() - t0
    finally:
        t0 = time.monotonic()
        launcher.shutdown()  # kills rank 0 if it still waits in the all-reduce, frees the bundles
        shutdown_s = time.monotonic() - t0
    msg = str(err.value)
    assert "policy" in msg and "rank 1" in msg and "host" in msg and "died" in msg, msg
    assert elapsed < 60, elapsed
    assert shutdown_s < 15, shutdown_s


@pytest.mark.timeout(120)
def test_stuck_rank_is_named_not_its_timed_out_peer(ray_cluster):
    launcher = _launcher(timeout_s=5)  # rank 0's all-reduce times out after 5 s
    try:
        role = launcher.spawn("policy", Crasher)
        t0 = time.monotonic()
        with pytest.raises(RoleError) as err:
            role.call(Crasher.stuck_in_collective)
        elapsed = time.monotonic() - t0
    finally:
        launcher.shutdown()
    msg = str(err.value)
    assert msg.startswith("policy rank 1/2") and "still running" in msg, msg
    assert "rank 0/2" in msg  # the peer's collective error follows, as context
    assert elapsed < 60, elapsed
