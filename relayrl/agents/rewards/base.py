"""The reward-source seam: `await source.score(trajs)` fills reward / score / extra_logs in place.

Sources (one file each): `RewardFuncSource` (a Python `reward_func` file, OpenRLHF's contract),
`RemoteRewardSource` (HTTP reward models, OpenRLHF's JSON), `LocalRMSource` (a value-head model in this
process), `TaskRewardSource` (a built-in task's `reward`). `build_reward_source(spec)` picks one from a
string. Every source scores only trajectories whose status is OK, overwrites their reward, sets score to
the returned score (default: the reward) and merges extra_logs. Anything wrong (an exception, NaN / inf,
the wrong number of rewards, a timeout, a server that stays down) marks the affected trajectories FAILED
through `failures.mark_failed`; the RL loop applies the failure policy. Nothing is ever set to 0 silently.

Reward function output (OpenRLHF): a dict {"rewards": [B], "scores": [B] optional, "extra_logs": {name:
scalar or [B]} optional}, or a plain [B] list / tensor of rewards.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.failures import FailureLog, ScalarError, check_scalar, mark_failed


@runtime_checkable
class RewardSource(Protocol):
    """Scores trajectories in place (see module doc)."""

    async def score(self, trajs: list[Trajectory]) -> None: ...


@dataclass(kw_only=True, slots=True)
class RewardBatch:
    """A validated reward output for B trajectories."""

    rewards: list[Any]
    """[B] raw rewards (checked one by one: a NaN fails only its own trajectory)."""
    scores: list[Any] | None = None
    """[B] raw scores, or None (score = reward)."""
    extra_logs: dict[str, list[float]] = field(default_factory=dict)
    """name -> [B] finite floats (a scalar log is repeated B times; non-finite entries are left out)."""


def _as_list(x: Any, what: str, n: int) -> list[Any]:
    if hasattr(x, "tolist"):  # torch tensor / numpy array
        x = x.tolist()
    if not isinstance(x, list | tuple):
        raise ScalarError("bad_output", f"{what} is {type(x).__name__}, expected a list or tensor of {n}")
    if len(x) != n:
        raise ScalarError("wrong_length", f"{what} has {len(x)} entries for a batch of {n}")
    return list(x)


def parse_reward_output(out: Any, n: int) -> RewardBatch:
    """Validate a reward function / server output for a batch of `n`; ScalarError(kind) when unusable."""
    if isinstance(out, dict):
        if "rewards" not in out:
            raise ScalarError("bad_output", f"output dict has keys {sorted(out)}; it needs 'rewards'")
        rewards = _as_list(out["rewards"], "rewards", n)
        scores = None if out.get("scores") is None else _as_list(out["scores"], "scores", n)
        logs: dict[str, list[float]] = {}
        raw_logs = out.get("extra_logs") or {}
        if not isinstance(raw_logs, dict):
            raise ScalarError("bad_output", f"extra_logs is {type(raw_logs).__name__}, expected a dict")
        for name, value in raw_logs.items():
            values = _as_list(value, f"extra_logs[{name!r}]", n) if _is_seq(value) else [value] * n
            logs[str(name)] = [_finite_or_nan(v) for v in values]
        return RewardBatch(rewards=rewards, scores=scores, extra_logs=logs)
    return RewardBatch(rewards=_as_list(out, "rewards", n))


def _is_seq(x: Any) -> bool:
    if hasattr(x, "numel"):
        return x.dim() > 0
    return isinstance(x, list | tuple) or (hasattr(x, "shape") and len(x.shape) > 0)


def _finite_or_nan(v: Any) -> float:
    try:
        return check_scalar(v, "log")
    except ScalarError:
        return math.nan


def fill(trajs: Sequence[Trajectory], batch: RewardBatch, source: str, log: FailureLog | None) -> None:
    """Write a validated batch into trajectories; a non-finite reward / score fails its trajectory only."""
    for i, t in enumerate(trajs):
        try:
            reward = check_scalar(batch.rewards[i], f"rewards[{i}]")
            score = reward if batch.scores is None else check_scalar(batch.scores[i], f"scores[{i}]")
        except ScalarError as e:
            mark_failed(t, e.kind, str(e), source=source, log=log)
            continue
        t.reward, t.score = reward, score
        t.extra_logs.update({k: v[i] for k, v in batch.extra_logs.items() if math.isfinite(v[i])})


def fail_all(
    trajs: Sequence[Trajectory], kind: str, message: str, source: str, log: FailureLog | None
) -> None:
    for t in trajs:
        mark_failed(t, kind, message, source=source, log=log)


def pending(trajs: Sequence[Trajectory]) -> list[Trajectory]:
    """The trajectories a source should score (status OK)."""
    return [t for t in trajs if t.status == TrajectoryStatus.OK]


def chunks(items: list[Any], size: int | None) -> list[list[Any]]:
    if not items:
        return []
    size = size or len(items)
    return [items[i : i + size] for i in range(0, len(items), size)]


def queries_of(trajs: Sequence[Trajectory], tokenizer: Any = None) -> list[str]:
    """OpenRLHF's `queries`: the full text, prompt + response. With a tokenizer it is the decode of all
    token ids with special tokens kept (exactly what OpenRLHF sends; `Trajectory.query_text` when the
    generating rank made it, with the policy's tokenizer, which is the reward source's); else prompt text +
    response text."""
    if tokenizer is not None:
        todo = [t.token_ids for t in trajs if t.query_text is None]
        made = iter(decode_all(tokenizer, todo) if todo else [])
        return [t.query_text if t.query_text is not None else next(made) for t in trajs]
    return [t.sample.prompt + t.response_text for t in trajs]


def plain_fast_decode(tokenizer: Any) -> bool:
    """Whether `tokenizer.decode(ids)` is exactly its Rust backend's `decode(ids)`: a fast tokenizer whose
    class keeps the library's decode and that cleans up no tokenization spaces."""
    cls = type(tokenizer)
    return (
        isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )


def decode_all(tokenizer: Any, ids: Sequence[list[int]]) -> list[str]:
    """`[tokenizer.decode(x, skip_special_tokens=False) for x in ids]`, the same strings: one call into the
    Rust backend when that is exactly the same decode (`plain_fast_decode`; 2x faster on 2,048 x ~150
    tokens, bench/reward_phase.py), else one decode per list."""
    if plain_fast_decode(tokenizer):
        return tokenizer.backend_tokenizer.decode_batch(list(ids), skip_special_tokens=False)
    return [tokenizer.decode(x, skip_special_tokens=False) for x in ids]
