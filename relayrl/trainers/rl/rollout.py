"""The rollout phase of an RL step: prompts -> trajectories that are worth training on.

    sample = RolloutPhase(generator=roles.generator, reward=roles.reward, prompts=train_prompts,
                          sampler=sampler, rollout=cfg.rollout, filter=cfg.filter, seed=cfg.train.seed)
    trajs, metrics = sample(step)      # raises NothingToTrain when every sample failed or every group was filtered

One call: draw the step's prompts (resumable sampler) -> generator.rollout (n samples per prompt) ->
rewards (relayrl.workers.reward.score_trajectories: in this process or on the reward actor) -> failure
policy (relayrl.agents.failures) -> whole groups only -> dynamic filtering, refilled from new prompts up to
filter.max_refills times. Seeds derive from (train.seed, step, attempt) and each
prompt's index, so a resumed run samples exactly what an uninterrupted one would have. Metrics: rollout/*
(counts, failures, lengths, rewards), filter/* (fractions of every group generated this step), timing/reward,
timing/rollout_rank_min / _max / timing/rollout_return (`rank_timings`: the wait for the slowest rank, the
trajectories back to this process).
"""

from __future__ import annotations

import time
from dataclasses import replace

from relayrl.agents.base import Trajectory
from relayrl.agents.failures import RolloutFailure, apply_failure_policy
from relayrl.config.rl import FilterConfig, RolloutConfig
from relayrl.data.records import PromptSample
from relayrl.distributed.launch.base import RoleHandle
from relayrl.trainers.rl.experience import complete_groups, filter_groups, rollout_metrics
from relayrl.training.sampler import ResumableSampler
from relayrl.workers.proxies import Generates
from relayrl.workers.reward import RewardWorker, score_trajectories


class NothingToTrain(Exception):
    """Nothing to train this step (every trajectory failed or every group was filtered): the step is skipped."""


def add(total: dict[str, float], more: dict[str, float]) -> None:
    """Sum `more` into `total`, key by key."""
    for k, v in more.items():
        total[k] = total.get(k, 0.0) + v


def failure_counts(trajs: list[Trajectory]) -> dict[str, float]:
    """rollout/failed(/<kind>) and rollout/dropped when the failure policy dropped everything."""
    out = {"rollout/failed": 0.0, "rollout/dropped": float(len(trajs))}
    for t in trajs:
        if t.failure_kind is not None:
            out["rollout/failed"] += 1
            key = f"rollout/failed/{t.failure_kind}"
            out[key] = out.get(key, 0.0) + 1
    return out


def filter_fractions(counts: dict[str, float]) -> dict[str, float]:
    """Per-round fractions summed over refill rounds -> fractions of every group generated this step (<= 1):
    filter/zero_var_frac and filter/out_of_range_frac from the summed group counts; filter/refills = rounds - 1."""
    out = dict(counts)
    seen = out.get("filter/groups_kept", 0.0) + out.get("filter/groups_dropped", 0.0)
    for what in ("zero_var", "out_of_range"):
        if f"filter/{what}_frac" in out:
            out[f"filter/{what}_frac"] = out.get(f"filter/groups_{what}", 0.0) / max(seen, 1.0)
    if "filter/rounds" in out:
        out["filter/refills"] = out["filter/rounds"] - 1.0
    return out


def rank_timings(call_s: float, ready_s: dict[str, list[float]]) -> dict[str, float]:
    """timing/rollout_rank_min / _max: seconds from the rollout call to its first / last rank's trajectories
    ready (on Ray: in the object store, not yet fetched); timing/rollout_return: from the last rank ready to
    the merged trajectories in this process (fetching and unpickling what the earlier ranks' overlap did
    not hide; ~0 in-process). `ready_s`: the generator role's ready times per method (LocalRole / RayRole)."""
    ranks = ready_s.get("rollout") or [call_s]
    return {
        "timing/rollout_rank_min": min(ranks),
        "timing/rollout_rank_max": max(ranks),
        "timing/rollout_return": max(0.0, call_s - max(ranks)),
    }


def rollout_seed(seed: int, step: int, attempt: int) -> int:
    """The generation seed of one attempt (refill round) of a step."""
    return (seed * 1_000_003 + step * 1009 + attempt) % (2**31)


def draw_prompts(
    prompts: list[PromptSample], sampler: ResumableSampler, need: int, drawn: dict[int, int]
) -> list[PromptSample]:
    """The next `need` prompts. A prompt drawn twice in one step (a dataset smaller than a step) gets a
    distinct index for its copy, so its groups stay apart (groups are keyed by index) and it is sampled
    with a different seed. `drawn`: prompt index -> times drawn this step (updated)."""
    out = []
    size = len(prompts)
    for _ in range(need):
        sample = prompts[sampler.next_indices()[0]]
        k = drawn.get(sample.index, 0)
        drawn[sample.index] = k + 1
        out.append(sample if k == 0 else replace(sample, index=sample.index + k * size))
    return out


class RolloutPhase:
    """Sample, score, apply the failure policy and dynamic filtering; refill dropped groups (bounded)."""

    def __init__(
        self,
        *,
        generator: RoleHandle[Generates],
        reward: RoleHandle[RewardWorker],
        prompts: list[PromptSample],
        sampler: ResumableSampler,
        rollout: RolloutConfig,
        filter: FilterConfig,
        seed: int,
    ) -> None:
        self.generator, self.reward = generator, reward
        self.prompts, self.sampler = prompts, sampler
        self.rollout, self.filter, self.seed = rollout, filter, seed

    def __call__(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """The trajectories to train step `step` on, grouped, with their rollout/* and filter/* metrics."""
        r, f = self.rollout, self.filter
        kept: list[Trajectory] = []
        counts: dict[str, float] = {}
        last_error = ""
        drawn: dict[int, int] = {}
        attempts = 1 + (f.max_refills if f.enabled else 0)
        for attempt in range(attempts):
            need = r.prompts_per_step - len(kept) // r.n_samples
            if need <= 0:
                break
            prompts = draw_prompts(self.prompts, self.sampler, need, drawn)
            t0 = time.perf_counter()
            trajs = self.generator.call(Generates.rollout, prompts, rollout_seed(self.seed, step, attempt))
            add(counts, rank_timings(time.perf_counter() - t0, getattr(self.generator, "ready_s", {})))
            t0 = time.perf_counter()
            trajs = score_trajectories(self.reward, trajs)  # in place; an actor gets no log-probs
            add(counts, {"rollout/generated": float(len(trajs)), "timing/reward": time.perf_counter() - t0})
            try:
                ok, m = apply_failure_policy(trajs, r.failure_policy)
            except RolloutFailure as e:
                ok, m, last_error = [], failure_counts(trajs), str(e)
            add(counts, m)
            ok = complete_groups(ok, r.n_samples) if r.failure_policy != "drop_sample" else ok
            if f.enabled:
                ok, m = filter_groups(ok, r.n_samples, f)
                add(counts, m)
            kept += ok
            counts["filter/rounds"] = float(attempt + 1)
        if not kept:
            raise NothingToTrain(
                f"step {step}: nothing to train: {counts.get('rollout/failed', 0):.0f} of "
                f"{counts.get('rollout/generated', 0):.0f} samples failed, "
                f"{counts.get('filter/groups_dropped', 0):.0f} groups filtered out (filter.max_refills="
                f"{f.max_refills}); counts: {filter_fractions(counts)}"
                + (f". Last error: {last_error}" if last_error else "")
            )
        return kept, {**filter_fractions(counts), **rollout_metrics(kept)}
