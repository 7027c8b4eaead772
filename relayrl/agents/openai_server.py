"""`relayrl serve`: a rollout engine behind an OpenAI-compatible HTTP API, with token-exact session traces.

    POST /v1/chat/completions   messages -> chat template -> token ids -> engine -> text (+ token ids, logprobs)
    POST /v1/completions        prompt text (or token ids) -> engine -> text
    GET  /v1/models             the one served model
    POST /tokenize              {"prompt": str} or {"messages": [...]} -> {"tokens": [...], "count": n}
    POST /detokenize            {"tokens": [...]} -> {"prompt": str}
    GET / DELETE /v1/traces/{session}   a session's token trace (DELETE also forgets it)

Binds 127.0.0.1 unless told otherwise. Choices carry non-standard `token_ids` (and the response
`prompt_token_ids`) next to the OpenAI fields; the `openai` client keeps extra fields.

Training an agent written against the OpenAI client: give each episode a session id (header
`X-Session-Id`, body `session_id` via the client's `extra_body`, or the standard `user` field). For every
call of a session the server records a `TraceCall`: the exact prompt token ids it built and the sampled
token ids + log-probs. `trace_to_trajectory` turns a session into one `Trajectory`: the last call's prompt +
completion, with every call's completion marked as action tokens and everything else (system, user, tool
messages, template tokens) masked. That is only token-exact when each call's prompt *extends* the previous
call's prompt + completion. A chat template that rewrites history (e.g. drops earlier reasoning) breaks
this: the server detects it on arrival, records an error naming the session, turn and first differing
token, counts `server/history_rewrites`, sets the response header `X-Relayrl-History-Rewrite: 1`, and the
session's trajectory comes back FAILED (kind "history_rewrite") instead of being silently mis-trained;
`trace_turn_trajectories` gives one exact trajectory per call instead.

Tools (relayrl.agents.tool_calls): a chat request's OpenAI `tools` go to the chat template (`tools=`); the
completion is parsed by the template's tool-call parser (`tool_parser`, "auto" picks it from the template) into
`tool_calls` (finish_reason "tool_calls"); output that breaks `tool_choice` or does not parse answers HTTP 422
(type "tool_call_error"), its tokens still recorded in the session trace.

Session sampling defaults (`open_session(sid, params)`): the trainer's temperature / top_p / top_k / seed
override what the client asks for (the trainer's log-probs assume them) and its max_new_tokens caps
`max_tokens`. A traced session samples one completion per call (n = 1).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import replace
from typing import Any

from aiohttp import web

from relayrl.agents.executors import decode_response
from relayrl.agents.http import start_app
from relayrl.agents.tool_calls import ToolCallError, ToolPolicy, parser_for, template_messages
from relayrl.agents.traces import SessionTrace, TraceCall, first_diff
from relayrl.rollout.base import Completion, FinishReason, GenerationRequest, SamplingParams

logger = logging.getLogger("relayrl.serve")


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and this message."""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is None:
        return ""
    raise RequestError(
        f"message content must be a string or a list of text parts, got {type(content).__name__}"
    )


async def _json_object(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise RequestError(f"body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise RequestError(f"body must be a JSON object, got {type(body).__name__}")
    return body


class OpenAIServer:
    """The HTTP app over `engine` and `tokenizer`; keeps per-session traces (see module doc)."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        model_name: str = "relayrl",
        max_total_len: int | None = None,
        max_sessions: int = 100_000,
        tool_parser: str = "auto",
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.tool_parse = parser_for(tokenizer, tool_parser)
        self.max_total_len, self.max_sessions = max_total_len, max_sessions
        self.traces: dict[str, SessionTrace] = {}
        self.metrics: Counter[str] = Counter()
        """server/requests, server/prompt_tokens, server/completion_tokens, server/history_rewrites."""
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None

    # ---- sessions ------------------------------------------------------------------------------------
    def open_session(self, session_id: str, params: SamplingParams | None = None) -> None:
        """Start a trace with trainer-set sampling parameters (optional: sessions also open on first use)."""
        with self._lock:
            self.traces[session_id] = SessionTrace(session_id=session_id, defaults=params)

    def pop_trace(self, session_id: str) -> SessionTrace | None:
        """Remove and return a session's trace (None if it made no calls and was never opened)."""
        with self._lock:
            return self.traces.pop(session_id, None)

    def _record(self, session_id: str, call: TraceCall) -> str | None:
        """Append `call` to its session; returns the rewrite error message, if any."""
        with self._lock:
            trace = self.traces.get(session_id)
            if trace is None:
                if len(self.traces) >= self.max_sessions:
                    self.traces.pop(next(iter(self.traces)))  # forget the oldest
                trace = self.traces[session_id] = SessionTrace(session_id=session_id)
            message = None
            if trace.calls:
                prev = trace.calls[-1].prompt_ids + trace.calls[-1].completion_ids
                if call.prompt_ids[: len(prev)] != prev:
                    call.extends_previous = False
                    message = self._rewrite_message(session_id, len(trace.calls) + 1, prev, call.prompt_ids)
                    trace.rewrites.append(message)
                    self.metrics["server/history_rewrites"] += 1
            trace.calls.append(call)
        if message:
            logger.warning(message)
        return message

    def _rewrite_message(self, sid: str, turn: int, prev: list[int], prompt: list[int]) -> str:
        j = first_diff(prev, prompt)
        want = self.tokenizer.decode(prev[j : j + 12]) if j < len(prev) else "<end>"
        got = self.tokenizer.decode(prompt[j : j + 12]) if j < len(prompt) else "<end>"
        return (
            f"session {sid!r} turn {turn}: the prompt does not extend turn {turn - 1}'s prompt + completion "
            f"(first difference at token {j} of {len(prev)}: expected {want!r}, got {got!r}). The chat "
            "template or the agent rewrote history (e.g. dropped earlier reasoning), so this session is not "
            "one token-exact trajectory; use trace_turn_trajectories or keep history verbatim."
        )

    def _defaults(self, session_id: str | None) -> tuple[SamplingParams | None, int]:
        """(trainer-set params of the session or None, calls made so far)."""
        if session_id is None:
            return None, 0
        with self._lock:
            trace = self.traces.get(session_id)
            return (trace.defaults, len(trace.calls)) if trace else (None, 0)

    # ---- request handling -----------------------------------------------------------------------------
    def _params(self, body: dict[str, Any], prompt_len: int, session_id: str | None) -> SamplingParams:
        if body.get("stop"):
            raise RequestError("'stop' strings are not supported (token-exact server); use 'stop_token_ids'")
        if body.get("echo"):
            raise RequestError("'echo' is not supported")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        n = int(body.get("n") or 1)
        if session_id is not None and n != 1:
            raise RequestError(
                "a traced session samples one completion per call (n=1); run n sessions instead"
            )
        params = SamplingParams(
            n=n,
            temperature=1.0 if body.get("temperature") is None else float(body["temperature"]),
            top_p=float(body.get("top_p") or 1.0),
            top_k=int(body.get("top_k") or 0),
            max_new_tokens=int(max_tokens),
            stop_token_ids=tuple(int(t) for t in body.get("stop_token_ids") or ()),
            seed=None if body.get("seed") is None else int(body["seed"]),
        )
        trainer, turn = self._defaults(session_id)
        if trainer is not None:
            if trainer.seed is not None:  # a different stream per turn, reproducible per session
                trainer = replace(trainer, seed=trainer.seed + 7919 * turn)
            params = replace(
                trainer,
                n=1,
                max_new_tokens=min(params.max_new_tokens, trainer.max_new_tokens),
                stop_token_ids=tuple(sorted(set(trainer.stop_token_ids) | set(params.stop_token_ids))),
            )
        if self.max_total_len is not None:
            room = self.max_total_len - prompt_len
            if room <= 0:
                raise RequestError(
                    f"prompt has {prompt_len} tokens; max_total_len {self.max_total_len} leaves none"
                )
            params = replace(params, max_new_tokens=min(params.max_new_tokens, room))
        return params

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' must be a non-empty list of {'role', 'content'}")
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise RequestError(f"messages[{i}] must be an object with 'role' and 'content'")
            msgs.append(
                {**m, "content": _content_text(m.get("content"))}
            )  # tool_calls etc. reach the template
        tools = {"tools": body["tools"]} if body.get("tools") else {}
        text = self.tokenizer.apply_chat_template(
            template_messages(msgs),
            add_generation_prompt=True,
            tokenize=False,
            **tools,
            **(body.get("chat_template_kwargs") or {}),
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _text_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise RequestError("'prompt' must be one string or one list of token ids")

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await _json_object(request)
        if body.get("top_logprobs") or (
            not chat and isinstance(body.get("logprobs"), int) and body["logprobs"] > 1
        ):
            raise RequestError(
                "top_logprobs is not supported: the engine returns the log-prob of each sampled token only; "
                "ask for 'logprobs': true (chat) or 'logprobs': 1 (completions)"
            )
        sid = request.headers.get("X-Session-Id") or body.get("session_id") or body.get("user") or None
        tools = ToolPolicy.from_request(body) if chat else None
        prompt_ids = self._chat_prompt(body) if chat else self._text_prompt(body)
        params = self._params(body, len(prompt_ids), sid)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        result = await self.engine.generate(
            GenerationRequest(prompt_ids=prompt_ids, params=params, request_id=rid)
        )
        rewrite = None
        if sid is not None:
            comp = result.completions[0]
            call = TraceCall(
                prompt_ids=prompt_ids,
                completion_ids=list(comp.token_ids),
                logprobs=list(comp.logprobs),
                finish_reason=comp.finish_reason.value,
            )
            rewrite = self._record(sid, call)
        gen_tokens = sum(len(c.token_ids) for c in result.completions)
        self.metrics.update(
            {
                "server/requests": 1,
                "server/prompt_tokens": len(prompt_ids),
                "server/completion_tokens": gen_tokens,
            }
        )
        want_lp = bool(body.get("logprobs"))
        choices = [self._choice(i, c, params, chat, want_lp, tools) for i, c in enumerate(result.completions)]
        payload = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": gen_tokens,
                "total_tokens": len(prompt_ids) + gen_tokens,
            },
            "prompt_token_ids": prompt_ids,
        }
        headers = {"X-Relayrl-History-Rewrite": "1"} if rewrite else {}
        if body.get("stream"):
            return await self._stream(request, payload, chat, headers)
        return web.json_response(payload, headers=headers)

    async def _stream(
        self, request: web.Request, payload: dict[str, Any], chat: bool, headers: dict[str, str]
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
                await send(
                    [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
                )
                delta = {"content": c["message"]["content"]}
                if "tool_calls" in c["message"]:
                    delta["tool_calls"] = [
                        {"index": k, **t} for k, t in enumerate(c["message"]["tool_calls"])
                    ]
                await send([{"index": i, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}])
                await send([{"index": i, "delta": {}, "finish_reason": c["finish_reason"]}])
            else:
                await send(
                    [{"index": i, "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}]
                )
                await send([{"index": i, "text": "", "finish_reason": c["finish_reason"]}])
        await send([], usage=payload["usage"])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _choice(
        self,
        i: int,
        comp: Completion,
        params: SamplingParams,
        chat: bool,
        want_lp: bool,
        tools: ToolPolicy | None,
    ) -> dict:
        stops = set(params.stop_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stops.add(self.tokenizer.eos_token_id)
        text = decode_response(self.tokenizer, comp.token_ids, stops)
        finish = "stop" if comp.finish_reason == FinishReason.STOP else "length"
        choice: dict[str, Any] = {"index": i, "finish_reason": finish, "token_ids": list(comp.token_ids)}
        pieces = [self.tokenizer.decode([t]) for t in comp.token_ids] if want_lp else []
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tools is not None:
                choice["message"] = tools.message(text, self.tool_parse)
                if "tool_calls" in choice["message"]:
                    choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = None
            if want_lp:
                content = [
                    {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                    for p, lp in zip(pieces, comp.logprobs, strict=True)
                ]
                choice["logprobs"] = {"content": content}
        else:
            choice["text"] = text
            choice["logprobs"] = None
            if want_lp:
                offsets = (
                    list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0)) if pieces else []
                )
                choice["logprobs"] = {
                    "tokens": pieces,
                    "token_logprobs": list(comp.logprobs),
                    "top_logprobs": None,
                    "text_offset": offsets,
                }
        return choice

    def app(self) -> web.Application:
        """The aiohttp application (routes in the module doc)."""

        def guarded(handler):
            async def run(request: web.Request) -> web.StreamResponse:
                try:
                    return await handler(request)
                except ToolCallError as e:  # the model's output, not the request: the call stays traced
                    return web.json_response(
                        {"error": {"message": str(e), "type": "tool_call_error"}}, status=422
                    )
                except (RequestError, ValueError) as e:
                    return web.json_response(
                        {"error": {"message": str(e), "type": "invalid_request_error"}}, status=400
                    )

            return run

        async def chat(request: web.Request) -> web.StreamResponse:
            return await self._generate(request, chat=True)

        async def completions(request: web.Request) -> web.StreamResponse:
            return await self._generate(request, chat=False)

        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", guarded(chat))
        app.router.add_post("/v1/completions", guarded(completions))
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", guarded(self._tokenize))
        app.router.add_post("/detokenize", guarded(self._detokenize))
        app.router.add_get("/v1/traces/{session}", self._trace)
        app.router.add_delete("/v1/traces/{session}", self._trace)
        app.router.add_get("/health", self._health)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relayrl"}
        if self.max_total_len:
            model["max_model_len"] = self.max_total_len
        return web.json_response({"object": "list", "data": [model]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await _json_object(request)
        ids = self._chat_prompt(body) if "messages" in body else self._text_prompt(body)
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.max_total_len})

    async def _detokenize(self, request: web.Request) -> web.Response:
        tokens = (await _json_object(request)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise RequestError("'tokens' must be a list of token ids")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    async def _trace(self, request: web.Request) -> web.Response:
        sid = request.match_info["session"]
        with self._lock:
            trace = self.traces.get(sid)
        if request.method == "DELETE":
            trace = self.pop_trace(sid)
        if trace is None:
            return web.json_response({"error": {"message": f"no trace for session {sid!r}"}}, status=404)
        calls = [{f: getattr(c, f) for f in TraceCall.__slots__} for c in trace.calls]
        return web.json_response({"session_id": sid, "calls": calls, "rewrites": trace.rewrites})

    # ---- running --------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve in the running event loop; returns the bound port (port 0 picks a free one)."""
        self._runner, bound = await start_app(self.app(), host, port)
        return bound

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve from a daemon thread with its own event loop (callers may use any loop, or none)."""
        ready: dict[str, Any] = {}
        started = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            try:
                ready["port"] = loop.run_until_complete(self.start(host, port))
            except BaseException as e:
                ready["error"] = e
            started.set()
            if "port" in ready:
                loop.run_forever()
                loop.run_until_complete(self.stop())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name="relayrl-openai-server")
        self._thread.start()
        started.wait()
        if "error" in ready:
            raise ready["error"]
        return int(ready["port"])

    def stop_thread(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._thread = self._loop = None
