"""The OpenAI-compatible server with the real `openai` client on 127.0.0.1: endpoints, token-exact session
traces, history-rewrite detection, and training an OpenAI-client agent through OpenAIAgentExecutor."""

from __future__ import annotations

import asyncio
import copy
import json
import urllib.error
import urllib.request

import openai
import pytest

from relayrl.agents.base import TrajectoryStatus
from relayrl.agents.openai_agent import OpenAIAgentExecutor
from relayrl.agents.openai_server import OpenAIServer
from relayrl.agents.traces import trace_to_trajectory, trace_turn_trajectories
from relayrl.data.records import PromptSample
from relayrl.rollout.base import SamplingParams

# ChatML, but earlier assistant turns are rendered without their content (like templates that drop reasoning)
DROPPING_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and not loop.last %}{{ '<|im_start|>assistant\n<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture()
def served(engine, tiny_tokenizer):
    """(server, sync openai client) on a free port."""
    server = OpenAIServer(engine, tiny_tokenizer, model_name="tiny", max_total_len=256)
    port = server.start_in_thread()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    yield server, client, port
    server.stop_thread()


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_models_tokenize_completions(served, tiny_model, tiny_tokenizer, tf_logprobs):
    server, client, port = served
    assert [m.id for m in client.models.list().data] == ["tiny"]
    tok = _post(port, "/tokenize", {"prompt": "12+34="})
    assert tok["tokens"] == tiny_tokenizer("12+34=")["input_ids"] and tok["count"] == 6
    chat_tok = _post(port, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert (
        tiny_tokenizer.decode(chat_tok["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert _post(port, "/detokenize", {"tokens": tok["tokens"]}) == {"prompt": "12+34="}

    r = client.completions.create(model="tiny", prompt="12+34=", max_tokens=6, temperature=0, logprobs=1)
    choice = r.choices[0]
    ids = choice.model_extra["token_ids"]
    assert 1 <= len(ids) <= 6 and r.usage.prompt_tokens == 6 and r.usage.completion_tokens == len(ids)
    body = ids[:-1] if ids[-1] == tiny_tokenizer.eos_token_id else ids
    assert choice.text == tiny_tokenizer.decode(body, skip_special_tokens=True)
    ref = tf_logprobs(tiny_model, tok["tokens"] + ids)  # greedy: log-probs of softmax(logits)
    assert choice.logprobs.token_logprobs == pytest.approx(ref[6:], abs=1e-4)
    assert server.metrics["server/requests"] == 1 and not server.traces  # no session id: nothing traced


def _chat(client, messages, sid, **kw):
    return client.chat.completions.with_raw_response.create(
        model="tiny", messages=messages, max_tokens=6, extra_headers={"X-Session-Id": sid}, **kw
    )


def test_session_trace_is_token_exact(served, tiny_model, tiny_tokenizer, tf_logprobs):
    server, client, _ = served
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    raw = _chat(client, messages, "s1", temperature=0.8, seed=3)
    first = raw.parse().choices[0].message.content
    assert raw.headers.get("X-Relayrl-History-Rewrite") is None
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "more"}]
    second = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0.8, seed=4, user="end-user-7",
        extra_body={"session_id": "s1"},
    )  # the body's session_id names the session too; OpenAI's `user` field does not  # fmt: skip
    assert "end-user-7" not in server.traces
    trace = server.pop_trace("s1")
    assert len(trace.calls) == 2 and not trace.rewritten and server.metrics["server/history_rewrites"] == 0
    traj = trace_to_trajectory(trace, PromptSample(index=7, prompt="hi", prompt_ids=[], label=None))
    c1, c2 = trace.calls
    assert traj.status == TrajectoryStatus.OK and traj.num_turns == 2 and traj.sample.index == 7
    assert traj.token_ids == c2.prompt_ids + c2.completion_ids
    expected_mask = [False] * len(c1.prompt_ids) + [True] * len(c1.completion_ids)
    expected_mask += [False] * (len(c2.prompt_ids) - len(expected_mask)) + [True] * len(c2.completion_ids)
    assert traj.action_mask == expected_mask and traj.prompt_len == len(c1.prompt_ids)
    assert second.choices[0].message.content == tiny_tokenizer.decode(
        c2.completion_ids, skip_special_tokens=True
    )
    # prompt 2 is exactly the template of the conversation: history kept verbatim
    text = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert c2.prompt_ids == tiny_tokenizer(text)["input_ids"]
    ref = tf_logprobs(tiny_model, traj.token_ids, temperature=0.8)
    acts = [i for i, m in enumerate(traj.action_mask) if m]
    assert [traj.rollout_logprobs[i] for i in acts] == pytest.approx([ref[i] for i in acts], abs=1e-4)


def test_history_rewrite_detected(engine, tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = DROPPING_TEMPLATE
    server = OpenAIServer(engine, tok)
    port = server.start_in_thread()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        messages = [{"role": "user", "content": "hi"}]
        first = _chat(client, messages, "s2", temperature=0).parse().choices[0].message.content
        assert first  # the greedy answer is not empty, so dropping it changes the prompt
        messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "again"}]
        raw = _chat(client, messages, "s2", temperature=0)
        assert raw.headers["X-Relayrl-History-Rewrite"] == "1"
        assert server.metrics["server/history_rewrites"] == 1
        trace = server.pop_trace("s2")
    finally:
        server.stop_thread()
    assert trace.rewritten and not trace.calls[1].extends_previous
    traj = trace_to_trajectory(trace)
    assert traj.status == TrajectoryStatus.FAILED and traj.failure_kind == "history_rewrite"
    assert "session 's2' turn 2: the prompt does not extend turn 1's prompt + completion" in traj.error
    per_turn = trace_turn_trajectories(trace)
    assert [t.token_ids for t in per_turn] == [c.prompt_ids + c.completion_ids for c in trace.calls]


def test_bad_requests(served):
    server, client, port = served
    for path, data, why in [
        ("/tokenize", b"[1, 2]", "body must be a JSON object, got list"),
        ("/detokenize", b"not json", "body is not valid JSON"),
        ("/v1/completions", b'"x"', "body must be a JSON object, got str"),
    ]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400 and why in err.value.read().decode()
    with pytest.raises(openai.BadRequestError, match="one completion per call"):
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            n=2,
            extra_headers={"X-Session-Id": "s3"},
        )
    # `user` is not a session: n > 1 works with it, and nothing is traced under its name
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2,
                                       max_tokens=3, user="s3")  # fmt: skip
    assert len(r.choices) == 2 and not server.traces
    with pytest.raises(openai.BadRequestError, match=r"'stop' is not supported \(stop strings would break"):
        client.completions.create(model="tiny", prompt="x", stop=["\n"])
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens") as err:
        client.completions.create(model="tiny", prompt="x" * 300)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"


async def _agent(base_url: str, session_id: str, sample: PromptSample) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": sample.prompt}]
    for _ in range(2):
        r = await client.chat.completions.create(
            model="relayrl",
            messages=messages,
            max_tokens=50,
            temperature=0.1,
            extra_headers={"X-Session-Id": session_id},
        )
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "ok"}]  # fmt: skip
    await client.close()
    return {"rewards": float(len(messages[-2]["content"])), "extra_logs": {"turns": 2}}


def test_openai_agent_executor_trains_client_agents(engine, tiny_model, tiny_tokenizer, tf_logprobs):
    ex = OpenAIAgentExecutor(_agent, engine, tiny_tokenizer)
    sample = PromptSample(index=3, prompt="hello", prompt_ids=[], label=None)
    try:
        trajs = asyncio.run(
            ex.execute(sample, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
        )
    finally:
        ex.close()
    for t in trajs:
        assert t.status == TrajectoryStatus.OK, t.error
        assert t.num_turns == 2 and t.extra_logs == {"turns": 2.0} and t.reward == t.score
        assert sum(t.action_mask) <= 8  # the trainer's max_new_tokens=4 capped the client's max_tokens=50
        # the trainer's temperature 1.0 replaced the client's 0.1: log-probs are those of softmax(logits / 1)
        ref = tf_logprobs(tiny_model, t.token_ids, temperature=1.0)
        acts = [i for i, m in enumerate(t.action_mask) if m]
        assert [t.rollout_logprobs[i] for i in acts] == pytest.approx([ref[i] for i in acts], abs=1e-4)
    assert trajs[0].token_ids != trajs[1].token_ids  # two sessions, two seeds


def test_trace_with_an_aborted_call_fails():
    from relayrl.agents.failures import FailureLog
    from relayrl.agents.traces import SessionTrace, TraceCall

    ok = TraceCall(prompt_ids=[5, 6], completion_ids=[7, 1], logprobs=[-0.5, -0.25], finish_reason="stop")
    cut = TraceCall(prompt_ids=[5, 6, 7, 1, 9], completion_ids=[8], logprobs=[-1.0], finish_reason="abort")
    good = trace_to_trajectory(SessionTrace(session_id="a", calls=[ok]))
    assert good.status == TrajectoryStatus.OK and good.action_mask == [False, False, True, True]
    log = FailureLog()
    bad = trace_to_trajectory(SessionTrace(session_id="b", calls=[ok, cut]), log=log)
    assert (
        bad.status == TrajectoryStatus.FAILED
        and bad.failure_kind == "aborted"
        and log.counts == {"aborted": 1}
    )
    assert "aborted call(s) [2]" in bad.error


def test_stream_true_yields_chunks_equal_to_the_plain_answer(served):
    """The openai client with stream=True receives SSE chunks whose text is the non-streamed answer (same
    seed), ending with usage; top_logprobs is refused with 400 saying why."""
    _, client, _ = served
    kw = dict(model="tiny", messages=[{"role": "user", "content": "2+2="}], max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain and chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens >= 1
    comp = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="1+1=", max_tokens=4, temperature=0, stream=True
        )
        if c.choices
    )
    assert (
        comp
        == client.completions.create(model="tiny", prompt="1+1=", max_tokens=4, temperature=0).choices[0].text
    )
    with pytest.raises(openai.BadRequestError, match="top_logprobs is not supported"):
        client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
