"""Pair (RM / DPO), unpaired (KTO) and step (PRM) data from jsonl files: the three row forms, loss masks on
exactly the response (+ EOS), bad rows (errors naming file, line and key, or counted skips), length drops,
margins, labels."""

from __future__ import annotations

import copy
import json
import re

import pytest

from relayrl.config import DataConfig
from relayrl.data.loading import DataError, MalformedRowError
from relayrl.data.preference import build_pair_data, build_step_data, build_unpaired_data

QUIET = {"log": lambda line: None}
GOOD = {"input": "1+1=", "chosen": "2", "rejected": "3"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def ids(tok, text):
    """Token ids of text: the tiny tokenizer is character-level, special tokens are single tokens."""
    return tok(text, add_special_tokens=False)["input_ids"]


def chat(tok, msgs, gen):
    return tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)


def response_mask(prompt_len, total_len):
    return [False] * prompt_len + [True] * (total_len - prompt_len)


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def pairs_from(tmp_path, tok, rows, **cfg):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    margin_key = cfg.pop("margin_key", None)
    return build_pair_data(DataConfig(datasets=[path], **cfg), tok, margin_key=margin_key, **QUIET), path


# ---------------------------------------------------------------------------------------------- pair forms
def test_string_sides(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    (train, evals, stats), _ = pairs_from(
        tmp_path, tok, [{"input": "12+3=", "chosen": "15", "rejected": "150"}]
    )
    (p,) = train
    assert evals == [] and (stats[0].kept, stats[0].rows_read) == (1, 1)
    prompt = ids(tok, "12+3=")
    for side, text in ((p.chosen, "15"), (p.rejected, "150")):
        assert side.input_ids == prompt + ids(tok, text) + [tok.eos_token_id]
        assert side.loss_mask == response_mask(len(prompt), len(side.input_ids))
    assert p.margin == 0.0 and p.ref_logps is None and p.source == "pairs"
    assert p.num_tokens == 8 + 9


def test_string_sides_with_input_template(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    (train, _, _), _ = pairs_from(tmp_path, tok, [GOOD], input_template="Q: {}\nA:")
    (p,) = train
    prompt = ids(tok, "Q: 1+1=\nA:")
    assert p.chosen.input_ids == prompt + ids(tok, "2") + [tok.eos_token_id]
    assert p.chosen.loss_mask == response_mask(len(prompt), len(prompt) + 2)


def test_chat_prompt_rows_and_whole_chat_rows_agree(tmp_path, tiny_tokenizer):
    """{"messages": prompt turns, "chosen": str, ...} and OpenRLHF's {"chosen": [whole chat], ...} give the
    same samples: the chat template around the conversation, loss on the assistant's text + <|im_end|> (the
    newline the template puts after it is dropped). A trailing reference answer in messages is dropped."""
    tok = tiny_tokenizer
    system = {"role": "system", "content": "be brief"}
    prompt_turns = [system, user("hi")]
    rows = [
        {"messages": prompt_turns, "chosen": "yo", "rejected": "go away"},
        {"messages": [*prompt_turns, assistant("reference")], "chosen": "yo", "rejected": "go away"},
        {
            "chosen": [*prompt_turns, assistant("yo")],
            "rejected": [*prompt_turns, assistant("go away")],
        },
    ]
    (train, _, _), _ = pairs_from(tmp_path, tok, rows)
    assert len(train) == 3
    prompt = ids(tok, chat(tok, prompt_turns, True))
    for p in train:
        for side, text in ((p.chosen, "yo"), (p.rejected, "go away")):
            assert side.input_ids == prompt + ids(tok, text) + [tok.eos_token_id]
            assert side.loss_mask == response_mask(len(prompt), len(side.input_ids))
            full = ids(tok, chat(tok, [*prompt_turns, assistant(text)], False))
            assert full[: len(side.input_ids)] == side.input_ids and full[len(side.input_ids) :] == ids(
                tok, "\n"
            )
    assert train[0].chosen.input_ids == train[1].chosen.input_ids == train[2].chosen.input_ids
    assert train[0].rejected.loss_mask == train[2].rejected.loss_mask


def test_chat_rows_need_a_chat_template(tmp_path, tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = None
    for row in (
        {"messages": [user("hi")], "chosen": "yo", "rejected": "no"},
        {"chosen": [user("hi"), assistant("yo")], "rejected": [user("hi"), assistant("no")]},
    ):
        with pytest.raises(DataError, match="the tokenizer has no chat template"):
            pairs_from(tmp_path, tok, [row])
    (train, _, _), _ = pairs_from(tmp_path, tok, [GOOD])  # plain rows need none
    assert len(train) == 1


# ---------------------------------------------------------------------------------------------- bad pairs
BAD_PAIRS = {
    "empty chosen": ({"input": "1+2=", "chosen": "", "rejected": "4"}, "chosen", "empty text"),
    "blank rejected": ({"input": "1+2=", "chosen": "3", "rejected": "  \n"}, "rejected", "empty text"),
    "missing rejected": ({"input": "1+2=", "chosen": "3"}, "rejected", "missing"),
    "null chosen": ({"input": "1+2=", "chosen": None, "rejected": "4"}, "chosen", "missing"),
    "number side": ({"input": "1+2=", "chosen": 3, "rejected": "4"}, "chosen", "expected a string, got int"),
    "dict side": ({"input": "1+2=", "chosen": "3", "rejected": {"a": 1}}, "rejected", "expected a string"),
    "identical": ({"input": "1+2=", "chosen": "3", "rejected": "3"}, "chosen/rejected", "identical"),
    "identical chats": (
        {"chosen": [user("a"), assistant("b")], "rejected": [user("a"), assistant("b")]},
        "chosen/rejected",
        "identical",
    ),
    "empty chat": ({"chosen": [], "rejected": "4"}, "chosen", "non-empty list of messages"),
    "chat without answer": (
        {"chosen": [user("a")], "rejected": [user("a"), assistant("b")]},
        "chosen",
        "no assistant message",
    ),
    "chat not ending with the answer": (
        {"chosen": [user("a"), assistant("b"), user("c")], "rejected": [user("a"), assistant("d")]},
        "chosen",
        "the last message must be the assistant's response",
    ),
    "empty input": ({"input": "", "chosen": "3", "rejected": "4"}, "input", "empty text"),
}


@pytest.mark.parametrize("case", list(BAD_PAIRS))
def test_bad_pair_rows_name_file_line_and_key(tmp_path, tiny_tokenizer, case):
    row, key, problem = BAD_PAIRS[case]
    path = write_jsonl(tmp_path / "pairs.jsonl", [GOOD, row])
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}, line 2: key {key!r}:")) as err:
        build_pair_data(DataConfig(datasets=[path]), tiny_tokenizer, **QUIET)
    assert problem in str(err.value) and "--data.skip_malformed" in str(err.value)


def test_bad_pair_rows_name_the_configured_keys(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"q": "1+2=", "good": "3", "bad": ""}])
    cfg = DataConfig(datasets=[path], input_key="q", chosen_key="good", rejected_key="bad")
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}, line 1: key 'bad': empty text")):
        build_pair_data(cfg, tiny_tokenizer, **QUIET)


def test_bad_message_in_a_whole_chat_side_names_the_side(tmp_path, tiny_tokenizer):
    row = {"chosen": ["hi", assistant("b")], "rejected": [user("a"), assistant("c")]}
    path = write_jsonl(tmp_path / "pairs.jsonl", [row])
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}, line 1: key 'chosen[0]'")):
        build_pair_data(DataConfig(datasets=[path]), tiny_tokenizer, **QUIET)


def test_missing_input_lists_the_rows_own_keys(tmp_path, tiny_tokenizer):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"question": "1+2=", "chosen": "3", "rejected": "4"}])
    with pytest.raises(
        MalformedRowError, match=re.escape("the row has keys ['chosen', 'question', 'rejected']")
    ):
        build_pair_data(DataConfig(datasets=[path]), tiny_tokenizer, **QUIET)


def test_skip_malformed_counts_bad_rows(tmp_path, tiny_tokenizer):
    bad = [row for row, _, _ in BAD_PAIRS.values()]
    path = write_jsonl(
        tmp_path / "pairs.jsonl", [GOOD, *bad, {"input": "2+2=", "chosen": "4", "rejected": "5"}]
    )
    logged = []
    train, _, stats = build_pair_data(
        DataConfig(datasets=[path], skip_malformed=True), tiny_tokenizer, log=logged.append
    )
    assert len(train) == 2
    assert (stats[0].kept, stats[0].skipped_malformed, stats[0].dropped_too_long) == (2, len(bad), 0)
    skipped = [line for line in logged if line.startswith("data: skipped malformed row")]
    assert len(skipped) == 5  # the first few are logged, all are counted
    assert f"{path}, line 2: key 'chosen': empty text" in skipped[0]
    assert any(f"skipped_malformed {len(bad)}" in line for line in logged)


def test_too_long_pairs_are_dropped_by_their_longer_side(tmp_path, tiny_tokenizer):
    # "1+1=" + side + EOS: chosen "2" -> 6 tokens; rejected "2222" -> 9 tokens
    rows = [
        {"input": "1+1=", "chosen": "2", "rejected": "2222"},
        {"input": "1+1=", "chosen": "2222", "rejected": "2"},
        {"input": "1+1=", "chosen": "2", "rejected": "22"},  # 6 and 7 tokens: kept at max_len 8
        {"input": "1+1=", "chosen": "222", "rejected": "2"},  # longer side exactly 8: kept
    ]
    (train, _, stats), _ = pairs_from(tmp_path, tiny_tokenizer, rows, max_len=8)
    assert [len(p.rejected) for p in train] == [7, 6]
    assert (stats[0].kept, stats[0].dropped_too_long, stats[0].skipped_malformed) == (2, 2, 0)
    with pytest.raises(DataError, match="no training samples left"):
        pairs_from(tmp_path, tiny_tokenizer, rows[:2], max_len=8)


def test_margin_key(tmp_path, tiny_tokenizer):
    rows = [
        GOOD | {"margin": 2},
        GOOD | {"margin": -0.5},
        GOOD | {"margin": None},
        GOOD,
    ]
    (train, _, _), _ = pairs_from(tmp_path, tiny_tokenizer, rows, margin_key="margin")
    assert [p.margin for p in train] == [2.0, -0.5, 0.0, 0.0]
    (train, _, _), _ = pairs_from(tmp_path, tiny_tokenizer, rows[:2])  # no margin_key: ignored
    assert [p.margin for p in train] == [0.0, 0.0]
    for bad in ("1.5", True, [1]):
        with pytest.raises(MalformedRowError, match=r"line 2: key 'margin': the margin must be a number"):
            pairs_from(tmp_path, tiny_tokenizer, [GOOD, GOOD | {"margin": bad}], margin_key="margin")


# ---------------------------------------------------------------------------------------------- unpaired
def test_unpaired_from_label_rows(tmp_path, tiny_tokenizer):
    tok = tiny_tokenizer
    labels = [True, False, 1, 0, 1.0]
    rows = [{"input": f"{i}+1=", "output": str(i + 1), "label": v} for i, v in enumerate(labels)]
    path = write_jsonl(tmp_path / "fb.jsonl", rows)
    train, _, stats = build_unpaired_data(DataConfig(datasets=[path]), tok, **QUIET)
    assert [u.desirable for u in train] == [True, False, True, False, True]
    assert stats[0].kept == 5
    u = train[1]
    prompt = ids(tok, "1+1=")
    assert u.sample.input_ids == prompt + ids(tok, "2") + [tok.eos_token_id]
    assert u.sample.loss_mask == response_mask(len(prompt), len(prompt) + 2)
    assert u.source == "fb" and u.num_tokens == 6


@pytest.mark.parametrize("label", ["yes", "true", None, 2, 0.5, [1]])
def test_unpaired_bad_label(tmp_path, tiny_tokenizer, label):
    path = write_jsonl(
        tmp_path / "fb.jsonl",
        [{"input": "1+1=", "output": "2", "label": True}, {"input": "1+1=", "output": "2", "label": label}],
    )
    with pytest.raises(
        MalformedRowError, match=re.escape(f"{path}, line 2: key 'label': expected true / false")
    ):
        build_unpaired_data(DataConfig(datasets=[path]), tiny_tokenizer, **QUIET)


def test_unpaired_from_pair_rows(tmp_path, tiny_tokenizer):
    """Each pair row gives its chosen side (desirable) then its rejected side, tokenized like the pair."""
    rows = [GOOD, {"messages": [user("hi")], "chosen": "yo", "rejected": "no"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", [*rows, {"input": "5+5=", "output": "10", "label": False}])
    train, _, stats = build_unpaired_data(DataConfig(datasets=[path]), tiny_tokenizer, **QUIET)
    assert [u.desirable for u in train] == [True, False, True, False, False]
    assert stats[0].kept == 3  # rows
    pairs, _, _ = build_pair_data(
        DataConfig(datasets=[write_jsonl(tmp_path / "p2.jsonl", rows)]), tiny_tokenizer, **QUIET
    )
    for k, p in enumerate(pairs):
        for u, side in ((train[2 * k], p.chosen), (train[2 * k + 1], p.rejected)):
            assert (u.sample.input_ids, u.sample.loss_mask) == (side.input_ids, side.loss_mask)
    # a bad pair row is a bad row here too; with skip_malformed both its samples go
    path = write_jsonl(tmp_path / "bad.jsonl", [GOOD, {"input": "1+1=", "chosen": "2"}])
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}, line 2: key 'rejected': missing")):
        build_unpaired_data(DataConfig(datasets=[path]), tiny_tokenizer, **QUIET)
    train, _, stats = build_unpaired_data(
        DataConfig(datasets=[path], skip_malformed=True), tiny_tokenizer, **QUIET
    )
    assert len(train) == 2 and stats[0].skipped_malformed == 1


# ---------------------------------------------------------------------------------------------- steps
STEPS = "1+1=2;2+2=5;"


def steps_from(tmp_path, tok, rows, placeholder=";", reward_tokens=("+", "-"), **cfg):
    path = write_jsonl(tmp_path / "steps.jsonl", rows)
    out = build_step_data(
        DataConfig(datasets=[path], **cfg), tok, placeholder=placeholder, reward_tokens=reward_tokens, **QUIET
    )
    return out, path


def test_step_labels_hard_token_and_soft(tmp_path, tiny_tokenizer):
    rows = [
        {"input": STEPS, "label": [True, False]},
        {"input": STEPS, "label": ["+", "-"]},
        {"input": STEPS, "label": [1, 0]},
        {"input": STEPS, "label": [0.75, 0.0]},
        {"input": "3+4=7;", "label": [True]},
    ]
    (train, _, stats), _ = steps_from(tmp_path, tiny_tokenizer, rows)
    assert [s.labels for s in train] == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.75, 0.0], [1.0]]
    assert stats[0].kept == 5
    first = train[0]
    assert first.input_ids == ids(tiny_tokenizer, STEPS)
    assert first.positions == [5, 11]  # the two ';'
    assert all(first.input_ids[i] == ids(tiny_tokenizer, ";")[0] for i in first.positions)
    assert train[4].positions == [5] and first.num_tokens == len(STEPS)
    # other reward tokens: their strings are the hard labels
    (train, _, _), _ = steps_from(
        tmp_path, tiny_tokenizer, [{"input": STEPS, "label": ["y", "n"]}], reward_tokens=("y", "n")
    )
    assert train[0].labels == [1.0, 0.0]


@pytest.mark.parametrize(
    ("label", "key", "problem"),
    [
        ([True], "label", "1 labels for 2 steps (placeholders ';' in the input)"),
        ([True, False, True], "label", "3 labels for 2 steps"),
        ([], "label", "expected a non-empty list of step labels"),
        ("+", "label", "expected a non-empty list of step labels"),
        (None, "label", "expected a non-empty list of step labels"),
        ([True, 1.5], "label[1]", "a probability in [0, 1], got 1.5"),
        ([-0.1, True], "label[0]", "got -0.1"),
        ([True, "x"], "label[1]", "expected true / false, '+' / '-'"),
    ],
)
def test_bad_step_labels(tmp_path, tiny_tokenizer, label, key, problem):
    with pytest.raises(MalformedRowError, match=re.escape(f"line 2: key {key!r}: ")) as err:
        steps_from(
            tmp_path,
            tiny_tokenizer,
            [{"input": STEPS, "label": [True, True]}, {"input": STEPS, "label": label}],
        )
    assert problem in str(err.value) and "steps.jsonl" in str(err.value)


def test_step_rows_skip_malformed(tmp_path, tiny_tokenizer):
    rows = [{"input": STEPS, "label": [True, True]}, {"input": STEPS, "label": [True]}, {"label": [True]}]
    (train, _, stats), _ = steps_from(tmp_path, tiny_tokenizer, rows, skip_malformed=True)
    assert len(train) == 1 and stats[0].skipped_malformed == 2


@pytest.mark.parametrize("placeholder", ["<p>", "ки", ""])
def test_placeholder_must_be_one_token(tmp_path, tiny_tokenizer, placeholder):
    with pytest.raises(
        DataError, match=re.escape(f"prm.placeholder {placeholder!r} must be exactly one token")
    ):
        steps_from(
            tmp_path, tiny_tokenizer, [{"input": STEPS, "label": [True, True]}], placeholder=placeholder
        )
