"""`relayrl serve`'s request checks over real HTTP on 127.0.0.1: every bad field is a 400 JSON error naming it
(never a default silently put in its place, never a plain-text 500), the context limit, the body size limit,
client chat templates only on opt-in, rendering off the event loop, sessions apart from OpenAI's `user`."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from relayrl.agents.openai_server import OpenAIServer

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "1+1=", "max_tokens": 2}


def _post(port: int, path: str, body: dict | bytes, headers: dict | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            raise AssertionError(f"HTTP {e.code} with a body that is not JSON: {raw[:200]!r}") from None


@pytest.fixture()
def server(engine, tiny_tokenizer):
    """A server without max_total_len: the context is the engine's (max_seq_len 512)."""
    s = OpenAIServer(engine, tiny_tokenizer, model_name="tiny")
    port = s.start_in_thread()
    yield s, port
    s.stop_thread()


CHAT_BAD = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"n": 0}, "n"),
    ({"n": [1]}, "n"),
    ({"n": 129}, "n"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": {}}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),  # a call without tools
    ({"tool_choice": 5}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"top_logprobs": 2, "logprobs": True}, "top_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"user": 5}, "user"),
    ({"session_id": ""}, "session_id"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"prompt": "x"}, "prompt"),  # a completions field
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}}, "chat_template_kwargs.chat_template"),
    ({"chat_template": "{{ 'x' }}"}, "chat_template"),
]  # fmt: skip

COMPLETION_BAD = [
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [5, 100000]}, "prompt"),
    ({"prompt": [5, True]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"logprobs": 6}, "logprobs"),
    ({"logprobs": 2}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"stop": ["\n"]}, "stop"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages"),  # a chat field
]


@pytest.mark.parametrize("path,base,cases", [("/v1/chat/completions", CHAT, CHAT_BAD),
                                             ("/v1/completions", COMPLETION, COMPLETION_BAD)])  # fmt: skip
def test_every_bad_field_is_a_400_naming_it(server, path, base, cases):
    s, port = server
    for change, param in cases:
        status, body = _post(port, path, {**base, **change})
        assert status == 400, (change, body)
        err = body["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (change, err)
        assert param.split("[")[0].split(".")[0] in err["message"], (change, err)
    assert s.metrics["server/requests"] == 0  # nothing reached the engine


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', "top_p"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\udfff"}', "user"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "n": 1', None),  # truncated JSON
        (b"[1, 2]", None),
    ],
)
def test_non_finite_numbers_lone_surrogates_and_broken_json_are_400_json(server, raw, param):
    _, port = server
    status, body = _post(port, "/v1/chat/completions", raw)
    assert status == 400 and body["error"]["param"] == param, body


def test_valid_edge_values_are_honoured_not_replaced(server, tiny_tokenizer):
    """max_tokens 1 is one token, n 3 is three choices, temperature 0 is greedy (two calls agree), null means
    the default, and OpenAI's `user` field is accepted without naming a session."""
    s, port = server
    status, one = _post(
        port, "/v1/completions", {**COMPLETION, "max_tokens": 1, "temperature": 1.0, "seed": 0}
    )
    assert status == 200 and one["usage"]["completion_tokens"] == 1
    status, three = _post(port, "/v1/chat/completions", {**CHAT, "n": 3, "user": "alice", "seed": 1})
    assert status == 200 and len(three["choices"]) == 3 and not s.traces
    greedy = [_post(port, "/v1/completions", {**COMPLETION, "max_tokens": 5, "temperature": 0, "seed": i})[1]
              for i in range(2)]  # fmt: skip
    assert greedy[0]["choices"][0]["token_ids"] == greedy[1]["choices"][0]["token_ids"]
    nulls = {"n": None, "temperature": None, "top_p": None, "max_tokens": None, "seed": None, "stop": None}
    status, body = _post(port, "/v1/completions", {**COMPLETION, **nulls})
    assert status == 200 and len(body["choices"]) == 1
    status, lp = _post(port, "/v1/completions", {**COMPLETION, "logprobs": 0})  # the sampled token's only
    assert (
        status == 200
        and len(lp["choices"][0]["logprobs"]["token_logprobs"]) == lp["usage"]["completion_tokens"]
    )


def test_a_prompt_longer_than_the_context_is_400_as_openai_answers(server):
    """No max_total_len given: the engine's context (512) is the limit, and a longer prompt is refused with
    OpenAI's code, not answered 200 with empty text."""
    s, port = server
    assert s.max_total_len == 512
    prompt_520_ids = list(range(5, 25)) * 26
    status, body = _post(port, "/v1/completions", {**COMPLETION, "prompt": prompt_520_ids})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    assert (
        "maximum context length is 512 tokens. However, your prompt resulted in 520 tokens"
        in body["error"]["message"]
    )
    status, body = _post(
        port, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 600}]}
    )
    assert (
        status == 400
        and body["error"]["param"] == "messages"
        and "context length" in body["error"]["message"]
    )


def test_a_body_over_the_size_limit_is_413_json(engine, tiny_tokenizer):
    s = OpenAIServer(engine, tiny_tokenizer, max_request_bytes=64 * 1024)
    port = s.start_in_thread()
    try:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
        for path in ("/v1/chat/completions", "/tokenize"):
            status, body = _post(port, path, big)
            assert status == 413 and body["error"]["code"] == "request_too_large", body
            assert "--max_request_mb" in body["error"]["message"]
        assert _post(port, "/v1/chat/completions", CHAT)[0] == 200
    finally:
        s.stop_thread()


LOUD_TEMPLATE = "{% for m in messages %}LOUD {{ m['content'] }}\n{% endfor %}"


def test_a_client_chat_template_runs_only_on_opt_in(engine, tiny_tokenizer):
    for allow in (False, True):
        s = OpenAIServer(engine, tiny_tokenizer, allow_client_chat_template=allow)
        port = s.start_in_thread()
        try:
            for body in ({**CHAT, "chat_template_kwargs": {"chat_template": LOUD_TEMPLATE}},
                         {**CHAT, "chat_template": LOUD_TEMPLATE}):  # fmt: skip
                status, out = _post(port, "/v1/chat/completions", body)
                if not allow:
                    assert status == 400 and "--allow_client_chat_template true" in out["error"]["message"]
                else:
                    assert status == 200
                    assert tiny_tokenizer.decode(out["prompt_token_ids"]) == "LOUD hi\n"
            status, _ = _post(
                port, "/tokenize", {"messages": CHAT["messages"], "chat_template": LOUD_TEMPLATE}
            )
            assert status == (200 if allow else 400)
        finally:
            s.stop_thread()


def test_a_huge_prompt_does_not_hold_up_a_small_request(server):
    """A 0.8 MB prompt (seconds of tokenization) and then a small request: the small one answers first and
    fast, because parsing, rendering and tokenization run on worker threads, not on the event loop."""
    _, port = server
    done: dict[str, float] = {}
    answers: dict[str, int] = {}

    def send(name: str, body: dict) -> None:
        answers[name] = _post(port, "/v1/chat/completions", body)[0]
        done[name] = time.monotonic()

    big = {**CHAT, "messages": [{"role": "user", "content": "12+34= hello " * 60_000}]}
    t0 = time.monotonic()
    large = threading.Thread(target=send, args=("large", big))
    large.start()
    time.sleep(0.3)  # the large body is read and being tokenized
    t1 = time.monotonic()
    send("small", CHAT)
    large.join(120)
    assert answers == {"small": 200, "large": 400}  # the large one exceeds the context once tokenized
    assert done["small"] < done["large"], (done["small"] - t0, done["large"] - t0)
    assert done["small"] - t1 < 2.0, done["small"] - t1


def test_sessions_come_from_the_header_or_session_id_and_are_read_by_that_id(server):
    s, port = server
    assert _post(port, "/v1/chat/completions", CHAT, {"X-Session-Id": "ep-1"})[0] == 200
    assert _post(port, "/v1/chat/completions", {**CHAT, "session_id": "ep-1"})[0] == 200
    status, body = _post(
        port, "/v1/chat/completions", {**CHAT, "session_id": "ep-2"}, {"X-Session-Id": "ep-1"}
    )
    assert status == 400 and body["error"]["param"] == "session_id"
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/traces/ep-1", timeout=30) as r:
        trace = json.loads(r.read())
    assert trace["session_id"] == "ep-1" and len(trace["calls"]) == 2
    assert _post(port, "/v1/chat/completions", {**CHAT, "user": "ep-3"})[0] == 200 and "ep-3" not in s.traces


class _BrokenEngine:
    max_seq_len = 64

    async def generate(self, request):
        raise RuntimeError("engine fell over")


def test_an_engine_failure_is_a_json_500(tiny_tokenizer):
    s = OpenAIServer(_BrokenEngine(), tiny_tokenizer)
    port = s.start_in_thread()
    try:
        status, body = _post(port, "/v1/completions", COMPLETION)
    finally:
        s.stop_thread()
    assert status == 500 and body["error"]["type"] == "server_error"
    assert "RuntimeError: engine fell over" in body["error"]["message"]


def test_relayrl_serve_passes_its_limits_to_the_server(tiny_model_path, monkeypatch):
    """`relayrl serve --max_request_mb 0.05`: the app it runs answers a 100 kB body 413, refuses a client
    template (no --allow_client_chat_template), and takes the engine's context (512) as the prompt limit."""
    import asyncio

    from relayrl.agents.http import start_app
    from relayrl.apps import serve
    from relayrl.config.apps import ServeConfig
    from relayrl.config.base import ConfigError
    from relayrl.config.command_line import parse_cli

    with pytest.raises(ConfigError, match="max_request_mb"):
        parse_cli(ServeConfig, ["--max_request_mb", "0"])
    apps = []
    monkeypatch.setattr(serve.web, "run_app", lambda app, **kw: apps.append(app))
    argv = ["--model", str(tiny_model_path), "--device", "cpu", "--engine", "hf", "--max_request_mb", "0.05"]
    assert serve.main(argv) == 0
    results = {}

    async def run():
        runner, port = await start_app(apps[0])
        try:
            for name, body in [
                ("big", {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}),
                ("template", {**CHAT, "chat_template": LOUD_TEMPLATE}),
                ("long", {**COMPLETION, "prompt": [5] * 600}),
            ]:
                results[name] = await asyncio.to_thread(_post, port, "/v1/chat/completions" if "messages" in body
                                                         else "/v1/completions", body)  # fmt: skip
        finally:
            await runner.cleanup()

    asyncio.run(run())
    assert results["big"][0] == 413 and results["template"][0] == 400
    assert (
        results["long"][0] == 400
        and "maximum context length is 512" in results["long"][1]["error"]["message"]
    )
