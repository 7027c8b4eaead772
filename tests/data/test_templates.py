"""Prompts and exact SFT loss masks on hand-written rows with the tiny character-level tokenizer.

The tiny tokenizer maps every character to one token and <|im_start|> / <|im_end|> (EOS, id 1) to one token
each, so an expected sample is written as a list of token strings with a 0/1 target flag per token."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from transformers import PreTrainedTokenizerFast

from relayrl.config import DataConfig
from relayrl.data.loading import MalformedRowError
from relayrl.data.records import RawRow
from relayrl.data.templates import build_prompt, tokenize_sft
from relayrl.models.tiny import build_tiny_tokenizer

S, E = "<|im_start|>", "<|im_end|>"


def row(data: dict, n: int = 3) -> RawRow:
    return RawRow(data=data, source="mem.jsonl", file="mem.jsonl", row=n)


def expect(tok, spec: list[tuple[str, int]]) -> tuple[list[int], list[bool]]:
    """[(text, flag)] -> (ids, mask): each special token is one token, every other character one token."""
    ids, mask = [], []
    for text, flag in spec:
        if text in (S, E):
            pieces = tok.convert_tokens_to_ids([text])
        else:  # one token per character (byte-level spelling: a space is 'Ġ')
            pieces = [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]
            assert len(pieces) == len(text), text
        ids += pieces
        mask += [bool(flag)] * len(pieces)
    return ids, mask


def check(sample, tok, spec):
    ids, mask = expect(tok, spec)
    assert tok.convert_ids_to_tokens(sample.input_ids) == tok.convert_ids_to_tokens(ids)
    assert sample.loss_mask == mask


def test_response_mode_raw_input(tiny_tokenizer):
    s = tokenize_sft(row({"input": "12+34=", "output": "46"}), tiny_tokenizer, DataConfig(), "response", "m")
    check(s, tiny_tokenizer, [("12+34=", 0), ("46", 1), (E, 1)])  # EOS appended and a target
    assert s.num_targets == 3 and s.source == "m"


def test_response_mode_input_template(tiny_tokenizer):
    cfg = DataConfig(input_template="Q: {}\nA:")
    r = row({"input": "1+2", "output": "3"})
    assert build_prompt(r, tiny_tokenizer, cfg).text == "Q: 1+2\nA:"
    check(
        tokenize_sft(r, tiny_tokenizer, cfg, "response", "m"),
        tiny_tokenizer,
        [("Q: 1+2\nA:", 0), ("3", 1), (E, 1)],
    )


def test_response_mode_chat_template_on_plain_row(tiny_tokenizer):
    cfg = DataConfig(apply_chat_template=True)
    r = row({"input": "hi", "output": "yo"})
    prompt = build_prompt(r, tiny_tokenizer, cfg)
    assert prompt.text == f"{S}user\nhi{E}\n{S}assistant\n"
    assert prompt.messages == [{"role": "user", "content": "hi"}]
    # the template's "\n" after the final <|im_end|> follows the last target and is dropped
    check(
        tokenize_sft(r, tiny_tokenizer, cfg, "response", "m"),
        tiny_tokenizer,
        [(S, 0), ("user\nhi", 0), (E, 0), ("\n", 0), (S, 0), ("assistant\n", 0), ("yo", 1), (E, 1)],
    )


CHAT = {
    "messages": [
        {"role": "system", "content": "be"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
}


def chat_spec(first_turn_flag: int):
    return [
        (S, 0), ("system\nbe", 0), (E, 0), ("\n", 0),
        (S, 0), ("user\na", 0), (E, 0), ("\n", 0),
        (S, 0), ("assistant\n", 0), ("b", first_turn_flag), (E, first_turn_flag), ("\n", 0),
        (S, 0), ("user\nc", 0), (E, 0), ("\n", 0),
        (S, 0), ("assistant\n", 0), ("d", 1), (E, 1),
    ]  # fmt: skip


def test_multiturn_mode_every_assistant_turn(tiny_tokenizer):
    s = tokenize_sft(row(CHAT), tiny_tokenizer, DataConfig(), "multiturn", "m")
    check(s, tiny_tokenizer, chat_spec(first_turn_flag=1))
    assert s.num_targets == 4  # "b", <|im_end|>, "d", <|im_end|>


def test_response_mode_chat_last_turn_only(tiny_tokenizer):
    check(
        tokenize_sft(row(CHAT), tiny_tokenizer, DataConfig(), "response", "m"), tiny_tokenizer, chat_spec(0)
    )


def test_pretrain_mode_all_tokens(tiny_tokenizer):
    s = tokenize_sft(row({"input": "ab", "output": "c"}), tiny_tokenizer, DataConfig(), "pretrain", "m")
    check(s, tiny_tokenizer, [("a", 0), ("b", 1), ("c", 1), (E, 1)])  # token 0 has no prefix: never a target
    s = tokenize_sft(row({"input": "xyz"}), tiny_tokenizer, DataConfig(), "pretrain", "m")  # output optional
    check(s, tiny_tokenizer, [("x", 0), ("yz", 1), (E, 1)])
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    s = tokenize_sft(row(chat), tiny_tokenizer, DataConfig(), "pretrain", "m")
    check(
        s,
        tiny_tokenizer,
        [(S, 0), ("user\na", 1), (E, 1), ("\n", 1), (S, 1), ("assistant\nb", 1), (E, 1)],
    )


def test_prompt_from_chat_drops_trailing_reference_answer(tiny_tokenizer):
    p = build_prompt(row(CHAT), tiny_tokenizer, DataConfig())
    assert p.text.endswith(f"{S}user\nc{E}\n{S}assistant\n") and f"assistant\nb{E}" in p.text
    assert [m["content"] for m in p.messages] == ["be", "a", "b", "c"]
    # the input key may hold the chat list itself
    p2 = build_prompt(row({"prompt": CHAT["messages"][:2]}), tiny_tokenizer, DataConfig(input_key="prompt"))
    assert p2.text == f"{S}system\nbe{E}\n{S}user\na{E}\n{S}assistant\n"


def test_template_that_rewrites_history_is_an_error():
    tok = build_tiny_tokenizer()
    # drops the content of every assistant turn but the last (like templates that strip old reasoning)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(
        MalformedRowError, match=r"mem.jsonl, line 3: the chat template rewrites earlier turns"
    ):
        tokenize_sft(row(CHAT), tok, DataConfig(), "multiturn", "m")
    tokenize_sft(row(CHAT), tok, DataConfig(), "response", "m")  # last turn only: consistent, fine


def test_tokenizer_merging_across_the_prompt_boundary_is_an_error(tiny_tokenizer):
    vocab = tiny_tokenizer.get_vocab()
    vocab["Ġ4"] = len(vocab)  # a byte-level BPE that merges " " (spelled "Ġ") + "4"
    core = Tokenizer(BPE(vocab=vocab, merges=[("Ġ", "4")], unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=E, pad_token="<|pad|>", unk_token="<|unk|>"
    )
    cfg = DataConfig(input_template="Q: {}\nA: ")
    with pytest.raises(MalformedRowError, match=r"remove a trailing space from data.input_template"):
        tokenize_sft(row({"input": "2+2", "output": "4"}), tok, cfg, "response", "m")
    s = tokenize_sft(
        row({"input": "2+2", "output": "4"}), tok, DataConfig(input_template="Q: {}\nA:"), "response", "m"
    )
    assert tok.convert_ids_to_tokens(s.input_ids)[-2:] == ["4", E] and s.loss_mask[-3:] == [False, True, True]


@pytest.mark.parametrize(
    ("data", "key", "problem"),
    [
        ({"input": "1+1="}, "output", "missing"),
        ({"input": "1+1=", "output": 2}, "output", "expected a string, got int"),
        ({"input": "  ", "output": "2"}, "input", "empty text"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
            "messages[1]",
            "expected",
        ),
        ({"messages": [{"role": "user", "content": "a"}]}, "messages", "no assistant message"),
    ],
)
def test_malformed_rows_name_file_row_and_key(tiny_tokenizer, data, key, problem):
    with pytest.raises(MalformedRowError) as e:
        tokenize_sft(row(data, n=7), tiny_tokenizer, DataConfig(), "multiturn", "m")
    assert str(e.value).startswith(f"mem.jsonl, line 7: key {key!r}: {problem}")
    assert "--data.skip_malformed true" in str(e.value)


def test_turn_end_is_the_templates_special_token_when_eos_differs():
    tok = build_tiny_tokenizer()
    tok.eos_token = "<|unk|>"  # like templates whose turn end (<end_of_turn>) is not the tokenizer's EOS
    assert tok.eos_token_id == 3
    s = tokenize_sft(row(CHAT), tok, DataConfig(), "multiturn", "m")
    check(s, tok, chat_spec(first_turn_flag=1))  # targets end at <|im_end|>; the "\n" after it is context


def test_pretrain_chat_templated_prompt_without_output_trains_everything(tiny_tokenizer):
    s = tokenize_sft(
        row({"input": "a"}), tiny_tokenizer, DataConfig(apply_chat_template=True), "pretrain", "m"
    )
    check(s, tiny_tokenizer, [(S, 0), ("user\na", 1), (E, 1), ("\n", 1), (S, 1), ("assistant\n", 1), (E, 1)])
