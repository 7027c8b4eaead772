"""The selection rules of `relayrl generate` (relayrl/apps/generate.py): one prompt's scored samples ->
the rows written. Each rule is a function registered in SELECTORS; docs/generate.md shows a row of each.

    all          every sample (failed ones with reward null and their failure kind)
    best_of_n    the best-scored sample per prompt (OpenRLHF's "rejection sampling")
    rejection    samples with reward >= threshold, at most max_per_prompt (the best) per prompt
    pairs        best vs worst per prompt (DPO rows); prompts whose best and worst tie are counted and skipped
    conditional  every scored sample, its reward written into the prompt (conditional SFT)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.config.generate import DEFAULT_CONDITION
from relayrl.data.records import PromptSample
from relayrl.data.templates import render_chat


@dataclass(kw_only=True, slots=True)
class SelectOptions:
    """The settings the selectors read."""

    scored: bool
    """A reward source ran (rows carry "reward")."""
    threshold: float = 0.5
    """rejection: lowest kept reward."""
    max_per_prompt: int = 0
    """rejection: most rows per prompt (0 = no limit)."""
    template: str = DEFAULT_CONDITION
    """conditional: the prompt format."""
    tokenizer: Any = None
    """conditional: renders chat prompts again after the user message is conditioned."""


@dataclass(kw_only=True, slots=True)
class Selection:
    """A selector's output."""

    rows: list[dict[str, Any]]
    """Rows to write, in order."""
    ties: int = 0
    """pairs: prompts skipped because best and worst are equal (or fewer than two usable samples)."""


def _usable(t: Trajectory, opts: SelectOptions) -> bool:
    """OK, non-empty and (with a reward source) scored: a sample a selection may write."""
    return (
        t.status == TrajectoryStatus.OK
        and bool(t.response_text.strip())
        and (not opts.scored or t.reward is not None)
    )


def _reward(t: Trajectory) -> float:
    """The reward of a usable sample of a scored selection (`_usable` checked it is there)."""
    assert t.reward is not None, "a selection that reads rewards runs on scored, usable samples only"
    return t.reward


def sft_row(t: Trajectory, opts: SelectOptions, prompt: str | None = None) -> dict[str, Any]:
    """{"input", "output", "reward" (when scored), "failure" (when FAILED), "label" (when known)}."""
    row: dict[str, Any] = {"input": t.sample.prompt if prompt is None else prompt, "output": t.response_text}
    if opts.scored:
        row["reward"] = t.reward
    if t.status != TrajectoryStatus.OK:
        row["failure"] = t.failure_kind
    if t.sample.label is not None:
        row["label"] = t.sample.label
    return row


def select_all(groups: list[list[Trajectory]], opts: SelectOptions) -> Selection:
    """Every sample with a non-empty response; FAILED ones with reward null and their failure kind."""
    return Selection(rows=[sft_row(t, opts) for g in groups for t in g if t.response_text.strip()])


def select_best_of_n(groups: list[list[Trajectory]], opts: SelectOptions) -> Selection:
    """Per prompt the usable sample with the highest reward (the first one among equals)."""
    rows = []
    for g in groups:
        ok = [t for t in g if _usable(t, opts)]
        if ok:
            rows.append(sft_row(max(ok, key=_reward), opts))
    return Selection(rows=rows)


def select_rejection(groups: list[list[Trajectory]], opts: SelectOptions) -> Selection:
    """Per prompt the usable samples with reward >= threshold, best first, at most max_per_prompt."""
    rows = []
    for g in groups:
        ok = sorted(
            (t for t in g if _usable(t, opts) and _reward(t) >= opts.threshold), key=lambda t: -_reward(t)
        )
        rows += [sft_row(t, opts) for t in ok[: opts.max_per_prompt or None]]
    return Selection(rows=rows)


def select_pairs(groups: list[list[Trajectory]], opts: SelectOptions) -> Selection:
    """Per prompt (chosen, rejected) = the usable samples with the highest and the lowest reward (the first
    among equals); a prompt whose best and worst rewards are equal gives no pair and is counted in ties."""
    rows, ties = [], 0
    for g in groups:
        ok = [t for t in g if _usable(t, opts)]
        if not ok:
            continue
        best, worst = max(ok, key=_reward), min(ok, key=_reward)
        if best.reward == worst.reward:
            ties += 1
            continue
        row = {"input": best.sample.prompt, "chosen": best.response_text, "rejected": worst.response_text}
        row |= {"chosen_reward": best.reward, "rejected_reward": worst.reward}
        if best.sample.label is not None:
            row["label"] = best.sample.label
        rows.append(row)
    return Selection(rows=rows, ties=ties)


def condition_prompt(sample: PromptSample, reward: float, template: str, tokenizer: Any) -> str:
    """The conditional-SFT prompt: a chat's last user message becomes template(input=message, reward) and
    the chat is rendered again; a plain prompt becomes template(input=prompt, reward)."""
    msgs = sample.messages
    last_user = max((i for i, m in enumerate(msgs or []) if m["role"] == "user"), default=None)
    if msgs is None or last_user is None:
        return template.format(input=sample.prompt, reward=reward)

    msgs = [dict(m) for m in msgs]
    msgs[last_user]["content"] = template.format(input=msgs[last_user]["content"], reward=reward)
    return render_chat(tokenizer, msgs, add_generation_prompt=True)


def select_conditional(groups: list[list[Trajectory]], opts: SelectOptions) -> Selection:
    """Every usable sample, its reward written into its prompt by the template (conditional SFT)."""
    rows = [
        sft_row(t, opts, condition_prompt(t.sample, _reward(t), opts.template, opts.tokenizer))
        for g in groups
        for t in g
        if _usable(t, opts)
    ]
    return Selection(rows=rows)


SELECTORS: dict[str, Callable[[list[list[Trajectory]], SelectOptions], Selection]] = {
    "all": select_all,
    "best_of_n": select_best_of_n,
    "rejection": select_rejection,
    "pairs": select_pairs,
    "conditional": select_conditional,
}
"""`select` name -> selector: groups of one prompt's trajectories -> rows."""
