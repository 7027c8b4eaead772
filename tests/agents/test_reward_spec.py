"""The one reward-spec grammar (relayrl.agents.rewards.spec): resolving the spec in force and parsing it."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.agents.rewards import AgentRewards, build_reward_source
from relayrl.agents.rewards.spec import AGENT, SourceSpec, parse_reward_spec, resolve_reward_spec


def test_resolve_prefers_source_then_task_then_agent():
    assert resolve_reward_spec("x.py", task="add2", agent="single") == "x.py"
    assert resolve_reward_spec("", task="add2", agent="single") == "task:add2"
    assert resolve_reward_spec("", task="guess", agent="multi") == AGENT  # a multi-turn agent rewards itself
    assert resolve_reward_spec("", task="", agent="single") == ""


def test_parse_every_form(tmp_path):
    assert parse_reward_spec("agent") == SourceSpec(kind="agent", text="agent")
    assert parse_reward_spec("task:add2") == SourceSpec(kind="task", target="add2", text="task:add2")
    assert parse_reward_spec("r.py").kind == "file" and parse_reward_spec("r.py").target == "r.py"
    remote = parse_reward_spec("http://a:1/get_reward, https://b:2/get_reward")
    assert remote.kind == "remote" and remote.urls == ("http://a:1/get_reward", "https://b:2/get_reward")
    assert parse_reward_spec(["http://a", "http://b"]).urls == ("http://a", "http://b")
    assert parse_reward_spec(f"rm:{tmp_path}") == SourceSpec(
        kind="rm", target=str(tmp_path), text=f"rm:{tmp_path}"
    )
    assert parse_reward_spec(str(tmp_path)).kind == "rm" and parse_reward_spec(str(tmp_path)).target == str(
        tmp_path
    )
    with pytest.raises(ValueError, match="not understood"):
        parse_reward_spec("nothing-here")


def test_agent_spec_builds_a_source_that_leaves_rewards_alone():
    source = build_reward_source("agent")
    assert isinstance(source, AgentRewards)
    assert asyncio.run(source.score([])) is None
