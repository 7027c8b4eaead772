"""Remote reward models over real HTTP on 127.0.0.1: load spread, failover, retries, timeouts, serve-rm."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from relayrl.agents.base import Trajectory, TrajectoryStatus
from relayrl.agents.failures import FailureLog
from relayrl.agents.http import start_app
from relayrl.agents.remote_rm import build_rm_app
from relayrl.agents.rewards import LocalRewardModel, RemoteRewardSource
from relayrl.agents.rewards.remote import RemoteRMError
from relayrl.data.records import PromptSample


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


def test_concurrency_limit_is_honoured():
    from aiohttp import web

    state = {"now": 0, "peak": 0, "total": 0}

    async def handler(request):
        body = await request.json()
        state["now"] += 1
        state["total"] += 1
        state["peak"] = max(state["peak"], state["now"])
        for _ in range(100):  # hold the request until a second one is in flight (or 1 s passed)
            if state["now"] >= 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        state["now"] -= 1
        return web.json_response({"rewards": [1.0] * len(body["query"])})

    async def run():
        app = web.Application()
        app.router.add_post("/get_reward", handler)
        runners, urls = await _serve(app)
        try:
            trajs = _trajs(6)
            await RemoteRewardSource(urls, batch_size=1, max_concurrency=2).score(trajs)
            return trajs
        finally:
            await runners[0].cleanup()

    trajs = asyncio.run(run())
    assert all(t.reward == 1.0 for t in trajs) and state["total"] == 6
    assert state["peak"] == 2  # 6 batches, never more than max_concurrency=2 requests in flight


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
    assert 0.15 <= elapsed < 10.0  # backoff 0.05 + 0.1, then give up (the upper bound: no hang)
    assert source.requests[url] == 3
    for t in trajs:
        assert t.status == TrajectoryStatus.FAILED and t.failure_kind == "remote_error"
        assert f"failed after 3 attempts: {url}: ClientConnectorError" in t.error
    assert log.counts == {"remote_error": 2}


def test_slow_server_times_out_bounded():
    release = threading.Event()  # the server answers nothing until the client has given up

    def never(queries, prompts, labels):
        release.wait(30)
        return [0.0] * len(queries)

    async def run():
        runners, urls = await _serve(build_rm_app(never))
        try:
            source = RemoteRewardSource(urls, timeout=0.2, retries=1, backoff=0.05)
            trajs = _trajs(2)
            start = time.perf_counter()
            await source.score(trajs)
            return source, trajs, time.perf_counter() - start, urls[0]
        finally:
            release.set()
            await runners[0].cleanup()

    source, trajs, elapsed, url = asyncio.run(run())
    # 2 attempts x 0.2 s + 0.05 s backoff = 0.45 s; the bound is loose for a loaded machine, but far below
    # the 30 s the server would take: the client gives up on its own, it does not wait for the server.
    assert 0.45 <= elapsed < 10.0 and source.requests[url] == 2
    assert all(t.failure_kind == "timeout" and f"{url}: no reply within 0.2s" in t.error for t in trajs)
    assert "failed after 2 attempts" in trajs[0].error


def test_unusable_reply_fails_its_batch_without_crashing():
    from aiohttp import web

    async def handler(request):
        n = len((await request.json())["query"])
        return web.json_response({"rewards": [1.0] * n, "extra_logs": ["not", "a", "dict"]})

    async def run():
        app = web.Application()
        app.router.add_post("/get_reward", handler)
        runners, urls = await _serve(app)
        try:
            trajs, log = _trajs(2), FailureLog()
            await RemoteRewardSource(urls, retries=0, log=log).score(trajs)
            return trajs, log, urls[0]
        finally:
            await runners[0].cleanup()

    trajs, log, url = asyncio.run(run())
    assert [t.failure_kind for t in trajs] == ["bad_output"] * 2 and log.counts == {"bad_output": 2}
    assert f"reply from ['{url}']: extra_logs is list, expected a dict" in trajs[0].error


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


def test_unreachable_servers_are_found_at_start(free_port, tiny_model_path, tmp_path, capsys):
    """A wrong URL fails the run at start-up in seconds, naming the URL, instead of after a few steps."""
    from relayrl.trainers.rl.loop import main

    url = f"http://127.0.0.1:{free_port()}/get_reward"
    source = RemoteRewardSource([url], retries=0)
    start = time.perf_counter()
    with pytest.raises(
        RemoteRMError, match=rf"no remote reward server is reachable: {url} \(ConnectionRefused"
    ):
        source.check_reachable()
    assert time.perf_counter() - start < 6
    argv = ["--model.name_or_path", str(tiny_model_path), "--task.name", "add2", "--task.train_rows", "8",
            "--reward.source", url, "--train.output_dir", str(tmp_path / "run"), "--logger.progress_bar", "false"]  # fmt: skip
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "no remote reward server is reachable" in err and url in err
    assert not (tmp_path / "run/metrics.jsonl").exists()


SLOW_REWARD = """
import time

def reward_func(queries, prompts, labels):
    if queries[0] == "slow":
        time.sleep(3.0)
    return [1.0 for _ in queries]
"""


def test_serve_rm_times_out_a_slow_reward_and_keeps_answering_others(tmp_path, monkeypatch):
    """`relayrl serve-rm --reward-func F --timeout 1`: a call still scoring after 1 s is answered 504 naming
    the limit, and calls sent meanwhile are scored at once (each call on its own thread), not queued behind
    it. Timings: the slow call sleeps 3 s; the fast ones must answer within 1 s of being sent."""
    import aiohttp

    from relayrl.apps import serve_rm

    f = tmp_path / "slow_reward.py"
    f.write_text(SLOW_REWARD)
    apps = []
    monkeypatch.setattr(serve_rm.web, "run_app", lambda app, **kw: apps.append(app))
    assert serve_rm.main(["--reward-func", str(f), "--timeout", "1", "--max-concurrency", "4"]) == 0

    async def run():
        runners, urls = await _serve(apps[0])
        try:
            async with aiohttp.ClientSession() as s:

                async def post(query):
                    t = time.monotonic()
                    async with s.post(urls[0], json={"query": [query]}) as r:
                        return r.status, await r.json(), time.monotonic() - t

                slow = asyncio.create_task(post("slow"))
                await asyncio.sleep(0.2)
                fast = await asyncio.gather(*(post(f"q{i}") for i in range(3)))
                return await slow, fast
        finally:
            await runners[0].cleanup()

    (status, body, waited), fast = asyncio.run(run())
    assert [(s, b["rewards"]) for s, b, _ in fast] == [(200, [1.0])] * 3
    assert all(t < 1.0 for _, _, t in fast), [t for _, _, t in fast]
    assert status == 504 and "did not finish within 1s (serve-rm --timeout)" in body["error"]
    assert 0.9 <= waited < 2.5


def test_serve_rm_options_are_checked():
    from relayrl.config.apps import ServeRMConfig
    from relayrl.config.base import ConfigError
    from relayrl.config.command_line import parse_cli

    for flags, name in [(["--timeout", "0"], "timeout"), (["--timeout", "nan"], "timeout"),
                        (["--max_concurrency", "0"], "max_concurrency")]:  # fmt: skip
        with pytest.raises(ConfigError, match=name):
            parse_cli(ServeRMConfig, flags)
