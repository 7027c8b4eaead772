"""The files in examples/ load and run: reward function, multi-turn agent, OpenAI-client agent, configs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.executors import MultiTurnExecutor
from relayrl.agents.loader import load_agent_from_file
from relayrl.agents.openai_agent import OpenAIAgentExecutor
from relayrl.agents.rewards import build_reward_source
from relayrl.data.records import PromptSample
from relayrl.rollout.base import SamplingParams

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _sample(tok, prompt: str = "12+34=", label: str = "46") -> PromptSample:
    return PromptSample(index=0, prompt=prompt, prompt_ids=tok(prompt)["input_ids"], label=label)


def test_reward_func_example(tiny_tokenizer):
    s = _sample(tiny_tokenizer)
    trajs = []
    for text in ["46", " 46", "47", "x"]:
        ids = tiny_tokenizer(text)["input_ids"] + [tiny_tokenizer.eos_token_id]
        trajs.append(Trajectory(sample=s, token_ids=s.prompt_ids + ids, action_mask=[False] * 6 + [True] * len(ids),
                                rollout_logprobs=[0.0] * (6 + len(ids)), response_text=text))  # fmt: skip
    source = build_reward_source(str(EXAMPLES / "reward_func.py"), tokenizer=tiny_tokenizer)
    asyncio.run(source.score(trajs))
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.0, 0.0]
    assert [t.extra_logs["is_number"] for t in trajs] == [1.0, 1.0, 1.0, 0.0]


def test_agent_func_example(engine, tiny_tokenizer):
    ex = load_agent_from_file(EXAMPLES / "agent_func.py", engine, tiny_tokenizer, max_total_len=80)
    assert isinstance(ex, MultiTurnExecutor)
    trajs = asyncio.run(ex.execute(_sample(tiny_tokenizer), SamplingParams(n=2, max_new_tokens=3, seed=0)))
    for t in trajs:
        assert (
            t.status == TrajectoryStatus.OK and 1 <= t.num_turns <= 3 and t.extra_logs["turns"] == t.num_turns
        )
        assert (
            t.response_text.count(" wrong, try again\n") + t.response_text.count(" correct\n") == t.num_turns
        )


def test_openai_agent_example(engine, tiny_tokenizer):
    ex = load_agent_from_file(  # the trainer passes multi-turn options too; they do not apply here
        EXAMPLES / "openai_agent.py",
        engine,
        tiny_tokenizer,
        max_total_len=200,
        max_turns=4,
        step_timeout=30.0,
    )
    assert isinstance(ex, OpenAIAgentExecutor)
    try:
        (t,) = asyncio.run(ex.execute(_sample(tiny_tokenizer), SamplingParams(n=1, max_new_tokens=4, seed=0)))
    finally:
        ex.close()
    assert t.status == TrajectoryStatus.OK, t.error
    assert t.num_turns == t.extra_logs["turns"] and t.reward in (0.0, 1.0, 0.5)  # 1 / turns (<= 2) or 0


@pytest.mark.parametrize("name", ["rl_reward_func", "rl_guess", "rl_remote_rm"])
def test_example_configs_load(name):
    from relayrl.config.base import load_yaml
    from relayrl.config.rl import RLConfig

    cfg = load_yaml(RLConfig, EXAMPLES / "configs" / f"{name}.yaml")
    assert cfg.rollout.failure_policy == "drop_group"
    if cfg.reward.source:
        build_reward_source(cfg.reward.source)  # the source spec is understood (files exist, URLs valid)
