"""`relayrl serve-rm`: a reward model (or a reward_func file) served over HTTP, OpenRLHF's JSON protocol.

    POST /get_reward  {"query": [B] str, "prompts": [B] str (optional), "labels": [B] (optional)}
                   -> {"rewards": [B] float, "scores": [B] float, "extra_logs": {...}}
    GET  /health   -> {"status": "ok"}

    relayrl serve-rm --model path/to/rm --port 5000          # AutoModelForSequenceClassification, num_labels=1
    relayrl serve-rm --reward-func examples/reward_func.py    # any reward_func(queries, prompts, labels)

Clients: `RemoteRewardSource` (relayrl/agents/rewards/remote.py) or OpenRLHF's `--remote_rm_url`.
Binds 127.0.0.1 unless `--host` says otherwise. Requests are scored one batch at a time (a lock around the
model) on a worker thread, so the server keeps answering /health while it scores. A bad request gets
HTTP 400 naming the problem; a scorer that raises gets HTTP 500 with the error text.

In Python (tests, embedding): `app = build_rm_app(scorer)`; `runner, port = await start_app(app)`
(relayrl.agents.http).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from relayrl.agents.rewards.base import parse_reward_output
from relayrl.agents.rewards.local_rm import LocalRewardModel

logger = logging.getLogger("relayrl.serve_rm")

Scorer = Callable[[list[str], list[str] | None, list[Any] | None], Any]
"""(queries, prompts, labels) -> {"rewards": [B], ...} or a plain [B] list / tensor."""


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def _normalise(out: Any, n: int) -> dict[str, Any]:
    parse_reward_output(out, n)  # raises (-> HTTP 500) on a wrong length / shape
    out = _jsonable(out)
    if not isinstance(out, dict):
        out = {"rewards": out}
    out.setdefault("scores", out["rewards"])
    out.setdefault("extra_logs", {})
    return out


def _bad_request(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


def build_rm_app(scorer: Scorer) -> web.Application:
    """An aiohttp app serving `scorer` on POST /get_reward (see module doc)."""
    lock = asyncio.Lock()

    async def get_reward(request: web.Request) -> web.Response:
        try:
            data = await request.json()
        except ValueError:
            return _bad_request("body must be JSON: {'query': [str, ...], 'prompts': [...], 'labels': [...]}")
        queries = data.get("query") if isinstance(data, dict) else None
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            return _bad_request("'query' must be a list of strings (prompt + response texts)")
        prompts, labels = data.get("prompts"), data.get("labels")
        for name, value in (("prompts", prompts), ("labels", labels)):
            if value is not None and (not isinstance(value, list) or len(value) != len(queries)):
                return _bad_request(f"'{name}' must be a list of {len(queries)} entries, like 'query'")
        try:
            async with lock:
                out = await asyncio.to_thread(scorer, queries, prompts, labels)
            return web.json_response(_normalise(out, len(queries)))
        except Exception as e:
            logger.exception("reward scorer failed on a batch of %d", len(queries))
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application(client_max_size=256 * 1024**2)
    app.router.add_post("/get_reward", get_reward)
    app.router.add_get("/health", health)
    return app


def model_scorer(rm: LocalRewardModel) -> Scorer:
    """Scorer over a `LocalRewardModel`: scores the query texts."""

    def score(queries: list[str], prompts: list[str] | None, labels: list[Any] | None) -> dict[str, Any]:
        rewards = rm.score_texts(queries)
        return {"rewards": rewards, "scores": rewards}

    return score
