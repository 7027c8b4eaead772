"""The driver shared by the in-process engines (relayrl.rollout.driver), on a fake engine whose round answers
every new request at once: both drivers deliver results, a burst on one loop is one round, a failing round
fails its callers, sleep / wake_up / close / load_weights keep their contracts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
import torch

from relayrl.rollout.base import Completion, FinishReason, GenerationRequest, SamplingParams
from relayrl.rollout.driver import Pending, ThreadedEngine, default_driver, load_named_tensors


class Echo(ThreadedEngine):
    """Answers each request in the round that receives it: n completions of the prompt reversed."""

    def __init__(self, driver: str, *, fail_with: Exception | None = None) -> None:
        super().__init__(name="echo", driver=driver)
        self.rounds: list[list[str]] = []
        self.calls: list[str] = []
        self.fail_with = fail_with

    def _step(self, new: list[Pending]) -> None:
        self.rounds.append([p.request.request_id for p in new])
        if self.fail_with is not None:
            raise self.fail_with
        for p in new:
            tokens = list(reversed(p.request.prompt_ids))
            done = Completion(token_ids=tokens, logprobs=[0.0] * len(tokens), finish_reason=FinishReason.STOP)
            p.finish([done] * p.request.params.n)

    def _busy(self) -> bool:
        return False

    def _abort_inflight(self) -> None:
        self.calls.append("abort")

    def _release(self) -> None:
        self.calls.append("release")

    def _reacquire(self) -> None:
        self.calls.append("reacquire")

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        self.calls.append(f"load {None if named_tensors is None else len(list(named_tensors))}")

    def _version_changed(self) -> None:
        self.calls.append(f"version {self.version}")


def _request(i: int, n: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt_ids=[i, i + 1, i + 2], params=SamplingParams(n=n), request_id=f"r{i}")


def test_the_default_driver_is_a_thread_on_cuda_and_the_event_loop_elsewhere():
    assert default_driver("cuda:0") == "thread" and default_driver(torch.device("cpu")) == "loop"
    with pytest.raises(ValueError, match="echo engine: driver must be one of"):
        Echo("fiber")


@pytest.mark.parametrize("driver", ["loop", "thread"])
def test_every_caller_gets_its_own_result(driver):
    engine = Echo(driver)

    async def main():
        return await asyncio.gather(*(engine.generate(_request(i, n=i + 1)) for i in range(4)))

    try:
        results = asyncio.run(main())
    finally:
        engine.close()
    for i, res in enumerate(results):
        assert res.request_id == f"r{i}" and res.prompt_ids == [i, i + 1, i + 2]
        assert [c.token_ids for c in res.completions] == [[i + 2, i + 1, i]] * (i + 1)
    assert sorted(r for rnd in engine.rounds for r in rnd) == ["r0", "r1", "r2", "r3"]  # each served once


def test_a_burst_on_one_loop_starts_as_one_round():
    engine = Echo("loop")

    async def main():
        await asyncio.gather(*(engine.generate(_request(i)) for i in range(5)))

    asyncio.run(main())
    assert engine.rounds == [["r0", "r1", "r2", "r3", "r4"]]


@pytest.mark.parametrize("driver", ["loop", "thread"])
def test_a_failing_round_fails_its_callers_and_the_held_requests(driver):
    boom = RuntimeError("kernel exploded")
    engine = Echo(driver, fail_with=boom)

    async def main():
        return await asyncio.gather(
            engine.generate(_request(0)), engine.generate(_request(1)), return_exceptions=True
        )

    try:
        results = asyncio.run(main())
    finally:
        engine.close()
    assert results == [boom, boom]
    assert "abort" in engine.calls  # _fail_inflight's default: abort what the engine holds


def test_an_empty_prompt_is_refused_before_it_is_queued():
    engine = Echo("loop")
    with pytest.raises(ValueError, match=r"request 'x': prompt_ids is empty"):
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=[], request_id="x")))
    assert engine.rounds == []


def test_requests_sent_while_asleep_wait_for_wake_up():
    engine = Echo("loop")

    async def main():
        engine.sleep()
        task = asyncio.create_task(engine.generate(_request(3)))
        for _ in range(20):
            await asyncio.sleep(0)
        assert not task.done() and engine.rounds == []
        engine.wake_up()
        return await task

    result = asyncio.run(main())
    assert result.completions[0].token_ids == [5, 4, 3]
    assert engine.calls == ["abort", "release", "reacquire"]


def test_close_aborts_queued_requests_and_refuses_new_ones():
    engine = Echo("loop")

    async def main():
        engine.sleep()  # nothing runs: the request stays queued
        task = asyncio.create_task(engine.generate(_request(0, n=2)))
        await asyncio.sleep(0)
        engine.close()
        res = await task
        with pytest.raises(RuntimeError, match="echo engine is closed"):
            await engine.generate(_request(1))
        return res

    res = asyncio.run(main())
    assert [c.finish_reason for c in res.completions] == [FinishReason.ABORT] * 2
    assert all(c.token_ids == [] for c in res.completions)


def test_load_weights_sets_the_version_between_rounds():
    engine = Echo("loop")
    engine.load_weights()
    engine.load_weights([("w", torch.zeros(1)), ("b", torch.zeros(1))], version=7)
    engine.load_weights()
    assert engine.version == 8
    assert engine.calls == ["load None", "version 1", "load 2", "version 7", "load None", "version 8"]


def test_a_pending_request_resolves_once():
    p = Pending(request=_request(0, n=3))
    p.abort()
    p.finish([Completion(token_ids=[1], logprobs=[0.0], finish_reason=FinishReason.STOP)])  # ignored: done
    p.fail(RuntimeError("late"))  # ignored too
    result = p.future.result()
    assert [c.finish_reason for c in result.completions] == [FinishReason.ABORT] * 3
    cancelled = Pending(request=_request(1))
    cancelled.future.cancel()
    assert cancelled.cancelled
    cancelled.finish([])  # the caller is gone: nothing to resolve, no error


def test_load_named_tensors_copies_in_place_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    weight = model[0].weight
    n = load_named_tensors(
        model, [("module.0.weight", torch.ones(2, 2)), ("1.running_mean", torch.full((2,), 3.0))]
    )
    assert n == 2 and model[0].weight is weight and torch.equal(weight, torch.ones(2, 2))
    assert torch.equal(model[1].running_mean, torch.full((2,), 3.0))  # buffers too
    with pytest.raises(KeyError, match=r"no parameter named 'nope' in the model \(e\.g\. 0\.weight"):
        load_named_tensors(model, [("nope", torch.zeros(1))])
