"""Token traces of OpenAI-API sessions, and their conversion to `Trajectory`s (see openai_server.py).

SessionTrace(session_id, calls=[TraceCall(prompt_ids, completion_ids, logprobs, finish_reason), ...])
trace_to_trajectory(trace, sample)       one trajectory for the session: the last call's prompt +
                                         completion; each call's completion is an action span, the
                                         tokens between (messages, template) are masked. FAILED
                                         ("history_rewrite") when a call's prompt did not extend the
                                         previous prompt + completion.
trace_turn_trajectories(trace, sample)   one exact trajectory per call (always valid).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from relayrl.agents.base import Trajectory
from relayrl.agents.executors import append_action, append_feedback, prompt_only
from relayrl.agents.failures import FailureLog, mark_failed
from relayrl.data.records import PromptSample
from relayrl.rollout.base import Completion, FinishReason, SamplingParams


@dataclass(kw_only=True, slots=True)
class TraceCall:
    """One traced completion call."""

    prompt_ids: list[int]
    """[P] the exact prompt the engine saw."""
    completion_ids: list[int]
    """[G] sampled tokens (stop token included when it stopped)."""
    logprobs: list[float]
    """[G] rollout log-probs of `completion_ids`."""
    finish_reason: str
    """"stop", "length" or "abort" (an aborted call fails the session's trajectory)."""
    extends_previous: bool = True
    """True when `prompt_ids` starts with the previous call's prompt + completion (always for the first)."""


@dataclass(kw_only=True, slots=True)
class SessionTrace:
    """All calls of one session, in arrival order."""

    session_id: str
    calls: list[TraceCall] = field(default_factory=list)
    rewrites: list[str] = field(default_factory=list)
    """One error message per call whose prompt did not extend the history."""
    defaults: SamplingParams | None = None
    """Trainer-set sampling parameters for this session (see module doc)."""

    @property
    def rewritten(self) -> bool:
        return bool(self.rewrites)


def first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def trace_to_trajectory(
    trace: SessionTrace, sample: PromptSample | None = None, log: FailureLog | None = None
):
    """One token-exact trajectory for a whole session (FAILED "history_rewrite" if history was rewritten).

    The sample's prompt_ids become the first call's prompt (what the engine really saw)."""
    if not trace.calls:
        raise ValueError(f"session {trace.session_id!r} made no completion calls")
    first, last = trace.calls[0], trace.calls[-1]
    base = sample or PromptSample(index=0, prompt="", prompt_ids=[])
    traj = prompt_only(replace(base, prompt_ids=list(first.prompt_ids)))
    if trace.rewritten:
        mark_failed(traj, "history_rewrite", " | ".join(trace.rewrites), source="openai session", log=log)
        return traj
    for call in trace.calls:
        append_feedback(traj, call.prompt_ids[len(traj.token_ids) :])  # messages since the last completion
        append_action(
            traj,
            Completion(
                token_ids=call.completion_ids,
                logprobs=call.logprobs,
                finish_reason=FinishReason(call.finish_reason),
            ),
        )
    assert traj.token_ids == last.prompt_ids + last.completion_ids  # follows from extends_previous
    traj.num_turns = len(trace.calls)
    traj.truncated = last.finish_reason != "stop"
    aborted = [i + 1 for i, c in enumerate(trace.calls) if c.finish_reason == FinishReason.ABORT.value]
    if aborted:  # as in the executors: an aborted generation is not a trainable episode
        mark_failed(
            traj, "aborted", f"the engine aborted call(s) {aborted}", source="openai session", log=log
        )
    return traj


def trace_turn_trajectories(trace: SessionTrace, sample: PromptSample | None = None) -> list[Trajectory]:
    """One exact trajectory per call (prompt as seen + completion): usable even when history was rewritten."""
    base = sample or PromptSample(index=0, prompt="", prompt_ids=[])
    out = []
    for call in trace.calls:
        traj = prompt_only(replace(base, prompt_ids=list(call.prompt_ids)))
        append_action(
            traj,
            Completion(
                token_ids=call.completion_ids,
                logprobs=call.logprobs,
                finish_reason=FinishReason(call.finish_reason),
            ),
        )
        traj.truncated = call.finish_reason != "stop"
        out.append(traj)
    return out
