"""Train an agent written against the OpenAI API: each episode is one traced session on `OpenAIServer`.

    async def openai_agent(base_url: str, session_id: str, sample: PromptSample) -> float | dict:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
        r = await client.chat.completions.create(model="relayrl", messages=[...],
                                                 extra_headers={"X-Session-Id": session_id})
        ...                                     # tools, more turns, anything
        return reward                           # or {"rewards": r, "scores": s, "extra_logs": {...}}

    executor = OpenAIAgentExecutor(openai_agent, engine, tokenizer)   # or load_agent_from_file(path)

The executor serves the engine on 127.0.0.1 (a free port, from a background thread, so it works from any
event loop), opens a session per episode with the trainer's sampling parameters (they override the
client's temperature / top_p / top_k / seed; max_new_tokens caps max_tokens), runs the agent under a
timeout, and turns the session's token trace into the trajectory (`traces.trace_to_trajectory`): what the
engine saw and sampled, never re-tokenized text. A session whose history was rewritten, an agent that
raises, times out, makes no call or returns a non-finite reward comes back FAILED.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from relayrl.agents.base import AgentExecutorBase, Trajectory, TrajectoryStatus
from relayrl.agents.executors import prompt_only
from relayrl.agents.failures import FailureLog, ScalarError, check_scalar, mark_failed
from relayrl.agents.openai_server import OpenAIServer
from relayrl.agents.traces import trace_to_trajectory
from relayrl.agents.user_code import UserCodeExit, guard_exit
from relayrl.data.records import PromptSample
from relayrl.rollout.base import SamplingParams


class OpenAIAgentExecutor(AgentExecutorBase):
    """Runs `agent_fn(base_url, session_id, sample)` episodes and returns their traced trajectories."""

    def __init__(
        self,
        agent_fn: Callable[..., Any],
        engine: Any = None,
        tokenizer: Any = None,
        *,
        max_total_len: int | None = None,
        timeout: float | None = 300.0,
        model_name: str = "relayrl",
        log: FailureLog | None = None,
    ) -> None:
        self.agent_fn = guard_exit(agent_fn)  # sys.exit() in the agent: UserCodeExit, an error of the run
        self.timeout, self.model_name, self.log = timeout, model_name, log
        self.server: OpenAIServer | None = None
        self.port: int | None = None
        self.bind(engine, tokenizer, max_total_len=max_total_len)

    def bind(self, engine: Any, tokenizer: Any, *, max_total_len: int | None = None) -> OpenAIAgentExecutor:
        self.close()
        super().bind(engine, tokenizer, max_total_len=max_total_len)
        return self

    @property
    def base_url(self) -> str:
        """The OpenAI base URL agents should use (starts the server on first use)."""
        if self.server is None:
            if self.engine is None or self.tokenizer is None:
                raise RuntimeError(
                    "OpenAIAgentExecutor has no engine/tokenizer: call .bind(engine, tokenizer)"
                )
            self.server = OpenAIServer(
                self.engine, self.tokenizer, model_name=self.model_name, max_total_len=self.max_total_len
            )
            self.port = self.server.start_in_thread()
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        if self.server is not None:
            self.server.stop_thread()
            self.server = self.port = None

    async def execute(self, sample: PromptSample, params: SamplingParams) -> list[Trajectory]:
        base_url = self.base_url
        return list(
            await asyncio.gather(*(self._episode(base_url, sample, params, i) for i in range(params.n)))
        )

    async def _episode(
        self, base_url: str, sample: PromptSample, params: SamplingParams, i: int
    ) -> Trajectory:
        assert self.server is not None
        sid = f"sample{sample.index}-ep{i}-{uuid.uuid4().hex[:12]}"
        seed = None if params.seed is None else params.seed + 1_000_003 * i
        self.server.open_session(sid, replace(params, n=1, seed=seed))
        kind: str | None = None
        message = ""
        out: Any = None
        cm = None
        try:
            result = self.agent_fn(base_url, sid, sample)
            if inspect.isawaitable(result):
                cm = asyncio.timeout(self.timeout)
                async with cm:
                    out = await result
            else:
                out = result
        except TimeoutError as e:
            if cm is not None and cm.expired():
                kind, message = "timeout", f"agent did not finish within {self.timeout}s"
            else:  # the agent's own TimeoutError (e.g. its HTTP client's), not ours
                kind, message = "exception", f"agent raised TimeoutError: {e}"
        except UserCodeExit:
            self.server.pop_trace(sid)
            raise
        except Exception as e:
            kind, message = "exception", f"agent raised {type(e).__name__}: {e}"
        trace = self.server.pop_trace(sid)
        if trace is None or not trace.calls:
            traj = prompt_only(sample)
            kind, message = kind or "no_calls", message or f"session {sid!r} made no completion call"
        else:
            traj = trace_to_trajectory(trace, sample, log=self.log)
        if kind is not None and traj.status == TrajectoryStatus.OK:  # a history rewrite is already marked
            mark_failed(traj, kind, message, source="openai agent", log=self.log)
        elif traj.status == TrajectoryStatus.OK:
            self._fill_reward(traj, out)
        traj.response_text = self.tokenizer.decode(
            traj.token_ids[traj.prompt_len :], skip_special_tokens=True
        )
        return traj

    def _fill_reward(self, traj: Trajectory, out: Any) -> None:
        if out is None:
            return  # no reward from the agent: a reward source scores it later
        try:
            if isinstance(out, dict):
                traj.reward = check_scalar(out.get("rewards"), "agent rewards")
                score = out.get("scores")
                traj.score = traj.reward if score is None else check_scalar(score, "agent scores")
                logs = out.get("extra_logs") or {}
                if not isinstance(logs, dict):
                    raise ScalarError(
                        "bad_output", f"agent extra_logs is {type(logs).__name__}, expected a dict"
                    )
                traj.extra_logs.update(
                    {str(k): check_scalar(v, f"extra_logs[{k!r}]") for k, v in logs.items()}
                )
            else:
                traj.reward = traj.score = check_scalar(out, "agent reward")
        except ScalarError as e:
            mark_failed(traj, e.kind, str(e), source="openai agent", log=self.log)
