"""The recipe's task: multi-digit addition with worked column steps (the contract every side of the recipe uses).

A problem is `a+b=` with a and b of 2 to 7 digits (each length drawn uniformly, independently). The answer is
worked column by column from the right, each column "x+y=s" (with "+1" when a carry comes in), then the sum:

    prompt      "7305+968="
    completion  "5+8=13;0+6+1=7;3+9=12;7+0+1=8;ans 8273"       (then the end-of-text token)

Why this task: it is verifiable (one exact integer), it needs several dependent steps (a carry chain, then
reading the digits back in reverse), a ~100M model learns it from scratch from a few thousand demonstrations,
and difficulty grows smoothly with the operand lengths, so a model that is partly right on the SFT set still
has problems it solves sometimes and not always: the samples where RL's reward tells right from wrong.

Contract (examples/recipes/README.md):
    make_rows(n, seed, exclude) -> [{"prompt", "answer", "completion"}]   distinct problems
    score(completion, answer) -> float     the RL reward: 1.0 when the final answer is right, else 0.0 (no
                                           format credit: SFT already teaches the format)
    exact_match(completion, answer) -> bool   the held-out metric (greedy decoding, MAX_NEW_TOKENS new tokens)
    RL_SETTINGS                            group size, lr, prompts per step, temperature, max new tokens
"""

from __future__ import annotations

import random
import re
from typing import Any

import torch

MIN_DIGITS, MAX_DIGITS = 2, 7
"""Operand lengths (inclusive), each operand's drawn uniformly and independently."""

MAX_NEW_TOKENS = 96
"""New tokens for a completion (the longest worked answer, 7 columns + a carry-out, is 63 characters plus the
end token; the character-level tokenizer makes one token per character)."""

RL_SETTINGS: dict[str, Any] = {
    "group_size": 8,
    "learning_rate": 3e-5,
    "prompts_per_step": 64,
    "temperature": 1.0,
    "max_new_tokens": MAX_NEW_TOKENS,
}
"""The RL settings every framework runs the recipe with (relayrl's GRPO / PPO / REINFORCE++ and TRL's GRPO):
samples per prompt, learning rate (AdamW, constant), prompts per step, sampling temperature, new tokens."""

_ANSWER = re.compile(r"ans (-?\d+)\s*$")


def solve(a: int, b: int) -> str:
    """The worked completion of `a+b=` (without the end token)."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        s = x + y + carry
        steps.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        carry = s // 10
    return ";".join(steps) + f";ans {a + b}"


def _operand(rng: random.Random, digits: tuple[int, int]) -> int:
    n = rng.randint(*digits)
    return rng.randint(10 ** (n - 1), 10**n - 1)


def make_rows(
    n: int, seed: int, exclude: set[str] | None = None, digits: tuple[int, int] = (MIN_DIGITS, MAX_DIGITS)
) -> list[dict[str, str]]:
    """`n` distinct problems (none of whose prompts is in `exclude`): prompt, answer, worked completion.
    `digits`: the operand lengths (the recipe's are MIN_DIGITS..MAX_DIGITS; a CPU check uses shorter ones)."""
    rng, seen, rows = random.Random(seed), set(exclude or ()), []
    while len(rows) < n:
        a, b = _operand(rng, digits), _operand(rng, digits)
        prompt = f"{a}+{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "answer": str(a + b), "completion": solve(a, b)})
    return rows


def final_answer(completion: str) -> str | None:
    """The integer after the last "ans " at the end of the completion (text after an end token is ignored),
    or None when the completion does not end that way."""
    text = completion.split("<|im_end|>")[0].strip()
    m = _ANSWER.search(text)
    return m.group(1) if m else None


def exact_match(completion: str, answer: str) -> bool:
    """The held-out metric: the completion's final answer equals `answer` (the worked steps are not graded)."""
    return final_answer(completion) == str(answer).strip()


def score(completion: str, answer: str) -> float:
    """The RL reward: 1.0 for a right final answer, else 0.0 (the same test as `exact_match`)."""
    return 1.0 if exact_match(completion, answer) else 0.0


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs: Any) -> dict[str, Any]:
    """`relayrl rl --reward.source examples/recipes/recipe_task.py` (OpenRLHF's reward_func contract):
    `score` of each response against its label."""
    responses = kwargs.get("responses") or [q[len(p) :] for q, p in zip(queries, prompts, strict=True)]
    rewards = torch.tensor([score(r, str(lab)) for r, lab in zip(responses, labels, strict=True)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
