"""Remote reward models over real HTTP on 127.0.0.1: load spread, failover, retries, timeouts, serve-rm."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections import Counter

import pytest

from relayrl.agents.base import PromptSample, Trajectory, TrajectoryStatus
from relayrl.agents.failures import FailureLog
from relayrl.agents.remote_rm import build_rm_app, start_app
from relayrl.agents.rewards import LocalRewardModel, RemoteRewardSource


def _trajs(n: int) -> list[Trajectory]:
    out = []
    for i in range(n):
        s = PromptSample(index=i, prompt=f"q{i}=", prompt_ids=[5, 6], label=str(i))
        out.append(
            Trajectory(
                sample=s,
                token_ids=[5, 6, 7],
                action_mask=[False, False, True],
                rollout_logprobs=[0.0, 0.0, -1.0],
                response_text=str(i % 3),
            )
        )
    return out


def _scorer(name: str, hits: Counter, delay: float = 0.0):
    def score(queries, prompts, labels):
        hits[name] += 1
        time.sleep(delay)
        # reward 1 when the response (after '=') equals the label
        return {
            "rewards": [float(q.split("=")[1] == lab) for q, lab in zip(queries, labels, strict=True)],
            "extra_logs": {"server": 1.0 if name == "a" else 2.0},
        }

    return score


async def _serve(*apps):
    runners, urls = [], []
    for app in apps:
        runner, port = await start_app(app)
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}/get_reward")
    return runners, urls


def test_load_spread_over_two_urls():
    hits: Counter = Counter()

    async def run():
        runners, urls = await _serve(
            build_rm_app(_scorer("a", hits, 0.05)), build_rm_app(_scorer("b", hits, 0.05))
        )
        try:
            source = RemoteRewardSource(urls, batch_size=2, max_concurrency=4)
            trajs = _trajs(8)
            await source.score(trajs)
            return source, trajs
        finally:
            for r in runners:
                await r.cleanup()

    source, trajs = asyncio.run(run())
    assert hits == {"a": 2, "b": 2}  # 4 batches of 2 over 2 servers
    assert sorted(source.requests.values()) == [2, 2]
    assert [t.reward for t in trajs] == [float(str(i % 3) == str(i)) for i in range(8)]
    assert {t.extra_logs["server"] for t in trajs} == {1.0, 2.0}


def test_failover_when_one_server_is_down(free_port):
    hits: Counter = Counter()
    down = f"http://127.0.0.1:{free_port()}/get_reward"

    async def run():
        runners, urls = await _serve(build_rm_app(_scorer("a", hits)))
        try:
            source = RemoteRewardSource([down, urls[0]], batch_size=1, retries=2, backoff=0.01)
            trajs = _trajs(4)
            await source.score(trajs)
            return source, trajs
        finally:
            await runners[0].cleanup()

    source, trajs = asyncio.run(run())
    assert all(t.status == TrajectoryStatus.OK for t in trajs) and hits["a"] == 4
    assert source.errors[down] >= 1 and source.errors[down] == source.requests[down]


def test_server_down_clear_error_after_retries(free_port):
    url = f"http://127.0.0.1:{free_port()}/get_reward"
    log = FailureLog()
    source = RemoteRewardSource(url, retries=2, backoff=0.05, log=log)
    trajs = _trajs(2)
    start = time.perf_counter()
    asyncio.run(source.score(trajs))
    elapsed = time.perf_counter() - start
    assert 0.15 <= elapsed < 3.0  # backoff 0.05 + 0.1, then give up
    assert source.requests[url] == 3
    for t in trajs:
        assert t.status == TrajectoryStatus.FAILED and t.failure_kind == "remote_error"
        assert f"failed after 3 attempts: {url}: ClientConnectorError" in t.error
    assert log.counts == {"remote_error": 2}


def test_slow_server_times_out_bounded():
    hits: Counter = Counter()

    async def run():
        runners, urls = await _serve(build_rm_app(_scorer("slow", hits, delay=0.6)))
        try:
            source = RemoteRewardSource(urls, timeout=0.2, retries=1, backoff=0.05)
            trajs = _trajs(2)
            start = time.perf_counter()
            await source.score(trajs)
            return trajs, time.perf_counter() - start, urls[0]
        finally:
            await runners[0].cleanup()

    trajs, elapsed, url = asyncio.run(run())
    assert elapsed < 0.55  # 2 attempts x 0.2 s + 0.05 s backoff, not the server's 2 x 0.6 s
    assert all(t.failure_kind == "timeout" and f"{url}: no reply within 0.2s" in t.error for t in trajs)


def test_bad_requests_get_400():
    async def run():
        runners, urls = await _serve(build_rm_app(_scorer("a", Counter())))
        try:
            import aiohttp

            async with aiohttp.ClientSession() as s, s.post(urls[0], json={"query": "not a list"}) as r:
                return r.status, await r.json()
        finally:
            await runners[0].cleanup()

    status, body = asyncio.run(run())
    assert status == 400 and "'query' must be a list of strings" in body["error"]


def _wait_healthy(url: str, proc: subprocess.Popen, limit: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} not up after {limit}s")


def test_serve_rm_cli_round_trip(tiny_rm_path, tiny_tokenizer, free_port):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "serve-rm",
            "--model",
            str(tiny_rm_path),
            "--port",
            str(port),
            "--device",
            "cpu",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/get_reward"
    try:
        _wait_healthy(f"http://127.0.0.1:{port}/health", proc)
        source = RemoteRewardSource(url, timeout=5.0, retries=0)
        trajs = _trajs(3)
        asyncio.run(source.score(trajs))
        assert all(t.status == TrajectoryStatus.OK for t in trajs), trajs[0].error
        rm = LocalRewardModel.from_pretrained(str(tiny_rm_path), device="cpu")
        expected = rm.score_texts([t.sample.prompt + t.response_text for t in trajs])
        assert [t.reward for t in trajs] == pytest.approx(expected, abs=1e-5)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert f"listening on http://127.0.0.1:{port}/get_reward" in out
