"""From a row to a prompt (RL) or to token ids with a loss mask (SFT): tokenized once, at the edge.

    build_prompt(row, tokenizer, cfg) -> Prompt(text, messages)       the prompt text, for RL and SFT
    tokenize_sft(row, tokenizer, cfg, mode) -> TokenizedSample         ids + loss mask

A row is a chat when it has `cfg.messages_key` (or its `input_key` holds a list of messages); chats are
rendered with `tokenizer.apply_chat_template`. Other rows have a text input (`input_key`) and, for SFT, a
response (`output_key`); their prompt is the chat template around one user message
(`apply_chat_template`), else `input_template` with the input in place of {}, else the raw input.

SFT modes (the loss mask; `loss_mask[0]` is always False since nothing predicts the first token):
    response    loss on the final response only, which ends with the tokenizer's EOS token (a target)
    multiturn   loss on every assistant turn of a chat, each including its end token; nothing else
    pretrain    loss on every token (prompt and response; the output is optional), EOS appended

Masks come from tokenizing growing prefixes of the rendered text: the ids of each prefix must start with the
ids of the previous one (prefix consistency). When a chat template rewrites earlier turns (some drop old
reasoning) or the tokenizer merges characters across a boundary (an input_template ending in a space), the
row raises an error that says so rather than training on misaligned masks. Tokens after the last target
(e.g. the newline ChatML puts after <|im_end|>) are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from relayrl.config.components import DataConfig
from relayrl.data.loading import DataError, MalformedRowError
from relayrl.data.records import RawRow, TokenizedSample

SFTMode = Literal["response", "multiturn", "pretrain"]
SFT_MODES: tuple[str, ...] = ("response", "multiturn", "pretrain")
ROLES = ("system", "user", "assistant", "tool")


@dataclass(kw_only=True, slots=True)
class Prompt:
    """A row's prompt after templating."""

    text: str
    """Prompt text (ends where the model's answer starts)."""
    messages: list[dict[str, str]] | None = None
    """The chat messages it was rendered from, when it is a chat."""


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` with no special tokens added (templates already contain them)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat(tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
    """The chat template's text for `messages`."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template, but a row is a chat (or data.apply_chat_template is on); "
            "use a tokenizer with a chat template, or plain input/output rows with data.input_template"
        )
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def text_field(row: RawRow, key: str, *, required: bool = True) -> str | None:
    """row[key] as a non-empty string; `MalformedRowError` (missing, wrong type, empty) naming file/row/key."""
    if key not in row.data or row.data[key] is None:
        if not required:
            return None
        raise MalformedRowError(row, key, f"missing (the row has keys {sorted(row.data)})")
    value = row.data[key]
    if not isinstance(value, str):
        raise MalformedRowError(row, key, f"expected a string, got {type(value).__name__} {value!r:.60}")
    if not value.strip():
        raise MalformedRowError(row, key, "empty text")
    return value


def row_messages(row: RawRow, cfg: DataConfig) -> list[dict[str, str]] | None:
    """The row's chat messages (validated), or None when it is a plain input/output row."""
    key = cfg.messages_key if cfg.messages_key in row.data else None
    if key is None and isinstance(row.data.get(cfg.input_key), list):
        key = cfg.input_key
    if key is None:
        return None
    msgs = row.data[key]
    if not isinstance(msgs, list) or not msgs:
        raise MalformedRowError(row, key, f"expected a non-empty list of messages, got {msgs!r:.60}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise MalformedRowError(
                row, f"{key}[{i}]", f"expected {{'role': one of {ROLES}, 'content': str}}, got {m!r:.80}"
            )
        if m["role"] == "assistant" and not m["content"].strip():
            raise MalformedRowError(row, f"{key}[{i}].content", "empty assistant text")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _plain_prompt(row: RawRow, tokenizer: Any, cfg: DataConfig) -> Prompt:
    text = text_field(row, cfg.input_key)
    assert text is not None
    if cfg.apply_chat_template:
        msgs = [{"role": "user", "content": text}]
        return Prompt(text=render_chat(tokenizer, msgs, add_generation_prompt=True), messages=msgs)
    if cfg.input_template is not None:
        return Prompt(text=cfg.input_template.replace("{}", text))
    return Prompt(text=text)


def build_prompt(row: RawRow, tokenizer: Any, cfg: DataConfig) -> Prompt:
    """The prompt of a row (RL): a chat's messages up to its last non-assistant turn, rendered with the
    generation prompt; or the templated input of a plain row."""
    msgs = row_messages(row, cfg)
    if msgs is None:
        return _plain_prompt(row, tokenizer, cfg)
    while msgs and msgs[-1]["role"] == "assistant":  # a trailing reference answer is not part of the prompt
        msgs = msgs[:-1]
    if not msgs:
        raise MalformedRowError(row, cfg.messages_key, "no user message before the assistant's")
    return Prompt(text=render_chat(tokenizer, msgs, add_generation_prompt=True), messages=msgs)


class _MaskBuilder:
    """Grows (ids, mask) from successive prefixes of one rendered sample, checking prefix consistency."""

    def __init__(self, tokenizer: Any, row: RawRow):
        self.tok, self.row = tokenizer, row
        self.text, self.ids, self.mask = "", [], []
        self.eos = tokenizer.eos_token_id
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(added)

    def extend(self, text: str, target: bool, *, whole: bool = False) -> None:
        """Grow to the prefix `text`; if `target`, the new tokens are targets up to and including the turn's
        end token: the last EOS among them, else the last special token after some content (a template whose
        turn end is not the tokenizer's EOS, e.g. <end_of_turn>), else all of them (always all if `whole`).
        Otherwise context."""
        if not text.startswith(self.text):
            raise MalformedRowError(
                self.row,
                None,
                "the chat template rewrites earlier turns (a rendered prefix is not a prefix of the longer "
                "conversation), so per-turn loss masks cannot be built; use mode=response or a template "
                "that keeps history unchanged",
            )
        ids = encode(self.tok, text)
        if ids[: len(self.ids)] != self.ids:
            raise MalformedRowError(
                self.row,
                None,
                "tokenizing the prompt and the full text disagree at their boundary (the tokenizer merges "
                f"characters across it, near {text[len(self.text) - 8 : len(self.text) + 8]!r}); e.g. remove a "
                "trailing space from data.input_template",
            )
        new = ids[len(self.ids) :]
        flags = [False] * len(new)
        if target and whole:
            flags = [True] * len(new)
        elif target:
            end = max((i for i, t in enumerate(new) if t == self.eos), default=None)
            if end is None:
                end = max((i for i, t in enumerate(new) if t in self.special and i > 0), default=len(new) - 1)
            flags[: end + 1] = [True] * (end + 1)
        self.text, self.ids, self.mask = text, ids, self.mask + flags

    def append_eos(self, target: bool) -> None:
        if self.eos is None:  # a tokenizer without EOS: nothing to append
            return
        if not self.ids or self.ids[-1] != self.eos:
            self.ids, self.mask = [*self.ids, self.eos], [*self.mask, target]
        elif target and self.mask:
            self.mask[-1] = True

    def sample(self, source: str) -> TokenizedSample:
        mask = list(self.mask)
        if mask:
            mask[0] = False
        if not any(mask):
            raise MalformedRowError(self.row, None, "no target tokens (nothing to learn from)")
        end = max(i + 1 for i, m in enumerate(mask) if m)  # tokens after the last target are dropped
        return TokenizedSample(input_ids=self.ids[:end], loss_mask=mask[:end], source=source)


def tokenize_sft(row: RawRow, tokenizer: Any, cfg: DataConfig, mode: SFTMode, source: str) -> TokenizedSample:
    """One SFT / pretrain sample with its loss mask (see the module docstring for the three modes)."""
    if mode not in SFT_MODES:
        raise ValueError(f"SFT mode {mode!r} is not one of {SFT_MODES}")
    msgs = row_messages(row, cfg)
    if msgs is None:
        prompt = _plain_prompt(row, tokenizer, cfg)
        output = text_field(row, cfg.output_key, required=mode != "pretrain")
        if prompt.messages is not None and output is not None:  # chat template around input/output
            msgs = [*prompt.messages, {"role": "assistant", "content": output}]
        else:
            b = _MaskBuilder(tokenizer, row)
            b.extend(prompt.text, target=mode == "pretrain", whole=True)
            if output is not None:
                b.extend(prompt.text + output, target=True, whole=True)
            b.append_eos(target=True)
            return b.sample(source)
    return _chat_sample(row, tokenizer, msgs, mode, source, cfg)


def _chat_sample(
    row: RawRow, tokenizer: Any, msgs: list[dict[str, str]], mode: SFTMode, source: str, cfg: DataConfig
) -> TokenizedSample:
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    b = _MaskBuilder(tokenizer, row)
    if mode == "pretrain":
        b.extend(render_chat(tokenizer, msgs, add_generation_prompt=False), target=True)
        return b.sample(source)  # the template's turn-end tokens already close every turn
    if not assistant:
        raise MalformedRowError(row, cfg.messages_key, "no assistant message to learn from")
    if mode == "response" and assistant[-1] != len(msgs) - 1:
        raise MalformedRowError(row, cfg.messages_key, "the last message must be the assistant's response")
    targets = assistant if mode == "multiturn" else assistant[-1:]
    for k in targets:
        b.extend(render_chat(tokenizer, msgs[:k], add_generation_prompt=True), target=False)
        b.extend(render_chat(tokenizer, msgs[: k + 1], add_generation_prompt=False), target=True)
    return b.sample(source)
