"""A two-turn agent for the multi-turn RL test (OpenRLHF's AgentInstance contract).

Turn 1: the policy answers; the environment replies "\nmore:" (feedback tokens, masked out of the loss).
Turn 2: the policy answers again; the episode ends. Reward per turn = fraction of digit characters in that
turn's action, so the episode reward (sum of step rewards) is in [0, 2] and a random tiny model starts near 0.2.
"""

from relayrl.agents.base import AgentInstanceBase


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.turn += 1
        text = states["action_text"]
        reward = sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0
        done = self.turn >= 2
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": "" if done else "\nmore:",
            "done": done,
            "extra_logs": {"turn_reward": reward},
        }
