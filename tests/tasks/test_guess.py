"""The `guess` multi-turn task: data split, the environment's rules, replay agreement, real episodes."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.agents.base import TrajectoryStatus
from relayrl.data.records import PromptSample
from relayrl.rollout.base import SamplingParams
from relayrl.tasks import get_task
from relayrl.tasks.guess import GuessAgent


def test_rows_split_and_ranges():
    task = get_task("guess")
    train, test = task.make_rows("train", 200, seed=0), task.make_rows("test", 50, seed=0)
    assert {r["input"] for r in train}.isdisjoint({r["input"] for r in test})
    # 36 ranges in 1..9, split by a hash of the range (relayrl.tasks.base.is_held_out): 30 train, 6 test
    assert len({r["input"] for r in train}) == 30 and len({r["input"] for r in test}) == 6
    for r in train + test:
        lo, hi = map(int, r["input"][len("guess ") : -2].split("-"))
        assert lo <= r["label"] <= hi and r["output"] == str(r["label"])
    assert task.make_rows("train", 5, seed=1) == task.make_rows("train", 5, seed=1)
    with pytest.raises(ValueError, match="split must be"):
        task.make_rows("dev", 1, 0)


def _play(actions: list[str], secret: int, max_turns: int = 4) -> list[dict]:
    async def run() -> list[dict]:
        agent = GuessAgent(max_turns=max_turns)
        await agent.reset({"observation": "guess 1-9: ", "label": secret})
        outs = []
        for a in actions:
            out = await agent.step({"observation_text": "", "action_text": a, "label": secret})
            outs.append(out)
            if out["done"]:
                break
        return outs

    return asyncio.run(run())


def test_agent_rules():
    outs = _play(["4", "8", "x", "6"], secret=6)
    assert [o["environment_feedback"] for o in outs] == [" higher\n", " lower\n", " invalid\n", " correct\n"]
    assert [o["done"] for o in outs] == [False, False, False, True]
    assert [o["rewards"] for o in outs] == [0.0, 0.0, 0.0, 0.25]  # solved at turn 4 of 4: 1 - 3/4
    assert outs[-1]["scores"] == 1.0 and outs[-1]["extra_logs"] == {
        "solved": 1.0,
        "turns": 4.0,
        "invalid": 1.0,
    }
    first = _play(["6"], secret=6)
    assert first[0]["rewards"] == 1.0 and first[0]["done"]
    lost = _play(["1", "2", "3", "4", "5"], secret=6)
    assert len(lost) == 4 and lost[-1]["done"] and lost[-1]["rewards"] == 0.0 and lost[-1]["scores"] == 0.0


def test_replay_reward_matches_agent():
    task = get_task("guess")
    assert task.reward("4 higher\n8 lower\n6 correct\n", 6) == 0.5  # solved at turn 3: 1 - 2/4
    assert task.reward("6", 6) == 1.0 and task.reward("5 higher\n", 6) == 0.0
    assert task.reward("1 higher\n2 higher\n3 higher\n4 higher\n6 correct\n", 6) == 0.0  # past max_turns


def test_episodes_on_real_engine(engine, tiny_tokenizer):
    task = get_task("guess")
    ex = task.executor(engine, tiny_tokenizer, max_total_len=64)
    rows = task.make_rows("train", 2, seed=0)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=task.max_new_tokens, seed=0)
    for i, r in enumerate(rows):
        sample = PromptSample(
            index=i, prompt=r["input"], prompt_ids=tiny_tokenizer(r["input"])["input_ids"], label=r["label"]
        )
        for t in asyncio.run(ex.execute(sample, params)):
            assert t.status == TrajectoryStatus.OK, t.error
            assert 1 <= t.num_turns <= 4 and len(t.token_ids) <= 64
            assert t.reward == task.reward(t.response_text, r["label"])  # replay agrees with the agent
            hints = _hints_in_order(t.response_text)
            assert len(hints) == t.num_turns  # one hint per turn, appended as masked tokens
            masked = [tok for tok, m in zip(t.token_ids, t.action_mask, strict=True) if not m]
            assert tiny_tokenizer.decode(masked[len(sample.prompt_ids) :]) == "".join(
                f" {w}\n" for w in hints
            )
    metrics = asyncio.run(task.evaluate(engine, tiny_tokenizer, task.make_rows("test", 3, seed=0)))
    assert set(metrics) == {f"eval/guess/{k}" for k in ("solved", "reward", "turns", "invalid", "failed")}
    assert 1.0 <= metrics["eval/guess/turns"] <= 4.0 and metrics["eval/guess/failed"] == 0.0


def _hints_in_order(text: str) -> list[str]:
    import re

    return re.findall(r" (higher|lower|correct|invalid)\n", text)
