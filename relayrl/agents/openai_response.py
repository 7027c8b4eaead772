"""The bodies `relayrl serve` answers with (openai_server.py), in OpenAI's formats.

    choice(tokenizer, i, completion, stop_ids, chat, logprobs, tools, parse) -> dict    one entry of "choices"
    await stream(request, payload, chat, headers)                        the same answer as SSE chunks

Choices carry the non-standard `token_ids` next to the OpenAI fields (the `openai` client keeps extra fields).
A chat request with tools (`tools`: its ToolPolicy) gets the parsed `tool_calls` in its message and
finish_reason "tool_calls" when the model called one; output that breaks tool_choice raises ToolCallError.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from aiohttp import web

from relayrl.agents.executors import decode_response
from relayrl.agents.tool_calls import Parser, ToolPolicy
from relayrl.rollout.base import Completion, FinishReason


def choice(
    tokenizer: Any,
    i: int,
    comp: Completion,
    stops: set[int],
    chat: bool,
    want_lp: bool,
    tools: ToolPolicy | None = None,
    parse: Parser | None = None,
) -> dict:
    """Choice `i` of a chat.completion (`chat`) or text_completion; log-probs of the sampled tokens when
    `want_lp` (chat: logprobs.content; completions: tokens / token_logprobs / text_offset); a chat request's
    `tools` policy reads tool calls from the text with `parse` (ToolCallError when the output breaks it)."""
    text = decode_response(tokenizer, comp.token_ids, stops)
    finish = "stop" if comp.finish_reason == FinishReason.STOP else "length"
    out: dict[str, Any] = {"index": i, "finish_reason": finish, "token_ids": list(comp.token_ids)}
    pieces = [tokenizer.decode([t]) for t in comp.token_ids] if want_lp else []
    if chat:
        out["message"] = {"role": "assistant", "content": text}
        if tools is not None:
            out["message"] = tools.message(text, parse)
            if "tool_calls" in out["message"]:
                out["finish_reason"] = "tool_calls"
        out["logprobs"] = None
        if want_lp:
            content = [
                {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                for p, lp in zip(pieces, comp.logprobs, strict=True)
            ]
            out["logprobs"] = {"content": content}
    else:
        out["text"] = text
        out["logprobs"] = None
        if want_lp:
            offsets = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)) if pieces else []
            out["logprobs"] = {
                "tokens": pieces,
                "token_logprobs": list(comp.logprobs),
                "top_logprobs": None,
                "text_offset": offsets,
            }
    return out


async def stream(
    request: web.Request, payload: dict[str, Any], chat: bool, headers: dict[str, str]
) -> web.StreamResponse:
    """`stream: true`: the OpenAI server-sent-events format (a role chunk, one content chunk per choice,
    a finish chunk with usage, then `data: [DONE]`). The chunks are sent once generation finished: the
    protocol is honoured, the latency is not yet incremental."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await resp.prepare(request)
    kind = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": payload["id"], "object": kind, "created": payload["created"], "model": payload["model"]}

    async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
        await resp.write(f"data: {json.dumps({**base, 'choices': choices, **extra})}\n\n".encode())

    for c in payload["choices"]:
        i = c["index"]
        if chat:
            await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            delta = {"content": c["message"]["content"]}
            if "tool_calls" in c["message"]:
                delta["tool_calls"] = [{"index": k, **t} for k, t in enumerate(c["message"]["tool_calls"])]
            await send([{"index": i, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}])
            await send([{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}])
        else:
            await send([{"index": i, "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}])
            await send([{"index": i, "text": "", "finish_reason": c["finish_reason"]}])
    await send([], usage=payload["usage"])
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
