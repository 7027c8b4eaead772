"""`relayrl serve`: a rollout engine behind an OpenAI-compatible HTTP API, with token-exact session traces.

    POST /v1/chat/completions   messages -> chat template -> token ids -> engine -> text (+ token ids, logprobs)
    POST /v1/completions        prompt text (or token ids) -> engine -> text
    GET  /v1/models             the one served model
    POST /tokenize              {"prompt": str} or {"messages": [...]} -> {"tokens": [...], "count": n}
    POST /detokenize            {"tokens": [...]} -> {"prompt": str}
    GET / DELETE /v1/traces/{session}   a session's token trace (DELETE also forgets it)

Binds 127.0.0.1 unless told otherwise. Choices carry non-standard `token_ids` (and the response
`prompt_token_ids`) next to the OpenAI fields; the `openai` client keeps extra fields.

Requests: every field is checked (openai_request.py: types, ranges, NaN / inf, unknown fields, lone
surrogates) and a bad one is answered 400 with OpenAI's error body naming it; a prompt that does not fit the
context (`max_total_len`, else the engine's `max_seq_len`) is 400 "context_length_exceeded"; a body over
`max_request_bytes` is 413; any other failure is a JSON 500, never a plain-text page. Parsing, template
rendering and tokenization run on worker threads, so a huge prompt does not hold up other requests.
Only the model's own chat template is rendered, unless `allow_client_chat_template` (a template is code).

Training an agent written against the OpenAI client: give each episode a session id (header `X-Session-Id`,
or body `session_id` via the client's `extra_body`). The OpenAI `user` field is NOT a session id (clients
send it for abuse monitoring). For every call of a session the server records a `TraceCall`: the exact
prompt token ids it built and the sampled token ids + log-probs, read back with `GET /v1/traces/{session id}`
(or `pop_trace`). `trace_to_trajectory` turns a session into one `Trajectory`: the last call's prompt +
completion, with every call's completion marked as action tokens and everything else (system, user, tool
messages, template tokens) masked. That is only token-exact when each call's prompt *extends* the previous
call's prompt + completion. A chat template that rewrites history (e.g. drops earlier reasoning) breaks
this: the server detects it on arrival, records an error naming the session, turn and first differing
token, counts `server/history_rewrites`, sets the response header `X-Relayrl-History-Rewrite: 1`, and the
session's trajectory comes back FAILED (kind "history_rewrite") instead of being silently mis-trained;
`trace_turn_trajectories` gives one exact trajectory per call instead.

Tools (relayrl.agents.tool_calls): a chat request's OpenAI `tools` (checked with `tool_choice` in
openai_request.py) go to the chat template (`tools=`, rendered off the loop like the rest); the completion is
parsed by the template's tool-call parser (`tool_parser`, "auto" picks it from the template) into `tool_calls`
(finish_reason "tool_calls", openai_response.py); output that breaks `tool_choice` or does not parse answers
HTTP 422 (type "tool_call_error"), its tokens still recorded in the session trace.

Session sampling defaults (`open_session(sid, params)`): the trainer's temperature / top_p / top_k / seed
override what the client asks for (the trainer's log-probs assume them) and its max_new_tokens caps
`max_tokens`. A traced session samples one completion per call (n = 1); requests without a session may ask
for n > 1.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from aiohttp import web

from relayrl.agents.executors import stop_ids_of
from relayrl.agents.http import start_app
from relayrl.agents.openai_request import (
    ClientRequest,
    RequestError,
    parse_json,
    parse_messages,
    parse_prompt,
    parse_request,
    template_options,
)
from relayrl.agents.openai_response import choice, stream
from relayrl.agents.tool_calls import ToolCallError, parser_for, template_messages
from relayrl.agents.traces import SessionTrace, TraceCall, first_diff
from relayrl.rollout.base import GenerationRequest, SamplingParams

logger = logging.getLogger("relayrl.serve")


DEFAULT_MAX_REQUEST_BYTES = 8 * 1024**2
"""Largest request body `relayrl serve` reads (--max_request_mb); a larger one is answered 413."""

TOKENIZE_THREADS = 4
"""Worker threads for parsing, template rendering and tokenization (off the event loop)."""


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
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        allow_client_chat_template: bool = False,
        tool_parser: str = "auto",
    ) -> None:
        """`max_total_len`: prompt + completion limit (None: the engine's `max_seq_len`); `max_request_bytes`:
        larger bodies get 413; `allow_client_chat_template`: render a template sent by the client (it is
        code: off by default); `tool_parser`: how tool calls are read from the output (tool_calls.py)."""
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.tool_parse = parser_for(tokenizer, tool_parser)
        self.max_total_len = max_total_len or getattr(engine, "max_seq_len", None)
        self.max_sessions, self.max_request_bytes = max_sessions, max_request_bytes
        self.allow_client_chat_template = allow_client_chat_template
        self.vocab_size = len(tokenizer)
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="relayrl-serve-tokenize")
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
    def _params(self, req: ClientRequest, prompt_len: int, session_id: str | None) -> SamplingParams:
        params = req.params
        if session_id is not None and params.n != 1:
            raise RequestError(
                "a traced session samples one completion per call (n=1); run n sessions instead", param="n"
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
            params = replace(
                params, max_new_tokens=min(params.max_new_tokens, self.max_total_len - prompt_len)
            )
        return params

    def _check_length(self, prompt_len: int, chat: bool) -> None:
        """OpenAI's answer to a prompt that leaves no room in the context."""
        if self.max_total_len is not None and prompt_len >= self.max_total_len:
            what = "messages" if chat else "prompt"
            raise RequestError(
                f"This model's maximum context length is {self.max_total_len} tokens. However, your {what} "
                f"resulted in {prompt_len} tokens, which leaves no room for a completion. Please reduce the "
                f"length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )

    def _render(
        self, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any], template: str | None
    ):
        if template is not None:
            kwargs = {**kwargs, "chat_template": template}
        if tools is not None:
            kwargs = {**kwargs, "tools": tools}
        try:
            text = self.tokenizer.apply_chat_template(
                template_messages(messages), add_generation_prompt=True, tokenize=False, **kwargs
            )
        except Exception as e:  # the template raised (jinja's raise_exception, a missing variable, ...)
            raise RequestError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _prepare(self, raw: bytes, chat: bool) -> tuple[ClientRequest, list[int]]:
        """Parse, check, render and tokenize a request (on a worker thread)."""
        req = parse_request(
            parse_json(raw), chat=chat, vocab_size=self.vocab_size,
            allow_chat_template=self.allow_client_chat_template,
        )  # fmt: skip
        if chat:
            assert req.messages is not None
            ids = self._render(req.messages, req.tools, req.template_kwargs, req.chat_template)
        else:
            ids = self._encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt or [])
        return req, ids

    async def _off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _body(self, request: web.Request) -> bytes:
        if (request.content_length or 0) > self.max_request_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.max_request_bytes, actual_size=request.content_length or 0
            )
        return await request.read()  # the app's client_max_size stops a body without Content-Length

    def _session(self, request: web.Request, req: ClientRequest) -> str | None:
        header = request.headers.get("X-Session-Id")
        if header is not None and req.session_id is not None and header != req.session_id:
            raise RequestError(
                f"the X-Session-Id header ({header!r}) and the body's session_id ({req.session_id!r}) differ; "
                "send one of them",
                param="session_id",
            )
        sid = header if header is not None else req.session_id
        if sid is not None and not 0 < len(sid) <= 256:
            raise RequestError("X-Session-Id must be 1 to 256 characters", param="session_id")
        return sid

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        req, prompt_ids = await self._off_loop(self._prepare, await self._body(request), chat)
        sid = self._session(request, req)
        self._check_length(len(prompt_ids), chat)
        params = self._params(req, len(prompt_ids), sid)
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
        stops = stop_ids_of(self.tokenizer, params)
        choices = [
            choice(self.tokenizer, i, c, stops, chat, req.logprobs, req.tool_choice, self.tool_parse)
            for i, c in enumerate(result.completions)
        ]  # after the trace is recorded: a ToolCallError (422) keeps the call's exact tokens traced
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
        if req.stream:
            return await stream(request, payload, chat, headers)
        return web.json_response(payload, headers=headers)

    def app(self) -> web.Application:
        """The aiohttp application (routes in the module doc)."""

        def guarded(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
            async def run(request: web.Request) -> web.StreamResponse:
                try:
                    return await handler(request)
                except RequestError as e:
                    return web.json_response(e.payload(), status=e.status)
                except ToolCallError as e:  # the model's output, not the request: the call stays traced
                    error = {"message": str(e), "type": "tool_call_error", "param": None, "code": None}
                    return web.json_response({"error": error}, status=422)
                except web.HTTPRequestEntityTooLarge:
                    return self._too_large()
                except web.HTTPException as e:
                    return web.json_response(
                        RequestError(e.text or e.reason, status=e.status).payload(), status=e.status
                    )
                except Exception as e:  # a bug or an engine failure: JSON, never a plain-text page
                    logger.exception("request %s %s failed", request.method, request.path)
                    error = RequestError(f"internal error: {type(e).__name__}: {e}", status=500)
                    return web.json_response(error.payload(), status=500)

            return run

        async def chat(request: web.Request) -> web.StreamResponse:
            return await self._generate(request, chat=True)

        async def completions(request: web.Request) -> web.StreamResponse:
            return await self._generate(request, chat=False)

        app = web.Application(client_max_size=self.max_request_bytes)
        app.router.add_post("/v1/chat/completions", guarded(chat))
        app.router.add_post("/v1/completions", guarded(completions))
        app.router.add_get("/v1/models", guarded(self._models))
        app.router.add_post("/tokenize", guarded(self._tokenize))
        app.router.add_post("/detokenize", guarded(self._detokenize))
        app.router.add_get("/v1/traces/{session}", guarded(self._trace))
        app.router.add_delete("/v1/traces/{session}", guarded(self._trace))
        app.router.add_get("/health", guarded(self._health))
        return app

    def _too_large(self) -> web.Response:
        error = RequestError(
            f"request body over {self.max_request_bytes} bytes (relayrl serve --max_request_mb)",
            status=413,
            code="request_too_large",
        )
        return web.json_response(error.payload(), status=413)

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, _: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "relayrl"}
        if self.max_total_len:
            model["max_model_len"] = self.max_total_len
        return web.json_response({"object": "list", "data": [model]})

    def _tokenize_body(self, raw: bytes) -> list[int]:
        body = parse_json(raw)
        unknown = sorted(
            set(body) - {"prompt", "messages", "model", "tools", "chat_template_kwargs", "chat_template"}
        )
        if unknown:
            raise RequestError(f"unknown field '{unknown[0]}'", param=unknown[0])
        if "messages" in body:
            kwargs, template = template_options(body, self.allow_client_chat_template)
            return self._render(parse_messages(body["messages"]), body.get("tools"), kwargs, template)
        prompt = parse_prompt(body.get("prompt"), self.vocab_size)
        return self._encode(prompt) if isinstance(prompt, str) else prompt

    async def _tokenize(self, request: web.Request) -> web.Response:
        ids = await self._off_loop(self._tokenize_body, await self._body(request))
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": self.max_total_len})

    async def _detokenize(self, request: web.Request) -> web.Response:
        tokens = (await self._off_loop(parse_json, await self._body(request))).get("tokens")
        if not isinstance(tokens, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in tokens
        ):
            raise RequestError(
                f"'tokens' must be a list of token ids in [0, {self.vocab_size})", param="tokens"
            )
        return web.json_response({"prompt": await self._off_loop(self.tokenizer.decode, tokens)})

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
