"""User code that calls sys.exit(): an error naming the file, line and exit code, never the end of the process
(before, `relayrl rl` / `generate` exited 0 with nothing written and `serve-rm` stopped on its first request)."""

from __future__ import annotations

import asyncio
import textwrap

import aiohttp
import pytest

from relayrl.agents.base import Trajectory
from relayrl.agents.executors import MultiTurnExecutor
from relayrl.agents.http import start_app
from relayrl.agents.loader import load_agent_from_file
from relayrl.agents.remote_rm import build_rm_app
from relayrl.agents.rewards import build_reward_source
from relayrl.agents.rewards.func import load_reward_func
from relayrl.agents.user_code import UserCodeExit
from relayrl.data.records import PromptSample
from relayrl.rollout.base import SamplingParams


def _trajs(n: int = 2) -> list[Trajectory]:
    sample = PromptSample(index=0, prompt="1+1=", prompt_ids=[5, 6], label="2")
    return [
        Trajectory(
            sample=sample,
            token_ids=[5, 6, 7],
            action_mask=[False, False, True],
            rollout_logprobs=[0.0, 0.0, -1.0],
            response_text="2",
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_reward_func_calling_sys_exit_is_an_error_of_the_file(tmp_path, kind):
    f = tmp_path / "r.py"
    f.write_text(f"import sys\n\n\n{kind} reward_func(queries, prompts, labels):\n    sys.exit(0)\n")
    source = build_reward_source(str(f))
    with pytest.raises(
        UserCodeExit, match=rf"reward_func in reward file '{f}' called sys.exit\(0\) at {f}, line 5"
    ):
        asyncio.run(source.score(_trajs()))


def test_reward_file_calling_sys_exit_at_import(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(
        ImportError, match=rf"cannot load reward file '{f}': it called sys.exit\(3\) .*\(line 2\)"
    ):
        build_reward_source(str(f))


def test_serve_rm_answers_500_and_keeps_serving(tmp_path):
    # the scorer that serve-rm builds from a file: one request's sys.exit() is that request's error (HTTP 500
    # naming the file and code); the server stays up for the next request
    f = tmp_path / "r.py"
    f.write_text(
        "import sys\n\n\ndef reward_func(queries, prompts, labels):\n"
        "    if labels[0] == 'quit':\n        sys.exit(7)\n    return [1.0] * len(queries)\n"
    )

    async def run() -> list[tuple[int, str]]:
        runner, port = await start_app(build_rm_app(load_reward_func(f)))
        out = []
        try:
            async with aiohttp.ClientSession() as http:
                for label in ("quit", "ok"):
                    body = {"query": ["1+1=2"], "prompts": ["1+1="], "labels": [label]}
                    async with http.post(f"http://127.0.0.1:{port}/get_reward", json=body) as r:
                        out.append((r.status, await r.text()))
        finally:
            await runner.cleanup()
        return out

    (status, text), (status2, _) = asyncio.run(run())
    assert status == 500 and "sys.exit(7)" in text and str(f) in text
    assert status2 == 200


AGENT = """
import sys
from relayrl.agents.base import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    {kind} step(self, states, **kwargs):
        sys.exit(0)
"""


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_agent_step_calling_sys_exit_stops_with_an_error(engine, tiny_tokenizer, tmp_path, kind):
    f = tmp_path / "agent.py"
    f.write_text(textwrap.dedent(AGENT.format(kind=kind)))
    ex = load_agent_from_file(f, engine, tiny_tokenizer)
    assert isinstance(ex, MultiTurnExecutor)
    sample = PromptSample(index=0, prompt="hi:", prompt_ids=tiny_tokenizer("hi:")["input_ids"])
    with pytest.raises(UserCodeExit, match=rf"step\(\) turn 1 called sys.exit\(0\) at {f}, line 8"):
        asyncio.run(ex.execute(sample, SamplingParams(n=1, max_new_tokens=3, seed=0)))
