"""Tool calls (relayrl.agents.tool_calls) through the OpenAI server: the Hermes / Qwen parser, tool_choice
rules, tools passed to the chat template, and a two-tool agent on the `openai` client whose session trace
is token-exact.

A tiny random model never writes a tool call, so the engine here is a stub at the generation boundary only:
it returns scripted completions (token ids of a fixed text + EOS, log-prob -0.5 each); everything else (chat
template, parsing, HTTP, the openai client, the trace) is the real code."""

from __future__ import annotations

import copy
import functools
import json
import operator
import re

import openai
import pytest

from relayrl.agents.openai_request import RequestError, parse_request
from relayrl.agents.openai_server import OpenAIServer
from relayrl.agents.tool_calls import ToolCallError, hermes, parser_for, template_messages
from relayrl.agents.traces import trace_to_trajectory
from relayrl.rollout.base import Completion, FinishReason, GenerationResult

# ChatML with Qwen2.5's tool markup: tools listed in a system turn, assistant calls as <tool_call>{json}</tool_call>,
# tool results as <tool_response> in a user turn
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\n' }}{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for tc in message['tool_calls'] %}<tool_call>{{ {'name': tc['function']['name'], "
    "'arguments': tc['function']['arguments']} | tojson }}</tool_call>{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": n, "description": f"{n} two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    for n in ("add", "mul")
]  # fmt: skip


def _call(name: str, a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"a": a, "b": b}}) + "</tool_call>"


class ScriptedEngine:
    """Returns the next scripted text as token ids + EOS (the generation boundary; nothing else is faked)."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []

    async def generate(self, request):
        self.prompts.append(list(request.prompt_ids))
        ids = [*self.tokenizer.encode(self.texts.pop(0)), self.tokenizer.eos_token_id]
        comp = Completion(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=FinishReason.STOP)
        return GenerationResult(
            request_id=request.request_id, prompt_ids=request.prompt_ids, completions=[comp]
        )


@pytest.fixture()
def tool_tokenizer(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    return tok


def _serve(engine, tokenizer):
    server = OpenAIServer(engine, tokenizer, model_name="tiny")
    port = server.start_in_thread()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
    return server, client


def test_hermes_parses_calls_and_the_text_around_them():
    text = 'Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' + _call(
        "mul", 3, 4
    )
    parsed = hermes(text)
    assert parsed.content == "Let me add."
    assert parsed.calls == [("add", '{"a": 1, "b": 2}'), ("mul", '{"a": 3, "b": 4}')]
    assert hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>').calls == [
        ("add", '{"a": 1}')
    ]  # arguments given as a JSON string
    assert hermes("just text").calls == [] and hermes("just text").content == "just text"
    with pytest.raises(ToolCallError, match="tool call 0 is not valid JSON"):
        hermes('<tool_call>{"name": "add", "arguments": {"a": </tool_call>')
    with pytest.raises(ToolCallError, match="is not closed"):
        hermes('<tool_call>{"name": "add"}')
    with pytest.raises(ToolCallError, match='string "name"'):
        hermes('<tool_call>{"arguments": {}}</tool_call>')


def _policy(body: dict):
    """The request parser's tool policy for a chat body with `body`'s tools / tool_choice."""
    msgs = [{"role": "user", "content": "hi"}]
    return parse_request({"messages": msgs, **body}, chat=True, vocab_size=1000).tool_choice


def test_tool_choice_rules():
    parse = hermes
    auto = _policy({"tools": TOOLS})
    assert auto is not None and auto.message("20", parse) == {"role": "assistant", "content": "20"}
    msg = auto.message(_call("add", 2, 3), parse)
    assert msg["content"] is None and msg["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": '{"a": 2, "b": 3}',
    }
    assert msg["tool_calls"][0]["id"].startswith("call_") and msg["tool_calls"][0]["type"] == "function"
    with pytest.raises(ToolCallError, match="not among the offered tools"):
        auto.message(_call("sub", 1, 1), parse)
    required = _policy({"tools": TOOLS, "tool_choice": "required"})
    assert required is not None
    with pytest.raises(ToolCallError, match="requires a tool call; the model answered '20'"):
        required.message("20", parse)
    named = _policy({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}})
    assert named is not None and named.function == "mul"
    with pytest.raises(ToolCallError, match="tool_choice names 'mul'"):
        named.message(_call("add", 1, 2), parse)
    none = _policy({"tools": TOOLS, "tool_choice": "none"})
    assert none is not None and none.message(_call("add", 1, 2), parse)["content"] == _call("add", 1, 2)
    assert _policy({}) is None
    bad = [
        ({"tool_choice": "required"}, "tool_choice", "asks for a tool call but the request has no 'tools'"),
        ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", "'tool_choice' must be 'none', 'auto'"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "'tool_choice' must be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}}, "tool_choice",
         "names 'sub', not one of the request's tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "'tools[0]' must be"),
        ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name", "a string"),
        ({"tools": {"add": {}}}, "tools", "'tools' must be a list"),
    ]  # fmt: skip
    for body, param, message in bad:
        with pytest.raises(RequestError, match=re.escape(message)) as e:
            _policy(body)
        assert e.value.param == param and e.value.status == 400, body


def test_the_parser_is_chosen_by_the_chat_template(tiny_tokenizer, tool_tokenizer):
    assert parser_for(tool_tokenizer) is hermes and parser_for(tiny_tokenizer) is None
    assert parser_for(tiny_tokenizer, "hermes") is hermes and parser_for(tool_tokenizer, "none") is None
    with pytest.raises(ValueError, match="tool_parser must be auto, none or one of"):
        parser_for(tiny_tokenizer, "mistral")
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    out = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}


def test_a_two_tool_agent_round_trip_with_a_token_exact_trace(tool_tokenizer):
    """(2 + 3) * 4 with add and mul over the openai client: two tool calls, then the answer; the tools reach
    the template; the session's trajectory is the engine's exact tokens, one extending prompt per turn."""
    outputs = [_call("add", 2, 3), _call("mul", 5, 4), "The answer is 20."]
    engine = ScriptedEngine(tool_tokenizer, outputs)
    server, client = _serve(engine, tool_tokenizer)
    try:
        messages: list = [{"role": "user", "content": "What is (2+3)*4?"}]
        run = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}
        for _ in range(3):
            r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                               extra_headers={"X-Session-Id": "s1"})  # fmt: skip
            msg = r.choices[0].message
            if not msg.tool_calls:
                break
            assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1
            messages.append(msg.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
            for tc in msg.tool_calls:
                result = run[tc.function.name](**json.loads(tc.function.arguments))
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(result)})
        assert msg.content == "The answer is 20." and r.choices[0].finish_reason == "stop"
        assert [m["content"] for m in messages if m["role"] == "tool"] == ["5", "20"]
        first_prompt = tool_tokenizer.decode(engine.prompts[0])
        assert first_prompt.startswith("<|im_start|>system\n# Tools\n") and '"name": "mul"' in first_prompt
        trace = server.pop_trace("s1")
    finally:
        server.stop_thread()
    assert trace is not None and not trace.rewrites and len(trace.calls) == 3
    traj = trace_to_trajectory(trace)
    eos = tool_tokenizer.eos_token_id
    generated = [[*tool_tokenizer.encode(t), eos] for t in outputs]
    assert traj.token_ids == engine.prompts[-1] + generated[-1]
    assert [t for t, a in zip(traj.token_ids, traj.action_mask, strict=True) if a] == functools.reduce(
        operator.iadd, generated, []
    )
    assert [lp for lp, a in zip(traj.rollout_logprobs, traj.action_mask, strict=True) if a] == [-0.5] * sum(
        map(len, generated)
    )


def test_output_that_breaks_tool_choice_is_a_422_and_stays_traced(tool_tokenizer, tiny_tokenizer):
    engine = ScriptedEngine(
        tool_tokenizer, ["20", '<tool_call>{"name": "add", "arguments": {"a": </tool_call>']
    )
    server, client = _serve(engine, tool_tokenizer)
    try:
        ask = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        with pytest.raises(openai.UnprocessableEntityError, match="requires a tool call"):
            client.chat.completions.create(**ask, tool_choice="required", extra_headers={"X-Session-Id": "s"})
        with pytest.raises(openai.UnprocessableEntityError, match="not valid JSON"):
            client.chat.completions.create(**ask)
        trace = server.pop_trace("s")
        assert trace is not None and trace.calls[0].completion_ids == [
            *tool_tokenizer.encode("20"),
            tool_tokenizer.eos_token_id,
        ]
    finally:
        server.stop_thread()
    server, client = _serve(ScriptedEngine(tiny_tokenizer, ["x"]), tiny_tokenizer)  # ChatML: no tool markup
    try:
        with pytest.raises(openai.UnprocessableEntityError, match="tool-call format is unknown"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], tools=TOOLS
            )
    finally:
        server.stop_thread()


def test_a_streamed_answer_carries_the_tool_calls(tool_tokenizer):
    """stream: true gives the same tool call as chunks (delta.tool_calls with an index, finish "tool_calls")."""
    server, client = _serve(ScriptedEngine(tool_tokenizer, [_call("mul", 5, 4)]), tool_tokenizer)
    try:
        chunks = list(
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "5*4?"}], tools=TOOLS, stream=True
            )
        )
    finally:
        server.stop_thread()
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0 and calls[0].id and calls[0].id.startswith("call_")
    assert calls[0].function is not None and calls[0].function.name == "mul"
    assert json.loads(calls[0].function.arguments or "") == {"a": 5, "b": 4}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
