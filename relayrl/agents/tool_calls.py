"""Tool calls for the OpenAI server (`relayrl serve`): the request's `tools` / `tool_choice`, and a parser per
chat-template family that turns the model's text into OpenAI `tool_calls`.

    policy = ToolPolicy(tools=..., choice="auto")           built by openai_request.parse_request (checked)
    parse = parser_for(tokenizer, "auto")                   PARSERS[name]: text -> ParsedCalls
    parsed = parse(text)                                    ParsedCalls(content, calls) or ToolCallError
    message = policy.message(text, parse)                   the assistant message (or ToolCallError)
    msgs = template_messages(messages)                      assistant tool_calls' JSON arguments -> dicts

Parsers (`PARSERS`, one function each; a new format is one function and one registry line):
    hermes   Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
             (whitespace around the JSON allowed); the text outside the tags is the message content.
`parser_for(tokenizer, "auto")` picks by the chat template: one that mentions `<tool_call>` -> hermes; none
found -> an error when a request brings tools (name a parser with --tool_parser).

Errors, never a silent text answer (`ToolCallError`, HTTP 422 from the server): a `<tool_call>` that is not
closed, whose body is not a JSON object with a string "name" and object (or JSON-string) "arguments", or that
names a tool the request did not offer; no call when tool_choice is "required" or names a function; a call of
another function than the one named. tool_choice "none": the text is returned as it is (not parsed).
The server records the call's exact tokens in the session trace before any of this (token-in-token-out
training sees what the model generated, whether or not it parsed).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ToolCallError(ValueError):
    """The model's output does not give the tool calls the request asks for (answered with HTTP 422)."""


@dataclass(kw_only=True, slots=True)
class ParsedCalls:
    """A completion's text split into its content and its tool calls."""

    content: str
    """Text outside the tool-call markup (stripped)."""
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(function name, JSON-encoded arguments) per call, in order."""


Parser = Callable[[str], ParsedCalls]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def hermes(text: str) -> ParsedCalls:
    """Hermes / Qwen `<tool_call>{json}</tool_call>` blocks (see module doc)."""
    calls = []
    for i, m in enumerate(_HERMES.finditer(text)):
        try:
            obj = json.loads(m.group(1))
        except ValueError as e:
            raise ToolCallError(
                f"tool call {i} is not valid JSON ({e}): {m.group(1).strip()[:200]!r}"
            ) from None
        calls.append(_name_and_arguments(obj, i))
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        raise ToolCallError(
            f"a <tool_call> is not closed by </tool_call>: {text[text.rfind('<tool_call>') :][:200]!r}"
        )
    return ParsedCalls(content=rest.strip(), calls=calls)


def _name_and_arguments(obj: Any, i: int) -> tuple[str, str]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError(
            f'tool call {i} must be a JSON object with a string "name", got {json.dumps(obj)[:200]}'
        )
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise ToolCallError(
                f"tool call {i} ({obj['name']}): arguments are not JSON: {args[:200]!r}"
            ) from None
    if not isinstance(args, dict):
        raise ToolCallError(
            f"tool call {i} ({obj['name']}): arguments must be a JSON object, got {args!r:.200}"
        )
    return obj["name"], json.dumps(args, ensure_ascii=False)


PARSERS: dict[str, Parser] = {"hermes": hermes}
"""Tool-call parsers by name (see module doc)."""
TEMPLATE_MARKERS = {"<tool_call>": "hermes"}
"""A chat template containing the key uses the parser named by the value (`parser_for(..., "auto")`)."""


def parser_for(tokenizer: Any, name: str = "auto") -> Parser | None:
    """The parser `name` ("none": None; "auto": by the chat template's markup, None when it has none)."""
    if name == "none":
        return None
    if name == "auto":
        template = str(getattr(tokenizer, "chat_template", None) or "")
        found = [p for marker, p in TEMPLATE_MARKERS.items() if marker in template]
        return PARSERS[found[0]] if found else None
    if name not in PARSERS:
        raise ValueError(f"tool_parser must be auto, none or one of {sorted(PARSERS)}, got {name!r}")
    return PARSERS[name]


@dataclass(kw_only=True, slots=True)
class ToolPolicy:
    """A request's tools and tool_choice."""

    tools: list[dict[str, Any]]
    """The OpenAI `tools` list ({"type": "function", "function": {"name", ...}}), passed to the template."""
    choice: str = "auto"
    """"auto", "none", "required", or "function" (the call must be `function`)."""
    function: str = ""
    """The function named by tool_choice {"type": "function", "function": {"name": ...}}."""

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    def message(self, text: str, parse: Parser | None) -> dict[str, Any]:
        """The assistant message for completion `text`: content and, when the model called tools, `tool_calls`
        (ids `call_<hex>`); ToolCallError when the output breaks the policy (module doc)."""
        if self.choice == "none":
            return {"role": "assistant", "content": text}
        if parse is None:
            raise ToolCallError(
                "the request has tools but this chat template's tool-call format is unknown: start the server "
                f"with --tool_parser one of {sorted(PARSERS)}"
            )
        parsed = parse(text)
        unknown = [n for n, _ in parsed.calls if n not in self.names]
        if unknown:
            raise ToolCallError(
                f"the model called {unknown}, not among the offered tools {sorted(self.names)}"
            )
        if not parsed.calls and self.choice in ("required", "function"):
            raise ToolCallError(
                f"tool_choice {self.choice!r} requires a tool call; the model answered {text[:200]!r}"
            )
        if self.choice == "function" and any(n != self.function for n, _ in parsed.calls):
            raise ToolCallError(
                f"tool_choice names {self.function!r}; the model called {[n for n, _ in parsed.calls]}"
            )
        if not parsed.calls:
            return {"role": "assistant", "content": parsed.content}
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": n, "arguments": a},
            }
            for n, a in parsed.calls
        ]
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": tool_calls}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for `apply_chat_template`: an assistant message's tool_calls carry their arguments as a dict
    (transformers' convention; OpenAI sends a JSON string), so templates render them with `tojson`."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = {**m, "tool_calls": [_dict_arguments(c) for c in calls]}
        out.append(m)
    return out


def _dict_arguments(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            return {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
        except ValueError:
            return call  # left as the client sent it; the template renders the string
    return call
