"""The requests `relayrl serve` accepts (openai_server.py): every field of an OpenAI chat / completions body is
checked here, and a bad one is answered HTTP 400 naming it (`RequestError.param`), as OpenAI does.

    body = parse_json(raw)                              a JSON object; a lone surrogate anywhere is refused
    req = parse_request(body, chat=True, vocab_size=V, allow_chat_template=False) -> ClientRequest

Field by field (OpenAI's semantics unless said otherwise; `null` always means the default):

    model                       any string (one model is served)
    n                           int in [1, 128]; 0 is an error, not 1
    max_completion_tokens /     int >= 1 (0 is an error); default 256; capped by the room the context leaves
      max_tokens
    temperature                 finite number in [0, 2] (NaN / inf / strings / objects are errors)
    top_p                       finite number in (0, 1]; 0 is an error (use temperature 0 for greedy)
    seed                        int (64-bit)
    logprobs / top_logprobs     chat: bool; completions: int in [0, 5] (0: the sampled token's log-prob).
                                top_logprobs > 0 (or completions logprobs > 1) is refused: the engine returns
                                the sampled token's log-prob only
    stream, stream_options      bool; usage is always in the last chunk
    stop                        empty only: stop strings would break token exactness (use stop_token_ids)
    user                        a string; only recorded by OpenAI for abuse monitoring, never a session id
    tools                       a list of {"type": "function", "function": {"name": str, ...}}; reach the
                                chat template; the output's tool calls come back as `tool_calls`
    tool_choice                 "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
                                (one of the tools); a call other than "none" / "auto" needs tools. The
                                output is checked against it (tool_calls.py: HTTP 422 when it breaks it)
    presence_penalty,           0 only (not implemented: any other value is refused, never ignored)
      frequency_penalty, logit_bias {}, response_format text, best_of = n, echo false, suffix null
    metadata, store,            accepted and ignored (they change nothing in what is generated)
      service_tier, parallel_tool_calls, prompt_cache_key, safety_identifier
    extensions (extra_body)     session_id (str), top_k (int; 0 or -1 = off), stop_token_ids (ids in the
                                vocabulary), chat_template_kwargs (variables for the model's template),
                                chat_template (only with `relayrl serve --allow_client_chat_template true`)

Any other field is an error ("unknown field"). chat: `messages` is a non-empty list of {role, content} with
text content (a string or text parts; image / audio parts are refused). completions: `prompt` is one string
or one list of token ids.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from relayrl.agents.tool_calls import ToolPolicy
from relayrl.rollout.base import SamplingParams

DEFAULT_MAX_TOKENS = 256
"""max_tokens when the client sets none (then capped by the room the context leaves)."""

ROLES = ("system", "developer", "user", "assistant", "tool", "function")

RESERVED_TEMPLATE_KWARGS = (
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
)  # fmt: skip
"""chat_template_kwargs keys that are apply_chat_template's own arguments, not template variables."""

_IGNORED = {
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
}
_COMMON = {
    "model", "n", "max_tokens", "temperature", "top_p", "seed", "logprobs", "stream", "stream_options", "stop",
    "user", "presence_penalty", "frequency_penalty", "logit_bias", "session_id", "top_k", "stop_token_ids",
    "repetition_penalty",
} | _IGNORED  # fmt: skip
_CHAT = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "response_format",
    "chat_template_kwargs", "chat_template", "functions", "function_call", "modalities", "audio", "prediction",
    "reasoning_effort", "verbosity", "web_search_options",
}  # fmt: skip
_COMPLETION = _COMMON | {"prompt", "echo", "suffix", "best_of"}


class RequestError(ValueError):
    """A bad request: answered with HTTP `status` (400 unless said) and OpenAI's error body naming `param`."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def payload(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(kw_only=True, slots=True)
class ClientRequest:
    """A checked request: what to render and how the client asked to sample."""

    params: SamplingParams
    """The client's sampling parameters (before a session's trainer defaults and the context's room)."""
    messages: list[dict[str, Any]] | None = None
    """chat: the messages, content flattened to text (other keys, e.g. tool_calls, reach the template)."""
    tools: list[dict[str, Any]] | None = None
    """chat: the tools, passed to the chat template."""
    tool_choice: ToolPolicy | None = None
    """chat: the tools and tool_choice the output is checked against (None: no tools, text as it is)."""
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """chat: extra template variables (chat_template_kwargs)."""
    chat_template: str | None = None
    """chat: the client's own template (only when the server allows it)."""
    prompt: str | list[int] | None = None
    """completions: the prompt text, or its token ids."""
    logprobs: bool = False
    """Return the sampled tokens' log-probs."""
    stream: bool = False
    """Answer in server-sent-events chunks."""
    session_id: str | None = None
    """The body's session_id (the X-Session-Id header is read by the server)."""


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; a lone surrogate (invalid Unicode) anywhere is refused, naming where."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise RequestError(f"body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {type(body).__name__}")
    _check_text(body, "")
    return body


def _check_text(value: Any, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(
                f"{where or 'body'}: invalid Unicode (a lone surrogate {value[e.start]!r} at character {e.start})",
                param=where or None,
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, where)
            _check_text(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{where}[{i}]")


# ---- scalar fields ---------------------------------------------------------------------------------------
def _bad(name: str, want: str, got: Any) -> RequestError:
    shown = json.dumps(got) if isinstance(got, (dict, list)) else repr(got)
    return RequestError(f"'{name}' must be {want}, got {shown[:80]}", param=name)


def _int(body: dict[str, Any], name: str, lo: int, hi: int, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(name, f"an integer in [{lo}, {hi}]", v)
    return v


def _number(body: dict[str, Any], name: str, lo: float, hi: float, default: float, *, open_lo: bool = False):
    v = body.get(name)
    if v is None:
        return default
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v > hi or v < lo or (open_lo and v == lo):
        raise _bad(name, f"a finite number in {'(' if open_lo else '['}{lo:g}, {hi:g}]", v)
    return float(v)


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise _bad(name, "true or false", v)
    return bool(v)


def _str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise _bad(name, "a string", v)
    return v


def _only(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """Fields relayrl does not implement: only their no-op values pass, anything else is refused (never
    silently ignored)."""
    v = body.get(name)
    if v is not None and v not in allowed:
        raise RequestError(f"'{name}' is not supported ({why}); got {json.dumps(v)[:80]}", param=name)


def _token_ids(v: Any, name: str, vocab_size: int, *, allow_empty: bool) -> list[int]:
    if not isinstance(v, list) or (not v and not allow_empty):
        raise _bad(name, "a list of token ids" + ("" if allow_empty else " (non-empty)"), v)
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise _bad(name, f"token ids in [0, {vocab_size})", t)
    return list(v)


# ---- the request -----------------------------------------------------------------------------------------
def _unsupported(body: dict[str, Any], chat: bool) -> None:
    _only(body, "presence_penalty", (0,), "no penalties in the engine")
    _only(body, "frequency_penalty", (0,), "no penalties in the engine")
    _only(body, "repetition_penalty", (1,), "no penalties in the engine")
    _only(body, "logit_bias", ({},), "no logit bias in the engine")
    _only(body, "stop", ("", []), "stop strings would break token exactness; use 'stop_token_ids'")
    if chat:
        _only(body, "response_format", ({"type": "text"},), "no constrained decoding")
        _only(body, "modalities", (["text"],), "text only")
        for name in ("functions", "function_call", "audio", "prediction", "reasoning_effort", "verbosity",
                     "web_search_options"):  # fmt: skip
            _only(body, name, (), "use chat_template_kwargs for template switches (e.g. enable_thinking)")
    else:
        _only(body, "echo", (False,), "the prompt is returned as 'prompt_token_ids'")
        _only(body, "suffix", (), "no insertion")
        _only(body, "best_of", (body.get("n") or 1,), "no ranking of samples; use n")


def _sampling(body: dict[str, Any], chat: bool, vocab_size: int) -> SamplingParams:
    limit = 2**63 - 1
    max_tokens = _int(body, "max_completion_tokens", 1, limit, None) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, limit, DEFAULT_MAX_TOKENS)
    top_k = _int(body, "top_k", -1, limit, 0)
    stops = body.get("stop_token_ids")
    return SamplingParams(
        n=_int(body, "n", 1, 128, 1) or 1,
        temperature=_number(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0, open_lo=True),
        top_k=max(top_k or 0, 0),
        max_new_tokens=max_tokens or DEFAULT_MAX_TOKENS,
        stop_token_ids=tuple(
            _token_ids(stops, "stop_token_ids", vocab_size, allow_empty=True) if stops else ()
        ),
        seed=_int(body, "seed", -(2**63), limit, None),
    )


def _logprobs(body: dict[str, Any], chat: bool) -> bool:
    if chat:
        top = _int(body, "top_logprobs", 0, 20, 0)
        want = _bool(body, "logprobs")
    else:
        top = _int(body, "logprobs", 0, 5, None)
        want = top is not None
        top = max((top or 0) - 1, 0)  # completions' logprobs=k: the sampled token plus k-1 alternatives
    if top:
        raise RequestError(
            "top_logprobs is not supported: the engine returns the log-prob of each sampled token only; "
            "ask for 'logprobs': true (chat) or 'logprobs': 1 (completions)",
            param="top_logprobs" if chat else "logprobs",
        )
    return want


def parse_request(
    body: dict[str, Any], *, chat: bool, vocab_size: int, allow_chat_template: bool = False
) -> ClientRequest:
    """Check every field of a /v1/chat/completions (`chat`) or /v1/completions body (module doc)."""
    known = _CHAT if chat else _COMPLETION
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field '{unknown[0]}' (not an OpenAI {'chat ' if chat else ''}completions "
                           "field relayrl serve knows)", param=unknown[0])  # fmt: skip
    for name in ("model", "user", "service_tier", "prompt_cache_key", "safety_identifier"):
        _str(body, name)
    for name in ("store", "parallel_tool_calls"):
        _bool(body, name)
    for name in ("metadata", "stream_options"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            raise _bad(name, "an object", body[name])
    _unsupported(body, chat)
    sid = _str(body, "session_id")
    if sid is not None and not 0 < len(sid) <= 256:
        raise _bad("session_id", "a non-empty string of at most 256 characters", sid)
    req = ClientRequest(
        params=_sampling(body, chat, vocab_size),
        logprobs=_logprobs(body, chat),
        stream=_bool(body, "stream"),
        session_id=sid,
    )
    if chat:
        req.messages = parse_messages(body.get("messages"))
        req.tools = _tools(body.get("tools"))
        req.tool_choice = _tool_choice(body.get("tool_choice"), req.tools)
        req.template_kwargs, req.chat_template = template_options(body, allow_chat_template)
    else:
        req.prompt = parse_prompt(body.get("prompt"), vocab_size)
    return req


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages with text content (a string, text parts joined, or null -> "")."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {'role', 'content'}", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} must be an object with a string 'role' and a 'content'", param=where)
        if m["role"] not in ROLES:
            raise RequestError(
                f"{where}.role {m['role']!r} is not one of {', '.join(ROLES)}", param=f"{where}.role"
            )
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise _bad(f"{where}.{key}", "a string", m[key])
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise _bad(f"{where}.tool_calls", "a list", m["tool_calls"])
        out.append({**m, "content": _content_text(m.get("content"), f"{where}.content")})
    return out


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise RequestError(
                    f"{where}[{j}] must be a text part {{'type': 'text', 'text': str}} (this server reads text "
                    "only)",
                    param=f"{where}[{j}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(where, "a string or a list of text parts", content)


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", "a list of {'type': 'function', 'function': {...}}", tools)
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f"tools[{i}]", "{'type': 'function', 'function': {'name': ...}}", t)
        if not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}].function.name", "a string", fn.get("name"))
    return tools


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> ToolPolicy | None:
    """The policy the output is checked against (None without tools); a 400 naming tool_choice when it is
    malformed, asks for a call without tools, or names a function the request does not offer."""
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if set(choice) != {"type", "function"} or choice["type"] != "function" or not isinstance(name, str):
            raise _bad("tool_choice", "{'type': 'function', 'function': {'name': ...}}", choice)
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise _bad(
            "tool_choice", "'none', 'auto', 'required' or {'type': 'function', 'function': {...}}", choice
        )
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError(
                "'tool_choice' asks for a tool call but the request has no 'tools'", param="tool_choice"
            )
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        offered = [t["function"]["name"] for t in tools]
        if name not in offered:
            raise RequestError(
                f"'tool_choice' names {name!r}, not one of the request's tools {offered}", param="tool_choice"
            )
        return ToolPolicy(tools=tools, choice="function", function=name)
    return ToolPolicy(tools=tools, choice=choice or "auto")


def template_options(body: dict[str, Any], allow_chat_template: bool) -> tuple[dict[str, Any], str | None]:
    """(template variables, the client's own template or None). A client template is code the server would run
    (a looping one holds a worker): refused unless the server was started with --allow_client_chat_template."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object of template variables", kwargs)
    kwargs = dict(kwargs)
    template = body.get("chat_template")
    where = "chat_template"
    if "chat_template" in kwargs:
        template, where = kwargs.pop("chat_template"), "chat_template_kwargs.chat_template"
    if template is not None:
        if not allow_chat_template:
            raise RequestError(
                f"'{where}': this server renders the model's own chat template only; a client template is "
                "code the server would run. Start it with --allow_client_chat_template true to accept one",
                param=where,
            )
        if not isinstance(template, str):
            raise _bad(where, "a Jinja template string", template)
    for key in kwargs:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise RequestError(
                f"'chat_template_kwargs.{key}' is an argument of the template call, not a template variable "
                "(tools go in 'tools')",
                param=f"chat_template_kwargs.{key}",
            )
    return kwargs, template


def parse_prompt(prompt: Any, vocab_size: int) -> str | list[int]:
    """A completions prompt: one string, or one list of token ids (a one-element list of either)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise RequestError("one prompt per request: send several requests (or use n)", param="prompt")
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt", vocab_size, allow_empty=False)
    raise _bad("prompt", "one string or one list of token ids", prompt)
