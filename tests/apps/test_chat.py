"""`relayrl chat`: streamed replies, conversation history, /reset and /exit, the plain-format fallback and
the incremental text pieces. Tiny local model, CPU."""

from __future__ import annotations

import copy
import io
import sys

import pytest
import torch

from relayrl.apps.chat import (
    ChatConfig,
    ChatSession,
    IncrementalDecoder,
    StopStrings,
    main,
    render_conversation,
    render_plain,
    run_chat,
)
from relayrl.config.components import ModelConfig
from relayrl.data.templates import encode


class Recorder(io.StringIO):
    """stdout that records every write (and counts flushes)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)

    def flush(self) -> None:
        self.flushes += 1


def cfg(path, **kw) -> ChatConfig:
    return ChatConfig(model=ModelConfig(name_or_path=str(path)), device="cpu", seed=0, max_new_tokens=8, **kw)


def test_two_turns_reset_and_exit_over_stdin(tiny_model_path):
    out = Recorder()
    script = "hello there\nand then?\n/reset\nfresh start\n/exit\nnever answered\n"
    session = run_chat(cfg(tiny_model_path, system="Be brief."), stdin=io.StringIO(script), stdout=out)
    assert len(session.prompts) == 3  # the line after /exit is not answered
    replies = out.getvalue().split("\n")
    assert len(replies) == 4 and replies[3] == "" and all(replies[:3])
    tok = session.tokenizer
    first, second, third = (tok.decode(p) for p in session.prompts)
    # turn 2's prompt is the whole conversation: system, turn 1, reply 1 (as streamed), turn 2
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": replies[0].strip()},
        {"role": "user", "content": "and then?"},
    ]
    assert session.prompts[1] == encode(tok, render_conversation(tok, history))
    assert second.startswith(first) and replies[0].strip() in second
    # after /reset only the system prompt is kept
    fresh = [history[0], {"role": "user", "content": "fresh start"}]
    assert session.prompts[2] == encode(tok, render_conversation(tok, fresh))
    assert "hello" not in third and "fresh" in third
    assert out.flushes >= len(out.writes)  # every piece is flushed as written


def test_reply_streams_piece_by_piece_while_generating(tiny_model_path):
    """Each piece is written before the next forward pass runs: the writes happen at increasing forward
    counts, one per generated token (the tiny tokenizer has one character per token)."""
    from relayrl.models.loading import load_tokenizer
    from relayrl.workers.builders import build_frozen

    c = cfg(tiny_model_path, temperature=1.0)
    model, tok = build_frozen(c.model, torch.device("cpu")), load_tokenizer(str(tiny_model_path))
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    session = ChatSession(model, tok, c)
    seen: list[tuple[str, int]] = []
    reply = session.reply("tell me a story", lambda piece: seen.append((piece, len(forwards))))
    assert reply is not None and len(reply.token_ids) > 1
    pieces = [d for t in reply.token_ids if (d := tok.decode([t], skip_special_tokens=True))]
    assert [p for p, _ in seen] == pieces and len(pieces) > 1 and "".join(pieces) == reply.text
    at = [n for _, n in seen]
    assert at == sorted(set(at)) and at[0] < len(forwards)  # one write per forward, from the first one on
    # a seeded session replays its replies exactly
    again = ChatSession(model, tok, c).reply("tell me a story", lambda _: None)
    assert again.token_ids == reply.token_ids


def test_command_line_with_piped_stdin(tiny_model_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\n/bogus\n/exit\n"))
    argv = [
        "--model.name_or_path",
        str(tiny_model_path),
        "--device",
        "cpu",
        "--max_new_tokens",
        "4",
        "--seed",
        "1",
    ]
    assert main(argv) == 0
    said = capsys.readouterr()
    assert said.out.count("\n") == 1 and said.out.strip()  # one reply, then /exit
    assert "relayrl chat:" in said.err and "unknown command '/bogus'" in said.err
    assert main(["--model.name_or_path", str(tiny_model_path), "--top_p", "0"]) == 2
    assert "top_p: 0.0 is invalid" in capsys.readouterr().err


def test_plain_format_without_a_chat_template(tiny_model_path, tiny_tokenizer):
    from relayrl.workers.builders import build_frozen

    msgs = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    msgs += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    assert render_plain(msgs) == "Be kind.\n\nUser: hi\nAssistant: hello\nUser: bye\nAssistant:"
    tok = copy.deepcopy(tiny_tokenizer)  # the in-memory one: the saved folder reloads without whitespace
    tok.chat_template = None
    assert render_conversation(tok, msgs) == render_plain(msgs)
    assert render_conversation(tiny_tokenizer, msgs).startswith("<|im_start|>system\nBe kind.<|im_end|>")
    session = ChatSession(
        build_frozen(cfg(tiny_model_path).model, torch.device("cpu")), tok, cfg(tiny_model_path)
    )
    assert session.stops == ("\nUser:",)
    assert session.reply("x" * 600, lambda _: None) is None  # longer than the model's 512 positions
    assert session.messages == [] and session.prompts == []
    reply = session.reply("hi", lambda _: None)
    assert tok.decode(session.prompts[0]) == "User: hi\nAssistant:" and "\nUser:" not in reply.text


def test_stop_strings_hold_back_a_possible_start_and_cut_at_the_stop():
    s = StopStrings(["\nUser:"])
    assert s.feed("Hello") == ("Hello", False)
    assert s.feed(" there\nUs") == (" there", False)  # "\nUs" may begin the stop string: held back
    assert s.feed("ually") == ("\nUsually", False)  # it did not
    assert s.feed("\nUser: more") == ("", True)
    assert s.text == "Hello there\nUsually" and s.flush() == ""
    t = StopStrings(["\nUser:"])
    assert t.feed("end\n") == ("end", False) and t.flush() == "\n"


class ByteTokenizer:
    """Token i is byte i: decode is UTF-8 with replacement, as byte-level BPE tokenizers behave."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["héllo wörld", "日本", "a🙂b"])
def test_incremental_decoder_never_splits_a_character(text):
    dec = IncrementalDecoder(ByteTokenizer())
    pieces = [dec.push(b) for b in text.encode()]
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    assert sum(1 for p in pieces if p) == len(text)  # one piece per character, as soon as it is complete


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(tiny_model, tiny_tokenizer):
    from relayrl.apps.chat import chat_loop

    class InterruptOnce(Recorder):
        def write(self, s: str) -> int:
            if not self.writes:
                self.writes.append("<interrupted>")
                raise KeyboardInterrupt
            return super().write(s)

    session = ChatSession(tiny_model.eval(), tiny_tokenizer, ChatConfig(seed=0, max_new_tokens=6))
    out = InterruptOnce()
    assert chat_loop(session, ["first", "second", "/exit"], out) == 1
    assert [m["content"] for m in session.messages if m["role"] == "user"] == ["second"]  # not kept
    assert out.getvalue().startswith("\n") and out.getvalue().endswith("\n") and len(session.prompts) == 2
