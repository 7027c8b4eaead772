"""`relayrl serve-rm`: a reward model (or a reward_func file) served over HTTP, OpenRLHF's JSON protocol.

    POST /get_reward  {"query": [B] str, "prompts": [B] str (optional), "labels": [B] (optional)}
                   -> {"rewards": [B] float, "scores": [B] float, "extra_logs": {...}}
    GET  /health   -> {"status": "ok"}

    relayrl serve-rm --model path/to/rm --port 5000          # AutoModelForSequenceClassification, num_labels=1
    relayrl serve-rm --reward-func examples/reward_func.py    # any reward_func(queries, prompts, labels)

Clients: `RemoteRewardSource` (relayrl/agents/rewards/remote.py) or OpenRLHF's `--remote_rm_url`.
Binds 127.0.0.1 unless `--host` says otherwise. Each call runs on its own thread, off the event loop, at
most `max_concurrency` at once (a reward model: 1, one batch at a time), so the server keeps answering
/health and a slow call does not hold up the others. A call still scoring after `timeout` seconds is
answered HTTP 504 naming the limit (its thread is left to finish: Python cannot stop it; it keeps its slot
until then, so a scorer that hangs on every call ends with every slot taken and every request answered 504,
never a hung server). A bad request gets HTTP 400 naming the problem; a scorer that raises (or calls
sys.exit) gets HTTP 500 with the error text.

In Python (tests, embedding): `app = build_rm_app(scorer, timeout=120, max_concurrency=8)`;
`runner, port = await start_app(app)` (relayrl.agents.http).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from relayrl.agents.rewards.base import parse_reward_output
from relayrl.agents.rewards.local_rm import LocalRewardModel
from relayrl.agents.user_code import run_in_thread

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


class RewardTimeout(Exception):
    """A reward call that did not finish within the server's timeout (answered 504)."""


class _Calls:
    """Scorer calls on their own threads (user_code.run_in_thread): at most `limit` at once, each awaited for
    at most `timeout` s. A slot is freed when its call returns, not when it times out."""

    def __init__(self, scorer: Scorer, timeout: float, limit: int) -> None:
        self.scorer, self.timeout = scorer, timeout
        self.slots = threading.BoundedSemaphore(limit)

    def _call(self, *args: Any) -> Any:
        try:
            return self.scorer(*args)
        except SystemExit as e:  # a reward file calling sys.exit must not stop the server
            raise RuntimeError(f"the reward function called sys.exit({e.code!r})") from None
        finally:
            self.slots.release()

    async def __call__(self, *args: Any) -> Any:
        deadline = time.monotonic() + self.timeout
        while not self.slots.acquire(blocking=False):  # every slot busy: wait (within the timeout)
            if time.monotonic() >= deadline:
                raise RewardTimeout(
                    f"no free reward slot within {self.timeout:g}s: all calls are still scoring "
                    "(serve-rm --max_concurrency, --timeout)"
                )
            await asyncio.sleep(0.01)
        try:
            return await run_in_thread(self._call, *args, timeout=max(deadline - time.monotonic(), 0.0))
        except TimeoutError:
            raise RewardTimeout(
                f"the reward function did not finish within {self.timeout:g}s (serve-rm --timeout); its call "
                "goes on in the background and the batch is not scored"
            ) from None


def build_rm_app(scorer: Scorer, *, timeout: float = 120.0, max_concurrency: int = 8) -> web.Application:
    """An aiohttp app serving `scorer` on POST /get_reward (see module doc): each call on its own thread, at
    most `max_concurrency` at once, answered 504 after `timeout` seconds."""
    calls = _Calls(scorer, timeout, max_concurrency)

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
            out = await calls(queries, prompts, labels)
            return web.json_response(_normalise(out, len(queries)))
        except RewardTimeout as e:
            logger.warning("reward call on a batch of %d: %s", len(queries), e)
            return web.json_response({"error": str(e)}, status=504)
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
