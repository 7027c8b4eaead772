"""Example multi-turn agent for `relayrl rl --rollout.agent multi --rollout.agent_file examples/agent_func.py`.

OpenRLHF's AgentInstance contract (this file also runs under OpenRLHF unchanged if you swap the import):
a fresh `AgentInstance` per episode, `reset(states)` -> {"observation"}, `step(states)` -> {"rewards",
"scores", "environment_feedback", "done", "sampling_params", "extra_logs"}. Environment feedback is tokenized
once, appended as token ids and masked out of the loss; rollout.max_len bounds prompt + all turns.

The environment: arithmetic with retries. The prompt is "a+b="; a wrong answer gets " wrong, try again\n" and
another turn (up to 3); a right one ends the episode with reward 1 / turns.
"""

from __future__ import annotations

from typing import Any

from relayrl.agents.base import AgentInstanceBase

MAX_TURNS = 3


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.turn = 0

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return {"observation": states["observation"]}  # keep the prompt (already tokenized at the edge)

    async def step(self, states: dict, **kwargs: Any) -> dict:
        self.turn += 1
        correct = states["action_text"].strip() == str(states["label"]).strip()
        done = correct or self.turn >= MAX_TURNS
        reward = 1.0 / self.turn if correct else 0.0
        return {
            "rewards": reward,
            "scores": float(correct),
            "environment_feedback": " correct\n" if correct else " wrong, try again\n",
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"turns": float(self.turn)},
        }
