"""Reward for the RL convergence tests: the fraction of response characters that are digits.

A randomly initialised tiny model emits a digit ~10% of the time (10 of 101 tokens), so every estimator
has signal from the first step and can push the rate up within a few dozen steps.
"""


def reward_func(queries, prompts, labels, **kwargs):
    responses = [q[len(p) :] for q, p in zip(queries, prompts, strict=True)]
    out = []
    for r in responses:
        text = r.replace("<|im_end|>", "")
        out.append(sum(c.isdigit() for c in text) / max(1, len(text)) if text else 0.0)
    return {"rewards": out, "scores": out}
