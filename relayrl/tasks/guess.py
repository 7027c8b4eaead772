"""`guess`: guess-the-number with higher/lower hints, the built-in multi-turn task.

A row hides a number in a range named by its prompt ("guess 2-7: "). Each turn the policy writes a guess
and stops; the environment (`GuessAgent`, OpenRLHF's AgentInstance contract) answers with feedback that is
appended as masked tokens, and the policy guesses again:

    guess 2-7: 4<|im_end|> higher\n6<|im_end|> lower\n5<|im_end|> correct\n
               ^action     ^feedback  ^action  ^feedback ^action ^feedback (masked)

Hints: " higher\n" (the number is larger), " lower\n", " correct\n" (episode ends), " invalid\n" (no integer
in the action; still costs a turn). The episode ends when correct or after `max_turns` turns.
Reward (at the end only): 1 - (t - 1) / max_turns for a correct guess at turn t (1.0, 0.75, 0.5, 0.25 with 4
turns), else 0; score: 1 if solved, else 0. extra_logs: solved, turns, invalid (count of invalid actions).

Train and test rows never share a prompt: the (lo, hi) ranges are split by arithmetic hash, 20% test.
`GuessNumber.reward(transcript, label)` replays a decoded transcript (actions and hints as above) with the same
rules, so evaluation from text agrees with the agent's reward; `evaluate` runs episodes on an engine.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from relayrl.agents.base import AgentInstanceBase
from relayrl.agents.executors import MultiTurnExecutor
from relayrl.data.records import PromptSample
from relayrl.data.templates import encode
from relayrl.rollout.base import SamplingParams
from relayrl.tasks.base import is_held_out

PROMPT_RE = re.compile(r"guess (\d+)-(\d+): ")
HINT_RE = re.compile(r" (?:higher|lower|correct|invalid)\n")
INT_RE = re.compile(r"\d+")


def turn_reward(turn: int, max_turns: int) -> float:
    """Reward for solving at 1-based `turn`: 1 - (turn - 1) / max_turns."""
    return 1.0 - (turn - 1) / max_turns


def hint(action_text: str, secret: int) -> str:
    """The feedback word for one action: higher / lower / correct / invalid."""
    m = INT_RE.search(action_text)
    if m is None:
        return "invalid"
    guess = int(m.group())
    return "correct" if guess == secret else ("higher" if secret > guess else "lower")


class GuessAgent(AgentInstanceBase):
    """The environment of one episode (a fresh instance per episode)."""

    def __init__(self, max_turns: int = 4) -> None:
        self.max_turns = max_turns
        self.turn = 0
        self.invalid = 0

    async def reset(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if PROMPT_RE.search(states["observation"]) is None:
            raise ValueError(f"guess prompt must contain 'guess LO-HI: ', got {states['observation']!r}")
        return {"observation": states["observation"]}

    async def step(self, states: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        self.turn += 1
        word = hint(states["action_text"], int(states["label"]))
        self.invalid += word == "invalid"
        solved = word == "correct"
        done = solved or self.turn >= self.max_turns
        reward = turn_reward(self.turn, self.max_turns) if solved else 0.0
        return {
            "rewards": reward,
            "scores": float(solved),
            "environment_feedback": f" {word}\n",
            "done": done,
            "extra_logs": {
                "solved": float(solved),
                "turns": float(self.turn),
                "invalid": float(self.invalid),
            },
        }


@dataclass
class GuessNumber:
    """Guess a number in [lo, hi] within `max_turns` turns, 1 <= lo < hi <= `top`."""

    top: int = 9
    max_turns: int = 4
    name: str = "guess"
    agent_cls: type[AgentInstanceBase] = GuessAgent
    """The multi-turn environment: run with `executor(...)` (a MultiTurnExecutor), not a reward source."""
    max_new_tokens: int = 4
    """Tokens a turn needs: a guess and the stop token, with room to spare."""

    def _ranges(self, split: str) -> list[tuple[int, int]]:
        ranges = [(lo, hi) for lo in range(1, self.top + 1) for hi in range(lo + 1, self.top + 1)]
        return [(lo, hi) for lo, hi in ranges if is_held_out(f"guess:{lo}-{hi}") == (split == "test")]

    def make_rows(self, split: str, n: int, seed: int) -> list[dict[str, Any]]:
        """`n` rows {"input": "guess LO-HI: ", "output": str(secret), "label": secret}; rows repeat the
        (range, secret) pool in shuffled order when n exceeds it (the pool is small on purpose)."""
        import random

        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        pool = [(lo, hi, s) for lo, hi in self._ranges(split) for s in range(lo, hi + 1)]
        rng = random.Random(seed)
        rows: list[dict[str, Any]] = []
        while len(rows) < n:
            rng.shuffle(pool)
            rows += [{"input": f"guess {lo}-{hi}: ", "output": str(s), "label": s} for lo, hi, s in pool]
        return rows[:n]

    def reward(self, response: str, label: Any) -> float:
        """Replay a transcript (decoded response of all turns) with the agent's rules."""
        actions = HINT_RE.split(response)
        if len(actions) > 1 and actions[-1] == "":
            actions = actions[:-1]  # the transcript ends with a hint
        for turn, action in enumerate(actions[: self.max_turns], start=1):
            if hint(action, int(label)) == "correct":
                return turn_reward(turn, self.max_turns)
        return 0.0

    def executor(self, engine: Any = None, tokenizer: Any = None, **kwargs: Any) -> MultiTurnExecutor:
        """A `MultiTurnExecutor` running `GuessAgent` episodes of this task."""
        return MultiTurnExecutor(
            self.agent_cls,
            engine,
            tokenizer,
            max_turns=self.max_turns,
            agent_kwargs={"max_turns": self.max_turns},
            **kwargs,
        )

    async def evaluate(
        self,
        engine: Any,
        tokenizer: Any,
        rows: list[dict[str, Any]],
        *,
        temperature: float = 0.0,
        seed: int = 0,
    ) -> dict[str, float]:
        """Play one episode per row; eval/guess/{solved, reward, turns, invalid} means."""
        ex = self.executor(engine, tokenizer)
        params = SamplingParams(n=1, temperature=temperature, max_new_tokens=self.max_new_tokens, seed=seed)
        samples = [  # tokenized like training prompts (templates.encode: no special tokens added)
            PromptSample(
                index=i, prompt=r["input"], prompt_ids=encode(tokenizer, r["input"]), label=r["label"]
            )
            for i, r in enumerate(rows)
        ]
        trajs = [ts[0] for ts in await asyncio.gather(*(ex.execute(s, params) for s in samples))]
        ok = [t for t in trajs if t.reward is not None]
        mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
        return {
            "eval/guess/solved": mean([t.extra_logs.get("solved", 0.0) for t in ok]),
            "eval/guess/reward": mean([t.reward for t in ok]),
            "eval/guess/turns": mean([float(t.num_turns) for t in ok]),
            "eval/guess/invalid": mean([t.extra_logs.get("invalid", 0.0) for t in ok]),
            "eval/guess/failed": float(len(trajs) - len(ok)),
        }
