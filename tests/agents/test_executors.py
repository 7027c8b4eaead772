"""Executors on a real engine: token-exact single turn, multi-turn masking and length limits, user files."""

from __future__ import annotations

import asyncio
import logging
import textwrap

import pytest

from relayrl.agents.base import AgentInstanceBase, TrajectoryStatus
from relayrl.agents.executors import MultiTurnExecutor, SingleTurnExecutor, execute_all
from relayrl.agents.failures import FailureLog, apply_failure_policy
from relayrl.agents.loader import load_agent_from_file
from relayrl.data.records import PromptSample
from relayrl.rollout.base import SamplingParams


def _sample(tok, text="12+34=", index=0, label="46") -> PromptSample:
    return PromptSample(index=index, prompt=text, prompt_ids=tok(text)["input_ids"], label=label)


def test_single_turn_token_exact(any_engine, tiny_model, tiny_tokenizer, tf_logprobs):
    engine = any_engine
    sample = _sample(tiny_tokenizer)
    ex = SingleTurnExecutor(engine, tiny_tokenizer)
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=1)
    trajs = asyncio.run(ex.execute(sample, params))
    assert len(trajs) == 3
    # one request with n=3: one generate call (hf) / one prefill of the prompt (native)
    assert getattr(engine, "generate_calls", None) == 1 or getattr(engine, "prefill_count", None) == 1
    P = len(sample.prompt_ids)
    for t in trajs:
        gen = t.token_ids[P:]
        assert t.token_ids[:P] == sample.prompt_ids and 1 <= len(gen) <= 12
        assert t.action_mask == [False] * P + [True] * len(gen)
        assert len(t.rollout_logprobs) == len(t.token_ids) and t.rollout_logprobs[:P] == [0.0] * P
        ref = tf_logprobs(tiny_model, t.token_ids, temperature=0.7)
        assert t.rollout_logprobs[P:] == pytest.approx(ref[P:], abs=1e-4)
        ends_with_eos = gen[-1] == tiny_tokenizer.eos_token_id
        assert t.truncated == (not ends_with_eos) and t.truncated == (len(gen) == 12 and not ends_with_eos)
        body = gen[:-1] if ends_with_eos else gen
        assert t.response_text == tiny_tokenizer.decode(body, skip_special_tokens=True)
        assert t.status == TrajectoryStatus.OK and t.reward is None


def test_execute_all_keeps_groups_in_order(engine, tiny_tokenizer):
    samples = [_sample(tiny_tokenizer, f"{i}+1=", index=i) for i in range(3)]
    ex = SingleTurnExecutor(engine, tiny_tokenizer)
    trajs = asyncio.run(execute_all(ex, samples, SamplingParams(n=2, max_new_tokens=4)))
    assert [t.sample.index for t in trajs] == [0, 0, 1, 1, 2, 2]
    assert all(t.token_ids[: len(t.sample.prompt_ids)] == t.sample.prompt_ids for t in trajs)


def test_single_turn_total_length_limit(engine, tiny_tokenizer):
    sample = _sample(tiny_tokenizer)  # 6 prompt tokens
    ex = SingleTurnExecutor(engine, tiny_tokenizer, max_total_len=9)
    trajs = asyncio.run(ex.execute(sample, SamplingParams(n=2, max_new_tokens=50, seed=0)))
    assert all(len(t.token_ids) <= 9 for t in trajs)
    log = FailureLog()
    short = SingleTurnExecutor(engine, tiny_tokenizer, max_total_len=6, log=log)
    failed = asyncio.run(short.execute(sample, SamplingParams(n=2)))
    assert [t.failure_kind for t in failed] == ["prompt_too_long"] * 2
    assert log.counts["prompt_too_long"] == 2


class Counter3(AgentInstanceBase):
    """Feedback " ok\\n" after each action, done after 3 turns, reward 0.5 per turn."""

    def __init__(self) -> None:
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        return {
            "rewards": 0.5,
            "scores": float(self.turn),
            "environment_feedback": f" ok{self.turn}\n",
            "done": self.turn >= 3,
            "extra_logs": {"turn": self.turn},
        }


def _segments(mask: list[bool]) -> list[tuple[bool, int]]:
    segs: list[tuple[bool, int]] = []
    for m in mask:
        if segs and segs[-1][0] == m:
            segs[-1] = (m, segs[-1][1] + 1)
        else:
            segs.append((m, 1))
    return segs


def test_multi_turn_feedback_masked_and_token_exact(any_engine, tiny_model, tiny_tokenizer, tf_logprobs):
    sample = _sample(tiny_tokenizer, "hi:")
    ex = MultiTurnExecutor(Counter3, any_engine, tiny_tokenizer)
    trajs = asyncio.run(ex.execute(sample, SamplingParams(n=2, temperature=1.0, max_new_tokens=5, seed=3)))
    for t in trajs:
        assert t.status == TrajectoryStatus.OK and t.num_turns == 3 and not t.truncated
        assert t.reward == 1.5 and t.score == 3.0 and t.extra_logs == {"turn": 3.0}
        # [prompt][action][ ok1\n][action][ ok2\n][action][ ok3\n]
        segs = _segments(t.action_mask)
        assert [m for m, _ in segs] == [False, True, False, True, False, True, False]
        pos = 0
        for k, (is_action, length) in enumerate(segs):
            ids = t.token_ids[pos : pos + length]
            if not is_action and k > 0:
                assert ids == tiny_tokenizer(f" ok{k // 2}\n")["input_ids"]
                assert t.rollout_logprobs[pos : pos + length] == [0.0] * length
            pos += length
        ref = tf_logprobs(tiny_model, t.token_ids)
        acts = [i for i, m in enumerate(t.action_mask) if m]
        assert [t.rollout_logprobs[i] for i in acts] == pytest.approx([ref[i] for i in acts], abs=1e-4)


class Forever(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 0.0, "environment_feedback": " again\n", "done": False}


def test_multi_turn_total_length_enforced_across_turns(engine, tiny_tokenizer):
    sample = _sample(tiny_tokenizer, "go:")
    limit = len(sample.prompt_ids) + 30
    ex = MultiTurnExecutor(Forever, engine, tiny_tokenizer, max_total_len=limit)
    (t,) = asyncio.run(ex.execute(sample, SamplingParams(n=1, max_new_tokens=4, seed=0)))
    assert len(t.token_ids) == limit  # filled exactly: feedback is cut to fit, then no room is left
    assert t.truncated and t.num_turns >= 3 and t.status == TrajectoryStatus.OK
    log = FailureLog()
    full = MultiTurnExecutor(Forever, engine, tiny_tokenizer, max_total_len=len(sample.prompt_ids), log=log)
    (t0,) = asyncio.run(full.execute(sample, SamplingParams(n=1, max_new_tokens=4, seed=0)))
    assert t0.status == TrajectoryStatus.FAILED and t0.failure_kind == "prompt_too_long"
    assert t0.reward is None and t0.num_turns == 0 and log.counts == {"prompt_too_long": 1}  # not a 0.0
    capped = MultiTurnExecutor(Forever, engine, tiny_tokenizer, max_turns=2)
    (t2,) = asyncio.run(capped.execute(sample, SamplingParams(n=1, max_new_tokens=4, seed=0)))
    assert t2.num_turns == 2 and t2.truncated


class Faulty(AgentInstanceBase):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def step(self, states, **kwargs):
        import torch

        if self.mode == "raise":
            raise KeyError("missing tool")
        if self.mode == "timeout":
            await asyncio.sleep(30)
        reward = {"nan": float("nan"), "wrong_length": torch.tensor([1.0, 0.0]), "ok": 1.0}[self.mode]
        return {"rewards": reward, "environment_feedback": "", "done": True}


@pytest.mark.parametrize(
    ("mode", "kind"),
    [("raise", "exception"), ("nan", "nan"), ("wrong_length", "wrong_length"), ("timeout", "timeout")],
)
def test_multi_turn_failures_marked_counted_logged_once(engine, tiny_tokenizer, caplog, mode, kind):
    log = FailureLog()
    ex = MultiTurnExecutor(
        Faulty, engine, tiny_tokenizer, step_timeout=0.3, agent_kwargs={"mode": mode}, log=log
    )
    samples = [_sample(tiny_tokenizer, f"q{i}:", index=i) for i in range(2)]
    with caplog.at_level(logging.ERROR, logger="relayrl.agents"):
        trajs = [
            t for s in samples for t in asyncio.run(ex.execute(s, SamplingParams(n=2, max_new_tokens=3)))
        ]
    assert [t.status for t in trajs] == [TrajectoryStatus.FAILED] * 4
    assert all(t.failure_kind == kind and t.reward is None for t in trajs)
    assert log.counts[kind] == 4
    records = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(records) == 1  # logged once per kind, with the sample's context
    assert "sample 0" in records[0].getMessage() and "'q0:'" in records[0].getMessage()
    kept, metrics = apply_failure_policy(trajs, "zero_reward")
    assert metrics[f"rollout/failed/{kind}"] == 4.0 and [t.reward for t in kept] == [0.0] * 4


OPENRLHF_AGENT = textwrap.dedent(
    """
    import random
    from typing import Any, Dict

    import torch
    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


    class AgentInstance(AgentInstanceBase):
        async def __init__(self, *args, **kwargs):
            self.step_idx = 0
            self.max_steps = random.randint(1, 3)

        async def reset(self, states: dict, **kwargs):
            return {"observation": states["observation"]}

        async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
            observation_text = states["observation_text"]
            action_text = states["action_text"]
            label = states["label"]
            done = self.step_idx >= self.max_steps
            reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0)
            environment_feedback = "\\n[CORRECT]\\n" if done else "\\n[INCORRECT] try again\\n"
            self.step_idx += 1
            return {
                "rewards": reward,
                "scores": reward,
                "environment_feedback": environment_feedback,
                "done": done,
                "sampling_params": states.get("sampling_params", None),
                "extra_logs": {"dummy_scores": reward},
            }


    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)
    """
)


def test_openrlhf_readme_agent_file_runs_unchanged(engine, tiny_tokenizer, tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text(OPENRLHF_AGENT)
    ex = load_agent_from_file(path, engine, tiny_tokenizer, max_total_len=200)
    assert isinstance(ex, MultiTurnExecutor)
    trajs = asyncio.run(
        ex.execute(_sample(tiny_tokenizer, "x:"), SamplingParams(n=3, max_new_tokens=4, seed=0))
    )
    for t in trajs:
        assert t.status == TrajectoryStatus.OK, t.error
        assert 2 <= t.num_turns <= 4 and t.reward in (0.0, 1.0) and not t.truncated
        assert tiny_tokenizer.decode(t.token_ids).endswith("\n[CORRECT]\n")


def test_load_agent_errors_name_the_file(tmp_path):
    bad = tmp_path / "nothing.py"
    bad.write_text("x = 1\n")
    with pytest.raises(AttributeError, match=r"nothing\.py defines none of"):
        load_agent_from_file(bad)
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        load_agent_from_file(tmp_path / "missing.py")


class Rewriter(AgentInstanceBase):
    async def reset(self, states, **kwargs):
        return {"observation": "sys> " + states["observation"]}

    def step(self, states, **kwargs):  # a plain (sync) step is accepted too
        assert states["observation_text"] == "sys> hi:"
        return {"rewards": 1.0, "environment_feedback": "", "done": True}


def test_reset_may_rewrite_the_observation(engine, tiny_tokenizer):
    ex = MultiTurnExecutor(Rewriter, engine, tiny_tokenizer)
    (t,) = asyncio.run(
        ex.execute(_sample(tiny_tokenizer, "hi:"), SamplingParams(n=1, max_new_tokens=3, seed=0))
    )
    ids = tiny_tokenizer("sys> hi:")["input_ids"]
    assert t.status == TrajectoryStatus.OK and t.reward == 1.0 and t.num_turns == 1
    assert t.sample.prompt == "sys> hi:" and t.sample.prompt_ids == ids and t.token_ids[: len(ids)] == ids
    assert t.action_mask[: len(ids)] == [False] * len(ids) and all(t.action_mask[len(ids) :])


def test_cli_entry_points_parse():
    from relayrl.apps.serve import main
    from relayrl.apps.serve_rm import main as serve_main

    assert main(["--help"]) == 0 and serve_main(["--help"]) == 0
    assert main([]) == 2  # --model is required
    assert serve_main(["--port", "0"]) == 2  # neither --model nor --reward-func
    assert main(["--bogus", "1"]) == 2
    assert serve_main(["--reward-func", "no/such/reward.py"]) == 2  # a clear message, no traceback
    assert main(["--model", "/no/such/model_dir"]) == 2


def test_engine_length_limit_ends_episode(tiny_model, tiny_tokenizer):
    from relayrl.rollout.hf import HFEngine

    eng = HFEngine(tiny_model.eval(), tiny_tokenizer, max_seq_len=20)  # no max_total_len on the executor
    try:
        ex = MultiTurnExecutor(Forever, eng, tiny_tokenizer)
        (t,) = asyncio.run(
            ex.execute(_sample(tiny_tokenizer, "go:"), SamplingParams(n=1, max_new_tokens=4, seed=0))
        )
    finally:
        eng.close()
    assert t.status == TrajectoryStatus.OK and t.truncated and len(t.token_ids) <= 20 + len(" again\n")


def test_single_turn_prompt_filling_engine_limit_fails(tiny_model, tiny_tokenizer):
    from relayrl.rollout.hf import HFEngine

    eng = HFEngine(tiny_model.eval(), tiny_tokenizer, max_seq_len=6)  # the 6-token prompt fills it
    try:
        ex = SingleTurnExecutor(eng, tiny_tokenizer, log=FailureLog())
        trajs = asyncio.run(ex.execute(_sample(tiny_tokenizer), SamplingParams(n=2)))
    finally:
        eng.close()
    assert [t.failure_kind for t in trajs] == ["prompt_too_long"] * 2 and ex.log.counts[
        "prompt_too_long"
    ] == 2


RELEASE = __import__("threading").Event()


class SyncBlocking(AgentInstanceBase):
    """A plain `def step` that blocks (until the test releases it) or raises its own TimeoutError."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def step(self, states, **kwargs):
        if self.mode == "block":
            RELEASE.wait(30)
        else:
            raise TimeoutError("tool call timed out")
        return {"rewards": 1.0, "done": True}


@pytest.mark.parametrize(("mode", "kind"), [("block", "timeout"), ("own_timeout", "exception")])
def test_sync_step_runs_off_the_loop_and_times_out(engine, tiny_tokenizer, mode, kind):
    log = FailureLog()
    ex = MultiTurnExecutor(
        SyncBlocking, engine, tiny_tokenizer, step_timeout=0.3, agent_kwargs={"mode": mode}, log=log
    )
    try:
        (t,) = asyncio.run(ex.execute(_sample(tiny_tokenizer), SamplingParams(n=1, max_new_tokens=2, seed=0)))
    finally:
        RELEASE.set()  # let the blocked worker thread finish
    assert t.status == TrajectoryStatus.FAILED and t.failure_kind == kind and log.counts == {kind: 1}
    if kind == "exception":  # the agent's own TimeoutError is not reported as our timeout
        assert "step() turn 1 raised TimeoutError: tool call timed out" in t.error


class ScoreThenNone(AgentInstanceBase):
    """Turn 1 gives scores=0.9; turn 2 (the last) gives none: score falls back to the total reward."""

    def __init__(self) -> None:
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        out = {"rewards": 0.25, "environment_feedback": " next\n", "done": self.turn == 2}
        if self.turn == 1:
            out["scores"] = 0.9
        return out


def test_score_is_last_steps_scores_else_total_reward(engine, tiny_tokenizer):
    ex = MultiTurnExecutor(ScoreThenNone, engine, tiny_tokenizer)
    (t,) = asyncio.run(ex.execute(_sample(tiny_tokenizer), SamplingParams(n=1, max_new_tokens=2, seed=0)))
    assert t.status == TrajectoryStatus.OK and t.num_turns == 2
    assert t.reward == 0.5 and t.score == 0.5  # 0.25 + 0.25; turn 1's 0.9 is not the last step's


class BadParams(AgentInstanceBase):
    async def step(self, states, **kwargs):
        return {"rewards": 1.0, "done": False, "sampling_params": {"temperature": -1.0}}


def test_invalid_next_sampling_params_fail_the_episode_not_the_batch(engine, tiny_tokenizer):
    ex = MultiTurnExecutor(BadParams, engine, tiny_tokenizer, log=FailureLog())
    trajs = asyncio.run(ex.execute(_sample(tiny_tokenizer), SamplingParams(n=2, max_new_tokens=2, seed=0)))
    assert [t.failure_kind for t in trajs] == ["bad_output"] * 2
    assert "sampling_params {'temperature': -1.0} is invalid: SamplingParams.temperature must be >= 0" in (
        trajs[0].error
    )

    class BadFeedback(AgentInstanceBase):
        async def step(self, states, **kwargs):
            return {"rewards": 1.0, "done": False, "environment_feedback": ["not", "text"]}

    ex = MultiTurnExecutor(BadFeedback, engine, tiny_tokenizer, log=FailureLog())
    (t,) = asyncio.run(ex.execute(_sample(tiny_tokenizer), SamplingParams(n=1, max_new_tokens=2, seed=0)))
    assert t.failure_kind == "bad_output" and "environment_feedback is list, expected str" in t.error


def test_load_agent_syntax_error_and_bad_class_name_the_file(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\ndef step(:\n")
    with pytest.raises(ImportError, match=r"cannot load agent file .*broken\.py' \(line 2\): SyntaxError"):
        load_agent_from_file(broken)
    failing = tmp_path / "failing.py"
    failing.write_text("import not_a_module_xyz\n")
    with pytest.raises(ImportError, match=r"failing\.py.*ModuleNotFoundError.*not_a_module_xyz"):
        load_agent_from_file(failing)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("class AgentInstance:\n    pass\n")
    with pytest.raises(TypeError, match=r"wrong\.py: .*must be a subclass of .*AgentInstanceBase"):
        load_agent_from_file(wrong)
