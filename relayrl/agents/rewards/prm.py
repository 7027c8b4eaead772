"""A process reward model (PRM) as an RL reward source: per-step scores -> token-level rewards.

    prm = ProcessRewardModel.from_pretrained("runs/prm/final", step_separator="\\n")
    prm.step_ends(token_ids, action_mask)   -> [e_1, ..., e_K]   token index of each step's last token
    prm.step_scores(token_ids, ends)        -> [s_1, ..., s_K]   p(good) at each step's placeholder
    source = PRMSource(prm, outcome="dense")                      `await source.score(trajs)`

The model is what `relayrl prm` trains (relayrl.trainers.prm): a causal LM read at a placeholder token after
each step, p(good) = softmax(logits[good], logits[bad])[0]. Its placeholder and (good, bad) tokens come from
the `prm.json` that `relayrl prm` writes beside the exported model (`PRM_FILE`); a folder without one uses the
recipe's defaults (relayrl.config.recipes.PRMSection).

Steps of a response: a step ends at every action token whose text contains `step_separator` (default a
newline; "" = only the placeholder token itself) and at the last action token. The PRM reads the
trajectory's own token ids (token-exact: the PRM shares the policy's tokenizer, nothing is re-tokenized) with
the placeholder id inserted right after each step's last token; a step that already ends with the placeholder
token is read where it stands. Sequences longer than `max_len` tokens (after insertion) keep their last
`max_len` tokens; a step whose placeholder falls outside scores from what is left.

Rewards, by `outcome`:
    dense   dense_rewards[e_k] = s_k at each step's last token (0 elsewhere) and reward = 0: the whole signal
            sits at the step boundaries (relayrl.algorithms.advantages: R_t = ... + d_t); score = min_k s_k
    min     reward = score = min_k s_k (the solution is as good as its worst step), no dense rewards
    last    reward = score = s_K (the PRM's judgement of the finished solution), no dense rewards
Every trajectory also logs prm_steps, prm_min, prm_last, prm_mean. Scores are probabilities in [0, 1], used
as they are.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import torch

from relayrl.agents.base import Trajectory
from relayrl.agents.failures import FailureLog, mark_failed
from relayrl.agents.rewards.base import fail_all, pending
from relayrl.agents.user_code import run_in_thread
from relayrl.config.recipes import PRMSection
from relayrl.data.preference import single_token
from relayrl.models.loading import load_pretrained, load_tokenizer, resolve_device

PRM_FILE = "prm.json"
"""Beside a PRM's weights: {"placeholder": str, "reward_tokens": [good, bad]} (written by `relayrl prm`)."""
OUTCOMES = ("dense", "min", "last")
Outcome = Literal["dense", "min", "last"]


def write_prm_file(folder: str | Path, placeholder: str, reward_tokens: tuple[str, str] | list[str]) -> Path:
    """Record a PRM's placeholder and reward tokens beside its weights (`PRM_FILE`)."""
    path = Path(folder) / PRM_FILE
    path.write_text(json.dumps({"placeholder": placeholder, "reward_tokens": list(reward_tokens)}) + "\n")
    return path


class ProcessRewardModel:
    """Step scores of token-id sequences with a causal-LM PRM (see module doc)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        placeholder: str,
        reward_tokens: tuple[str, str] | list[str],
        step_separator: str = "\n",
        max_len: int = 4096,
    ) -> None:
        self.model, self.tokenizer, self.max_len = model.eval(), tokenizer, max_len
        self.placeholder = single_token(tokenizer, placeholder, "the PRM's placeholder")
        self.good = single_token(tokenizer, reward_tokens[0], "the PRM's good token")
        self.bad = single_token(tokenizer, reward_tokens[1], "the PRM's bad token")
        self.separator = step_separator
        self._ends_step: dict[int, bool] = {}

    @classmethod
    def from_pretrained(
        cls, path: str, *, device: str | None = None, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> ProcessRewardModel:
        """Load a `relayrl prm` export (its `prm.json`, else PRMSection's defaults)."""
        from transformers import AutoModelForCausalLM

        meta_path = Path(path) / PRM_FILE
        default = PRMSection()
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        model = load_pretrained(
            AutoModelForCausalLM, path, what="process reward model", device=resolve_device(device, "device"),
            dtype=dtype,
        )  # fmt: skip
        return cls(
            model,
            load_tokenizer(path),
            placeholder=meta.get("placeholder", default.placeholder),
            reward_tokens=meta.get("reward_tokens", default.reward_tokens),
            **kwargs,
        )

    def _is_step_end(self, token: int) -> bool:
        if token not in self._ends_step:
            text = self.tokenizer.decode([token])
            self._ends_step[token] = token == self.placeholder or bool(
                self.separator and self.separator in text
            )
        return self._ends_step[token]

    def step_ends(self, token_ids: list[int], action_mask: list[bool]) -> list[int]:
        """Token index of each step's last token: action tokens that end a step, and the last action token."""
        actions = [i for i, a in enumerate(action_mask) if a]
        ends = [i for i in actions if self._is_step_end(token_ids[i])]
        if actions and (not ends or ends[-1] != actions[-1]):
            ends.append(actions[-1])
        return ends

    def prm_input(self, token_ids: list[int], ends: list[int]) -> tuple[list[int], list[int]]:
        """(the PRM's input ids, the placeholder position of each step) for steps ending at `ends`."""
        ids, positions, start = [], [], 0
        for e in ends:
            ids += token_ids[start : e + 1]
            if token_ids[e] != self.placeholder:
                ids.append(self.placeholder)
            positions.append(len(ids) - 1)
            start = e + 1
        ids += token_ids[start:]
        return ids, positions

    @torch.no_grad()
    def step_scores(self, token_ids: list[int], ends: list[int]) -> list[float]:
        """p(good) at each step's placeholder (one forward pass)."""
        ids, positions = self.prm_input(token_ids, ends)
        cut = max(0, len(ids) - self.max_len)
        device = next(self.model.parameters()).device
        logits = self.model(input_ids=torch.tensor([ids[cut:]], device=device)).logits[0]
        at = torch.tensor([max(p - cut, 0) for p in positions], device=device)
        pair = logits[at][:, [self.good, self.bad]].float()
        return torch.softmax(pair, dim=-1)[:, 0].tolist()


class PRMSource:
    """Reward source over a `ProcessRewardModel` (see module doc for `outcome`)."""

    def __init__(
        self,
        prm: ProcessRewardModel,
        *,
        outcome: Outcome = "dense",
        timeout: float | None = None,
        log: FailureLog | None = None,
    ) -> None:
        if outcome not in OUTCOMES:
            raise ValueError(f"reward.prm_outcome must be one of {OUTCOMES}, got {outcome!r}")
        self.prm, self.outcome, self.timeout, self.log = prm, outcome, timeout, log
        self.name = "process reward model"

    def _score_all(self, trajs: list[Trajectory]) -> list[tuple[list[int], list[float]]]:
        out = []
        for t in trajs:
            ends = self.prm.step_ends(t.token_ids, t.action_mask)
            out.append((ends, self.prm.step_scores(t.token_ids, ends) if ends else []))
        return out

    async def score(self, trajs: list[Trajectory]) -> None:
        todo = pending(trajs)
        if not todo:
            return
        try:
            results = await run_in_thread(self._score_all, todo, timeout=self.timeout)
        except TimeoutError:
            return fail_all(todo, "timeout", f"no result within {self.timeout}s", self.name, self.log)
        except Exception as e:
            return fail_all(todo, "exception", f"raised {type(e).__name__}: {e}", self.name, self.log)
        for t, (ends, scores) in zip(todo, results, strict=True):
            self._fill(t, ends, scores)

    def _fill(self, t: Trajectory, ends: list[int], scores: list[float]) -> None:
        if not scores:  # no action token: nothing was generated, nothing to judge
            t.reward = t.score = 0.0
            t.extra_logs["prm_steps"] = 0.0
            return
        if not all(math.isfinite(s) for s in scores):
            return mark_failed(t, "nan", f"non-finite step scores {scores}", source=self.name, log=self.log)
        low, last = min(scores), scores[-1]
        if self.outcome == "dense":
            dense = [0.0] * len(t.token_ids)
            for e, s in zip(ends, scores, strict=True):
                dense[e] = s
            t.dense_rewards, t.reward, t.score = dense, 0.0, low
        else:
            t.reward = t.score = low if self.outcome == "min" else last
        t.extra_logs.update(
            {
                "prm_steps": float(len(scores)),
                "prm_min": low,
                "prm_last": last,
                "prm_mean": sum(scores) / len(scores),
            }
        )
