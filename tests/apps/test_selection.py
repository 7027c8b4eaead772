"""The selection rules of `relayrl generate` on hand-built trajectories: the row each one writes, what is
never selected, and the conditional-SFT prompt (tests/apps/test_generate.py runs them inside the command)."""

from __future__ import annotations

import pytest

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.apps.selection import (
    DEFAULT_CONDITION,
    SELECTORS,
    SelectOptions,
    condition_prompt,
    select_all,
    select_best_of_n,
    select_pairs,
    select_rejection,
    sft_row,
)
from relayrl.data.records import PromptSample
from relayrl.data.templates import render_chat


def _traj(text, reward, *, prompt="p", label=None, status=TrajectoryStatus.OK, failure=None, messages=None):
    sample = PromptSample(index=0, prompt=prompt, prompt_ids=[1], label=label, messages=messages)
    return Trajectory(
        sample=sample,
        token_ids=[1, 2],
        action_mask=[False, True],
        rollout_logprobs=[0.0, -1.0],
        reward=reward,
        status=status,
        response_text=text,
        failure_kind=failure,
    )


def test_the_registry_names_the_five_documented_rules():
    assert list(SELECTORS) == ["all", "best_of_n", "rejection", "pairs", "conditional"]


def test_an_sft_row_carries_reward_failure_and_label_only_when_they_exist():
    ok = _traj("out", 0.5, label="7")
    assert sft_row(ok, SelectOptions(scored=True)) == {
        "input": "p",
        "output": "out",
        "reward": 0.5,
        "label": "7",
    }
    assert sft_row(ok, SelectOptions(scored=False)) == {"input": "p", "output": "out", "label": "7"}
    failed = _traj("oops", None, status=TrajectoryStatus.FAILED, failure="exception")
    assert sft_row(failed, SelectOptions(scored=True)) == {
        "input": "p",
        "output": "oops",
        "reward": None,
        "failure": "exception",
    }
    assert sft_row(ok, SelectOptions(scored=False), prompt="other")["input"] == "other"


def test_usable_means_non_empty_and_scored_when_a_reward_source_ran():
    opts = SelectOptions(scored=False)
    group = [_traj("a", None), _traj("", None), _traj("b", None)]
    assert [r["output"] for r in select_all([group], opts).rows] == ["a", "b"]
    # with a reward source, a sample whose reward is missing is never selected
    scored = SelectOptions(scored=True, threshold=0.0)
    assert select_rejection([[_traj("a", None), _traj("b", 0.1)]], scored).rows == [
        {"input": "p", "output": "b", "reward": 0.1}
    ]
    assert select_best_of_n([[_traj("a", None), _traj("b", -3.0)]], scored).rows[0]["output"] == "b"


def test_pairs_keep_the_label_and_skip_a_prompt_without_usable_samples():
    opts = SelectOptions(scored=True)
    groups = [
        [_traj("lo", -1.0, label="4"), _traj("hi", 2.0, label="4"), _traj("mid", 0.0, label="4")],
        [_traj("", 1.0), _traj("x", None, status=TrajectoryStatus.FAILED, failure="nan")],  # nothing usable
    ]
    out = select_pairs(groups, opts)
    assert out.ties == 0  # a prompt with no usable sample is skipped, not counted as a tie
    assert out.rows == [
        {
            "input": "p",
            "chosen": "hi",
            "rejected": "lo",
            "chosen_reward": 2.0,
            "rejected_reward": -1.0,
            "label": "4",
        }
    ]


def test_a_plain_prompt_is_conditioned_by_the_template():
    sample = PromptSample(index=0, prompt="2+2=", prompt_ids=[1])
    assert condition_prompt(sample, 0.75, DEFAULT_CONDITION, None) == "<rm_score>: 0.8 2+2="
    assert condition_prompt(sample, 1.0, "[{reward}] {input}", None) == "[1.0] 2+2="


def test_a_chat_prompt_gets_the_condition_in_its_last_user_turn(tiny_tokenizer):
    msgs = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
    ]
    sample = PromptSample(index=0, prompt="rendered", prompt_ids=[1], messages=msgs)
    got = condition_prompt(sample, 0.25, DEFAULT_CONDITION, tiny_tokenizer)
    want = [*msgs[:2], {"role": "user", "content": "<rm_score>: 0.2 second"}]
    assert got == render_chat(tiny_tokenizer, want, add_generation_prompt=True)
    assert msgs[2]["content"] == "second"  # the sample's own messages are not modified


@pytest.mark.parametrize("messages", [None, [{"role": "system", "content": "be brief"}]])
def test_a_chat_without_a_user_turn_is_conditioned_as_plain_text(messages):
    sample = PromptSample(index=0, prompt="q", prompt_ids=[1], messages=messages)
    assert condition_prompt(sample, 0.0, DEFAULT_CONDITION, None) == "<rm_score>: 0.0 q"
