"""Agent executors: one `PromptSample` -> n token-exact `Trajectory`s on a `RolloutEngine`.

    SingleTurnExecutor   one engine request with n (one shared prefill); token_ids = prompt + completion.
    MultiTurnExecutor    drives a user's `AgentInstanceBase` (OpenRLHF's reset/step contract) turn by turn:
                         [prompt][action 1][feedback 1][action 2][feedback 2]...  action tokens are trained
                         on (action_mask True, rollout log-probs kept); feedback tokens are tokenized once,
                         appended as ids and masked out. `max_total_len` bounds prompt + every turn.

Seams: the engine is only used through `engine.generate(GenerationRequest)`. User code (agent __init__,
reset, step) runs under a timeout; anything it does wrong (raises, returns NaN / inf, a reward with several
elements, a missing key, times out) marks that trajectory FAILED via `failures.mark_failed`; the RL loop
applies the failure policy. Engine errors are not user errors and propagate.

Text: `action_text` given to `step` and `Trajectory.response_text` are decoded with special tokens skipped
(like vLLM's `output.text`); token ids are never re-derived from text except for environment feedback.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from relayrl.agents.base import AgentExecutorBase, AgentInstanceBase, Trajectory
from relayrl.agents.env_images import EnvironmentImageError, feedback_ids
from relayrl.agents.failures import FailureLog, ScalarError, check_scalar, mark_failed
from relayrl.agents.user_code import UserCodeExit, await_user, exit_error, run_in_thread
from relayrl.data.loading import DataError
from relayrl.data.records import PromptSample
from relayrl.rollout.base import Completion, FinishReason, GenerationRequest, SamplingParams


def decode_response(tokenizer: Any, token_ids: list[int], stop_ids: set[int] | None = None) -> str:
    """Text of generated ids, without a trailing stop token and without special tokens."""
    if stop_ids and token_ids and token_ids[-1] in stop_ids:
        token_ids = token_ids[:-1]
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def stop_ids_of(tokenizer: Any, params: SamplingParams) -> set[int]:
    ids = set(params.stop_token_ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return ids


def prompt_only(sample: PromptSample) -> Trajectory:
    """A trajectory holding only the prompt (actions are appended to it)."""
    n = len(sample.prompt_ids)
    return Trajectory(
        sample=sample,
        token_ids=list(sample.prompt_ids),
        action_mask=[False] * n,
        rollout_logprobs=[0.0] * n,
        versions=[-1] * n,
        images=sample.images,
    )


def append_action(traj: Trajectory, comp: Completion) -> None:
    if len(comp.logprobs) != len(comp.token_ids):
        raise RuntimeError(
            f"engine returned {len(comp.token_ids)} tokens but {len(comp.logprobs)} log-probs "
            "(request logprobs=True); this is an engine bug"
        )
    traj.token_ids.extend(comp.token_ids)
    traj.action_mask.extend([True] * len(comp.token_ids))
    traj.rollout_logprobs.extend(float(x) for x in comp.logprobs)
    versions = comp.versions if len(comp.versions) == len(comp.token_ids) else [-1] * len(comp.token_ids)
    traj.versions.extend(int(v) for v in versions)
    if comp.routes is not None:  # the request's prompt was the whole history: these cover every token so far
        traj.routes = comp.routes


def append_feedback(traj: Trajectory, ids: list[int]) -> None:
    traj.token_ids.extend(ids)
    traj.action_mask.extend([False] * len(ids))
    traj.rollout_logprobs.extend([0.0] * len(ids))
    traj.versions.extend([-1] * len(ids))


def _require_bound(ex: AgentExecutorBase) -> None:
    if ex.engine is None or ex.tokenizer is None:
        raise RuntimeError(
            f"{type(ex).__name__} has no engine/tokenizer: call .bind(engine, tokenizer) first"
        )


class SingleTurnExecutor(AgentExecutorBase):
    """One engine request with `params.n` samples; rewards come later from a reward source."""

    def __init__(
        self,
        engine: Any = None,
        tokenizer: Any = None,
        *,
        max_total_len: int | None = None,
        log: FailureLog | None = None,
    ) -> None:
        self.bind(engine, tokenizer, max_total_len=max_total_len)
        self.log = log

    async def execute(self, sample: PromptSample, params: SamplingParams) -> list[Trajectory]:
        _require_bound(self)
        max_new = params.max_new_tokens
        if self.max_total_len is not None:
            room = self.max_total_len - len(sample.prompt_ids)
            if room <= 0:
                trajs = [prompt_only(sample) for _ in range(params.n)]
                msg = (
                    f"prompt has {len(sample.prompt_ids)} tokens, max_total_len {self.max_total_len} leaves "
                    "no room to generate; filter long prompts or raise max_total_len"
                )
                for t in trajs:
                    mark_failed(t, "prompt_too_long", msg, source="executor", log=self.log)
                return trajs
            max_new = min(max_new, room)
        request = GenerationRequest(
            prompt_ids=list(sample.prompt_ids),
            params=replace(params, max_new_tokens=max_new),
            request_id=f"sample-{sample.index}-{uuid.uuid4().hex[:8]}",  # unique: vLLM rejects a duplicate id
            images=sample.images,
        )
        result = await self.engine.generate(request)
        stops = stop_ids_of(self.tokenizer, params)
        trajs = []
        for comp in result.completions:
            traj = prompt_only(sample)
            append_action(traj, comp)
            traj.truncated = comp.finish_reason != FinishReason.STOP
            traj.response_text = decode_response(self.tokenizer, comp.token_ids, stops)
            if comp.finish_reason == FinishReason.ABORT:
                mark_failed(
                    traj, "aborted", "the engine aborted the request", source="executor", log=self.log
                )
            elif not comp.token_ids:
                msg = "the engine generated nothing: the prompt fills its length limit (engine max_seq_len)"
                mark_failed(traj, "prompt_too_long", msg, source="executor", log=self.log)
            trajs.append(traj)
        return trajs


async def execute_all(
    executor: AgentExecutorBase, samples: list[PromptSample], params: SamplingParams
) -> list[Trajectory]:
    """Run every sample concurrently (the engine batches them); trajectories grouped by sample, in order."""
    groups = await asyncio.gather(*(executor.execute(s, params) for s in samples))
    return [t for g in groups for t in g]


class _UserError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def _user_call(fn: Callable[..., Any], *args: Any, what: str, timeout: float | None) -> Any:
    """`fn(*args)` (user code) bounded by `timeout`; every way it can go wrong becomes a `_UserError`.

    An `async def` runs on the event loop; a plain `def` (allowed for `reset` / `step`) runs on a daemon
    worker thread, so a blocking one cannot stall the other episodes or outlive its timeout. A
    `TimeoutError` raised *by* the user code (e.g. its own HTTP client) is an "exception", not a "timeout". A
    `sys.exit()` in it is `UserCodeExit`, re-raised: an error of the run, not a failed episode."""

    def raised(e: Exception) -> _UserError:
        return _UserError("exception", f"{what} raised {type(e).__name__}: {e}")

    def guarded(*a: Any) -> Any:  # on the worker thread: user errors are not timeouts
        try:
            return fn(*a)
        except SystemExit as e:
            raise exit_error(e, what) from None
        except Exception as e:
            raise raised(e) from e

    cm = None
    try:
        if _is_async(fn):
            result = fn(*args)
        else:
            result = await run_in_thread(guarded, *args, timeout=timeout)
            if not inspect.isawaitable(result):
                return result
        cm = asyncio.timeout(timeout)
        async with cm:
            return await await_user(result, what)
    except TimeoutError as e:
        if cm is not None and not cm.expired():
            raise raised(e) from e
        raise _UserError("timeout", f"{what} did not finish within {timeout}s") from None
    except (_UserError, UserCodeExit):  # sys.exit() in the agent: an error of the run, not a failed sample
        raise
    except Exception as e:
        raise raised(e) from e


def _is_async(fn: Any) -> bool:
    """`async def` functions and bound methods (a sync callable returning an awaitable is awaited too)."""
    return inspect.iscoroutinefunction(fn)


async def _instantiate(cls: type[Any], kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`; also supports OpenRLHF's `async def __init__` example."""
    if inspect.iscoroutinefunction(cls.__init__):
        new: Any = cls.__new__  # the class's own __new__, as `cls(...)` would call it
        obj = new(cls)
        await obj.__init__(**kwargs)
        return obj
    return cls(**kwargs)


def _next_params(current: SamplingParams, given: Any) -> SamplingParams:
    """Sampling params for the next turn from a step's "sampling_params" (SamplingParams or dict)."""
    if given is None:
        return current
    if isinstance(given, SamplingParams):
        return given
    if isinstance(given, dict):
        known = {f.name for f in fields(SamplingParams)}
        unknown = set(given) - known
        if unknown:
            raise _UserError("bad_output", f"step() sampling_params has unknown keys {sorted(unknown)}")
        try:
            return replace(current, **given)
        except (TypeError, ValueError) as e:  # SamplingParams validates its fields
            raise _UserError("bad_output", f"step() sampling_params {given!r} is invalid: {e}") from None
    raise _UserError(
        "bad_output", f"step() sampling_params is {type(given).__name__}; use SamplingParams/dict"
    )


def _scalar_logs(logs: Any) -> dict[str, float]:
    if not logs:
        return {}
    if not isinstance(logs, dict):
        raise _UserError("bad_output", f"step() extra_logs is {type(logs).__name__}, expected a dict")
    try:
        return {str(k): check_scalar(v, f"extra_logs[{k!r}]") for k, v in logs.items()}
    except ScalarError as e:
        raise _UserError(e.kind, str(e)) from None


class MultiTurnExecutor(AgentExecutorBase):
    """Runs `params.n` independent episodes of `agent_cls` (a fresh instance each) for one prompt.

    Reward of an episode = sum of step rewards (OpenRLHF); score = the last step's "scores", or the total
    reward when the last step gave none (as OpenRLHF); extra_logs = the last step's. `truncated` is True
    when the episode ended without `done` (length limit or `max_turns`). An episode that could not take a
    single turn (the prompt fills the length limit) is FAILED "prompt_too_long", never rewarded 0.0.
    """

    def __init__(
        self,
        agent_cls: type[AgentInstanceBase],
        engine: Any = None,
        tokenizer: Any = None,
        *,
        max_total_len: int | None = None,
        step_timeout: float | None = 60.0,
        max_turns: int | None = None,
        agent_kwargs: dict[str, Any] | None = None,
        log: FailureLog | None = None,
    ) -> None:
        if not (isinstance(agent_cls, type) and issubclass(agent_cls, AgentInstanceBase)):
            raise TypeError(f"{agent_cls!r} must be a subclass of relayrl.agents.base.AgentInstanceBase")
        self.agent_cls = agent_cls
        self.bind(engine, tokenizer, max_total_len=max_total_len)
        self.step_timeout = step_timeout
        self.max_turns = max_turns
        self.agent_kwargs = agent_kwargs or {}
        self.log = log

    async def execute(self, sample: PromptSample, params: SamplingParams) -> list[Trajectory]:
        _require_bound(self)
        return list(await asyncio.gather(*(self._episode(sample, params, i) for i in range(params.n))))

    async def _episode(self, sample: PromptSample, params: SamplingParams, i: int) -> Trajectory:
        traj = prompt_only(sample)
        try:
            agent = await _user_call(
                _instantiate,
                self.agent_cls,
                self.agent_kwargs,
                what="AgentInstance()",
                timeout=self.step_timeout,
            )
            states = {"observation": sample.prompt, "label": sample.label}
            reset = await _user_call(agent.reset, states, what="reset()", timeout=self.step_timeout)
            if not isinstance(reset, dict) or not isinstance(reset.get("observation"), str):
                raise _UserError("bad_output", "reset() must return a dict with an 'observation' string")
            if reset["observation"] != sample.prompt:  # the environment rewrote the prompt: tokenize it once
                ids = self.tokenizer(reset["observation"], add_special_tokens=False)["input_ids"]
                traj = prompt_only(replace(sample, prompt=reset["observation"], prompt_ids=list(ids)))
            await self._turns(traj, agent, params, i)
        except _UserError as e:
            mark_failed(traj, e.kind, str(e), source=f"agent {self.agent_cls.__name__}", log=self.log)
        traj.response_text = self.tokenizer.decode(
            traj.token_ids[traj.prompt_len :], skip_special_tokens=True
        )
        return traj

    def _feedback_ids(self, traj: Trajectory, feedback: str, images: Any, turn: int) -> list[int]:
        """The feedback's token ids; with `environment_images` (a VLM), their expanded pad tokens too, which
        must fit the length limit whole (a cut image is a failed episode, not a silent truncation)."""
        before = traj.images
        try:
            ids = feedback_ids(self.tokenizer, feedback, images, traj, f"step() turn {turn}")
        except (EnvironmentImageError, DataError) as e:
            raise _UserError("bad_output", str(e)) from None
        room = None if self.max_total_len is None else self.max_total_len - len(traj.token_ids)
        if traj.images is not before and room is not None and len(ids) > room:
            raise _UserError(
                "too_long", f"step() turn {turn}: environment images need {len(ids)} tokens, {room} left"
            )
        return ids

    async def _turns(self, traj: Trajectory, agent: Any, params: SamplingParams, episode: int) -> None:
        sample, limit = traj.sample, self.max_total_len
        sp, observation, total, score, done, turn = params, traj.sample.prompt, 0.0, None, False, 0
        while not done and (self.max_turns is None or turn < self.max_turns):
            room = sp.max_new_tokens if limit is None else min(sp.max_new_tokens, limit - len(traj.token_ids))
            if room <= 0:
                break
            seed = None if sp.seed is None else sp.seed + 1_000_003 * episode + 7919 * turn
            request = GenerationRequest(
                prompt_ids=list(traj.token_ids),
                params=replace(sp, n=1, max_new_tokens=room, seed=seed),
                request_id=f"sample-{sample.index}-ep{episode}-turn{turn}-{uuid.uuid4().hex[:8]}",
                images=traj.images,
            )
            comp = (await self.engine.generate(request)).completions[0]
            if not comp.token_ids and comp.finish_reason == FinishReason.LENGTH:
                break  # the engine's own length limit is reached: nothing more can be generated
            append_action(traj, comp)
            turn += 1
            if comp.finish_reason == FinishReason.ABORT:
                raise _UserError("aborted", f"the engine aborted turn {turn}")
            action_text = decode_response(self.tokenizer, comp.token_ids, stop_ids_of(self.tokenizer, sp))
            states = {"observation_text": observation, "action_text": action_text, "label": sample.label}
            states["sampling_params"] = sp
            out = await _user_call(agent.step, states, what=f"step() turn {turn}", timeout=self.step_timeout)
            if not isinstance(out, dict) or not {"rewards", "done"} <= set(out):
                raise _UserError(
                    "bad_output", f"step() turn {turn} must return a dict with 'rewards' and 'done'"
                )
            try:
                total += check_scalar(out["rewards"], f"step() turn {turn} rewards")
                has_score = out.get("scores") is not None
                score = check_scalar(out["scores"], f"step() turn {turn} scores") if has_score else None
            except ScalarError as e:
                raise _UserError(e.kind, str(e)) from None
            traj.extra_logs = _scalar_logs(out.get("extra_logs"))
            feedback = out.get("environment_feedback") or ""
            if not isinstance(feedback, str):
                raise _UserError(
                    "bad_output",
                    f"step() turn {turn} environment_feedback is {type(feedback).__name__}, expected str",
                )
            observation = observation + action_text + feedback
            images = out.get("environment_images")
            if feedback or images:
                ids = self._feedback_ids(traj, feedback, images, turn)
                if limit is not None:
                    ids = ids[: max(0, limit - len(traj.token_ids))]
                append_feedback(traj, ids)
            sp = _next_params(sp, out.get("sampling_params"))
            done = bool(out["done"])
        traj.num_turns, traj.truncated = turn, not done
        if turn == 0:  # nothing was generated or stepped: no reward exists (never a silent 0.0)
            msg = (
                f"prompt has {len(traj.token_ids)} tokens, the length limit (max_total_len {limit} or the "
                "engine's max_seq_len) leaves no room to generate; filter long prompts or raise the limit"
            )
            mark_failed(traj, "prompt_too_long", msg, source="executor", log=self.log)
            return
        traj.reward, traj.score = total, (total if score is None else score)
