"""Example reward function for `relayrl rl --reward.source examples/reward_func.py` (OpenRLHF's contract).

Verifies arithmetic answers (the add2 / add3 tasks: prompt "12+34=", label "46"). The same file works with
OpenRLHF's `--remote_rm_url examples/reward_func.py` and with `relayrl serve-rm --reward-func`.

    reward_func(queries, prompts, labels, **kwargs) -> {"rewards": [B], "scores": [B], "extra_logs": {...}}

queries: prompt + response text; prompts: prompt text; labels: ground truth. relayrl also passes
`responses` (response text only) when the function accepts it. Runs on a worker thread with a timeout
(reward.timeout_s); an exception, NaN or a wrong-length result fails the batch's samples (counted and
handled by rollout.failure_policy), never a silent zero.
"""

from __future__ import annotations

import re

import torch

EOS = "<|im_end|>"


def reward_func(queries: list[str], prompts: list[str], labels: list[str], **kwargs) -> dict:
    responses = kwargs.get("responses") or [q[len(p) :] for q, p in zip(queries, prompts, strict=True)]
    rewards, formatted = [], []
    for response, label in zip(responses, labels, strict=True):
        answer = response.replace(EOS, "").strip()
        rewards.append(1.0 if answer == str(label).strip() else 0.0)
        formatted.append(1.0 if re.fullmatch(r"-?\d+", answer) else 0.0)
    rewards_t = torch.tensor(rewards)
    return {
        "rewards": rewards_t,  # used for advantages
        "scores": rewards_t,  # 0/1, used by dynamic filtering and pass@k
        "extra_logs": {"is_number": torch.tensor(formatted)},  # per sample, averaged into rollout/* metrics
    }
