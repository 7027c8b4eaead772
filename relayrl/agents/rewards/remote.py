"""Remote reward models over HTTP, OpenRLHF's JSON: POST {"query": [B] str, "prompts": [B], "labels": [B]}
-> {"rewards": [B], "scores": [B] optional, "extra_logs": {...} optional} (or a plain [B] list).

    RemoteRewardSource(["http://h1:5000/get_reward", "http://h2:5000/get_reward"], max_concurrency=8)

A `score` call splits the trajectories into batches of `batch_size`; each batch goes to the least-busy URL
(ties broken round-robin), at most `max_concurrency` requests in flight over all URLs. A request that fails
(connection refused, HTTP 5xx / 429, a reply that is not JSON, no reply within `timeout` seconds) is retried
up to `retries` times after `backoff * 2**attempt` seconds, preferring another URL. When every attempt fails
the batch's trajectories are marked FAILED with an error naming each URL tried and what it answered; a
4xx reply or a reply of the wrong shape is not retried (it will not get better). The worst case is bounded:
(retries + 1) * timeout + backoff * (2**retries - 1) seconds per batch; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import aiohttp

from relayrl.agents.base import Trajectory
from relayrl.agents.failures import FailureLog, ScalarError
from relayrl.agents.rewards.base import chunks, fail_all, fill, parse_reward_output, pending, queries_of


class RemoteRMError(RuntimeError):
    """Every attempt of one request failed; the message names each URL and its error."""

    def __init__(self, message: str, kind: str = "remote_error") -> None:
        super().__init__(message)
        self.kind = kind


class _Retryable(Exception):
    pass


class RemoteRewardSource:
    """Scores trajectories on one or more HTTP reward servers (see module doc)."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        tokenizer: Any = None,
        timeout: float = 30.0,
        retries: int = 3,
        backoff: float = 0.5,
        max_concurrency: int = 8,
        batch_size: int = 16,
        log: FailureLog | None = None,
    ) -> None:
        self.urls = [u.strip() for u in ([urls] if isinstance(urls, str) else urls) if u.strip()]
        if not self.urls or not all(u.startswith(("http://", "https://")) for u in self.urls):
            raise ValueError(f"remote reward model urls must be http(s):// URLs, got {list(self.urls)!r}")
        if max_concurrency < 1 or retries < 0 or timeout <= 0:
            raise ValueError("need max_concurrency >= 1, retries >= 0 and timeout > 0")
        self.tokenizer, self.timeout, self.retries, self.backoff = tokenizer, timeout, retries, backoff
        self.max_concurrency, self.batch_size, self.log = max_concurrency, batch_size, log
        self.inflight: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        """Requests sent per URL (successful or not)."""
        self.errors: Counter[str] = Counter()
        """Failed attempts per URL."""
        self._rr = 0

    def check_reachable(self, timeout: float = 5.0) -> list[str]:
        """At start-up: open a TCP connection to each URL's host and port (no request is sent), so a wrong
        URL or a server that is not up fails in seconds, not after a few training steps. Raises RemoteRMError
        naming every URL when none is reachable; returns the unreachable ones otherwise (a partial outage is
        survivable: requests fail over)."""
        import socket
        from urllib.parse import urlsplit

        down = []
        for url in self.urls:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            try:
                socket.create_connection((parts.hostname, port), timeout=timeout).close()
            except OSError as e:
                down.append(f"{url} ({type(e).__name__}: {e})")
        if len(down) == len(self.urls):
            raise RemoteRMError(
                f"no remote reward server is reachable: {'; '.join(down)}. Start the server (e.g. relayrl "
                "serve-rm) or fix --reward.source",
                kind="unreachable",
            )
        return down

    async def score(self, trajs: list[Trajectory]) -> None:
        batches = chunks(pending(trajs), self.batch_size)
        if not batches:
            return
        sem = asyncio.Semaphore(self.max_concurrency)
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._score_batch(session, sem, b) for b in batches))

    async def _score_batch(self, session: aiohttp.ClientSession, sem: asyncio.Semaphore, batch: list) -> None:
        payload = {
            "query": queries_of(batch, self.tokenizer),
            "prompts": [t.sample.prompt for t in batch],
            "labels": [t.sample.label for t in batch],
        }
        try:
            out = await self.post(session, sem, payload)
            parsed = parse_reward_output(out, len(batch))
        except RemoteRMError as e:
            return fail_all(batch, e.kind, str(e), "remote RM", self.log)
        except ScalarError as e:
            return fail_all(batch, e.kind, f"reply from {self.urls}: {e}", "remote RM", self.log)
        except (TypeError, ValueError, AttributeError) as e:  # any other unusable reply: fail, don't crash
            msg = f"reply from {self.urls} is unusable: {type(e).__name__}: {e}"
            return fail_all(batch, "bad_output", msg, "remote RM", self.log)
        fill(batch, parsed, "remote RM", self.log)

    def _pick(self, avoid: str | None) -> str:
        order = self.urls[self._rr % len(self.urls) :] + self.urls[: self._rr % len(self.urls)]
        self._rr += 1
        candidates = [u for u in order if u != avoid] or order
        return min(candidates, key=lambda u: self.inflight[u])  # min keeps the first (round-robin) on ties

    async def post(self, session: aiohttp.ClientSession, sem: asyncio.Semaphore, payload: dict) -> Any:
        """POST `payload` with retries and URL failover; the decoded JSON reply, or RemoteRMError."""
        errors: list[str] = []
        last: str | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            async with sem:
                url = last = self._pick(last)
                self.inflight[url] += 1
                self.requests[url] += 1
                try:
                    return await self._post_once(session, url, payload)
                except _Retryable as e:
                    self.errors[url] += 1
                    errors.append(f"{url}: {e}")
                except RemoteRMError:
                    self.errors[url] += 1
                    raise
                finally:
                    self.inflight[url] -= 1
        kind = "timeout" if all("no reply within" in e for e in errors) else "remote_error"
        raise RemoteRMError(
            f"reward model request failed after {self.retries + 1} attempts: " + "; ".join(errors), kind
        )

    async def _post_once(self, session: aiohttp.ClientSession, url: str, payload: dict) -> Any:
        try:
            async with session.post(url, json=payload) as resp:
                text = await resp.text()
                if resp.status == 429 or resp.status >= 500:
                    raise _Retryable(f"HTTP {resp.status}: {text[:200]}")
                if resp.status >= 400:
                    raise RemoteRMError(f"{url} answered HTTP {resp.status}: {text[:300]}", "bad_output")
                return json.loads(text)
        except TimeoutError:
            raise _Retryable(f"no reply within {self.timeout}s") from None
        except aiohttp.ClientError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        except json.JSONDecodeError as e:
            raise _Retryable(f"reply is not JSON ({e})") from None
