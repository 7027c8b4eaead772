"""The async front and the driver shared by the in-process engines (native, hf, vllm).

`generate` (async, on the caller's event loop) validates the request, wraps it in a `Pending` with a
`concurrent.futures.Future` and puts it in an inbox; a driver runs the engine's rounds (`_step(new_items)`)
and resolves the futures. Two drivers (`driver=`):

    thread  one driver thread, so the event loop stays responsive while a GPU works (CUDA's default)
    loop    each event loop with requests in flight runs a driver task that does rounds on the loop's own
            thread, yielding to the loop between rounds (CPU's default: the compute is the host's, and a
            second thread would bring a second OpenMP pool; with more pool threads than cores libgomp stops
            spinning between parallel regions, so every small op of both the engine and the trainer pays a
            thread wake-up; measured +30% per decode step on 2 cores). Drivers of several loops take turns
            (round lock), so a loop that blocks cannot starve another's requests.

    caller ──generate()──> inbox ──driver──> engine._step(new) ──> Pending.finish(result)
                                              (admits, decodes, retires; repeats while _busy())

A subclass implements five hooks:
    _step(new)          take ownership of newly submitted `Pending`s and make progress on all of them
    _busy()             True while it still holds unfinished work (the driver keeps calling `_step([])`)
    _abort_inflight()   finish every held `Pending` with ABORT (sleep / close)
    _release()          free generation memory (sleep);  _reacquire(): allocate it again (wake_up)
    _load(named)        copy named tensors into the model in place (load_weights)
  and may implement _version_changed() (the weight version moved; per-token version bookkeeping).

Errors inside a round are not swallowed: every held request's future gets the exception, so callers see
it instead of hanging. Cancelling the awaiting task marks the request; engines drop it at their next
sync point. Thread safety: the model and caches are only touched inside a round or while the round lock is
held (sleep, wake_up, load_weights and close take it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from relayrl.rollout.base import (
    Completion,
    EngineCapabilities,
    EngineSettings,
    FinishReason,
    GenerationRequest,
    GenerationResult,
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True, eq=False)
class Pending:
    """A submitted request and the future its caller awaits."""

    request: GenerationRequest
    """The request as given."""
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    """Resolved with a `GenerationResult` (or an exception) by the driver."""
    loop: asyncio.AbstractEventLoop | None = None
    """The caller's event loop (the loop driver runs a driver task there)."""

    @property
    def cancelled(self) -> bool:
        """True once the caller stopped waiting (task cancelled)."""
        return self.future.cancelled()

    def finish(self, completions: list[Completion]) -> None:
        """Resolve with these completions (ignored if the caller already cancelled)."""
        result = GenerationResult(
            request_id=self.request.request_id,
            prompt_ids=list(self.request.prompt_ids),
            completions=completions,
        )
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, exc: BaseException) -> None:
        """Resolve with an exception (ignored if already done)."""
        if not self.future.done():
            self.future.set_exception(exc)

    def abort(self) -> None:
        """Resolve with n empty ABORT completions."""
        n = self.request.params.n
        self.finish([Completion(token_ids=[], logprobs=[], finish_reason=FinishReason.ABORT)] * n)


DRIVERS = ("thread", "loop")


def default_driver(device: torch.device | str) -> str:
    """The default driver for engines on `device`: a thread on CUDA (the host and the event loop overlap the
    GPU's work), the callers' event loops elsewhere (see module doc)."""
    return "thread" if torch.device(device).type == "cuda" else "loop"


class ThreadedEngine(ABC):
    """Async `RolloutEngine` front + a driver (a thread, or the callers' event loops); subclasses implement
    the round hooks. Every such engine is `Pausable` (rollout/base.py)."""

    capabilities: ClassVar[EngineCapabilities] = EngineCapabilities()
    """What the engine class declares (rollout/base.py); subclasses override."""

    @classmethod
    def options(cls, settings: EngineSettings) -> dict[str, Any]:
        """Constructor keywords for the factory's `settings` (rollout/build.py): the length limit when set;
        subclasses add their own."""
        return {} if settings.max_seq_len is None else {"max_seq_len": settings.max_seq_len}

    def __init__(self, *, name: str, driver: str = "thread") -> None:
        if driver not in DRIVERS:
            raise ValueError(f"{name} engine: driver must be one of {DRIVERS}, got {driver!r}")
        self._name = name
        self._driver = driver
        self._cond = threading.Condition()
        self._round_lock = threading.RLock()
        self._inbox: list[Pending] = []
        self._paused = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loops: set[asyncio.AbstractEventLoop] = set()  # loop driver: loops running a driver task
        self._tasks: set[asyncio.Task] = set()  # strong references (the loop keeps only weak ones)
        self.version = 0
        """Weight version generating now (see `load_weights`); stamped on every token (Completion.versions)."""

    # ---- protocol -------------------------------------------------------------------------------------
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Complete one request (n samples); many calls may be in flight at once."""
        self._validate(request)
        pending = Pending(request=request, loop=asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name} engine is closed; build a new one to generate")
            self._inbox.append(pending)
            if self._driver == "thread":
                self._ensure_thread()
                self._cond.notify_all()
            else:
                self._start_loop_driver(pending.loop)
        return await asyncio.wrap_future(pending.future)

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None, *, version: int | None = None
    ) -> None:
        """Copy `named_tensors` into the model in place (`None`: the shared weights changed in place) and set
        `self.version` (to `version`, else + 1). Between two rounds: in-flight requests pause meanwhile and go
        on under the new weights (partial rollout), their later tokens tagged with the new version."""
        with self._round_lock:
            self._load(named_tensors)
            self.version = self.version + 1 if version is None else int(version)
            self._version_changed()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No round runs inside this block (the caller may change what the engine reads, e.g. copy new weights
        into its buffers, then call `load_weights`); requests submitted meanwhile wait."""
        with self._round_lock:
            yield

    def sleep(self) -> None:
        """Abort in-flight requests and free generation memory; new requests wait until `wake_up`."""
        with self._cond:
            self._paused = True
        with self._round_lock:
            self._abort_inflight()
            self._release()

    def wake_up(self) -> None:
        """Re-allocate what `sleep` freed and resume serving queued requests."""
        with self._round_lock:
            self._reacquire()
        with self._cond:
            self._paused = False
            self._cond.notify_all()
            if self._driver == "loop":
                for loop in {p.loop for p in self._inbox}:
                    self._start_loop_driver(loop)

    def close(self) -> None:
        """Stop the driver; queued and in-flight requests finish with ABORT."""
        with self._cond:
            self._closed = True
            inbox, self._inbox = self._inbox, []
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._round_lock:
            for p in inbox:
                p.abort()
            self._abort_inflight()
            self._release()

    # ---- hooks ----------------------------------------------------------------------------------------
    def _validate(self, request: GenerationRequest) -> None:
        """Raise a ValueError naming the field when the request cannot be served."""
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r}: prompt_ids is empty; give at least one token")

    @abstractmethod
    def _step(self, new: list[Pending]) -> None: ...

    @abstractmethod
    def _busy(self) -> bool: ...

    @abstractmethod
    def _abort_inflight(self) -> None: ...

    def _release(self) -> None:  # noqa: B027 (optional hook)
        """Free generation memory (default: nothing held)."""

    def _reacquire(self) -> None:  # noqa: B027 (optional hook)
        """Allocate what `_release` freed (default: nothing)."""

    @abstractmethod
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> None: ...

    def _version_changed(self) -> None:  # noqa: B027 (optional hook)
        """`self.version` just changed, between rounds (engines that track per-token versions note it)."""

    # ---- drivers -------------------------------------------------------------------------------------
    def _run_round(self, new: list[Pending]) -> None:
        """One `_step` under the round lock; an error fails the round's and every held request."""
        with self._round_lock, torch.no_grad():
            try:
                self._step(new)
            except Exception as exc:  # every waiting caller gets the error instead of hanging
                log.exception("%s engine round failed; failing its in-flight requests", self._name)
                for p in new:
                    p.fail(exc)
                self._fail_inflight(exc)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=self._run,
                args=(torch.get_num_threads(),),
                name=f"relayrl-{self._name}-engine",
                daemon=True,
            )
            self._thread.start()

    def _run(self, num_threads: int) -> None:
        # A new thread's OpenMP/MKL pools start from OMP_NUM_THREADS (default: every core), not from the
        # caller's torch.set_num_threads: adopt the caller's count (on a busy CPU, extra threads stall).
        torch.set_num_threads(num_threads)
        while True:
            with self._cond:
                idle = not self._busy()
                while not self._closed and (self._paused or (not self._inbox and not self._busy())):
                    self._cond.wait()
                if self._closed:
                    return
                if idle:
                    self._coalesce()
                new, self._inbox = self._inbox, []
            self._run_round(new)

    def _start_loop_driver(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Loop driver: start a driver task on `loop` unless it runs one (called with `_cond` held)."""
        if loop is None or loop in self._loops or loop.is_closed() or self._paused or self._closed:
            return
        self._loops.add(loop)

        def start() -> None:
            task = loop.create_task(self._drive(loop))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                start()
            else:
                loop.call_soon_threadsafe(start)
        except RuntimeError:  # the loop closed meanwhile: its callers are gone
            self._loops.discard(loop)

    async def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        """Loop driver: rounds on this loop while the engine has work, yielding to the loop between them."""
        try:
            seen = -1
            for _ in range(8):  # coalesce: let a burst of generate calls on this loop all submit
                if len(self._inbox) == seen:
                    break
                seen = len(self._inbox)
                await asyncio.sleep(0)
            while True:
                with self._cond:
                    if self._closed or self._paused or not (self._inbox or self._busy()):
                        self._loops.discard(loop)
                        return
                    new, self._inbox = self._inbox, []
                self._run_round(new)
                await asyncio.sleep(0)
        finally:  # cancelled (the loop shuts down) or done
            with self._cond:
                self._loops.discard(loop)

    def _coalesce(self, quiet_s: float = 0.002, max_s: float = 0.05) -> None:
        """After idling, wait until submissions pause (quiet_s without a new one, at most max_s), so a
        burst of `generate` calls (e.g. `generate_all`) starts as one batch instead of a lone first request
        followed by the rest. Called with `_cond` held; waiting releases it."""
        deadline = time.monotonic() + max_s
        seen = -1
        while len(self._inbox) != seen and time.monotonic() < deadline and not self._closed:
            seen = len(self._inbox)
            self._cond.wait(quiet_s)

    def _fail_inflight(self, exc: BaseException) -> None:
        """Fail every held request (after an error in a round). Default: abort them."""
        self._abort_inflight()


def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors into `model`'s parameters/buffers of the same name, in place; returns how many.

    Names may carry or omit a leading "module." (DDP/FSDP wrappers). Unknown names raise a KeyError that
    lists a few valid ones.
    """
    targets: dict[str, torch.Tensor] = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    count = 0
    with torch.no_grad():
        for name, tensor in named_tensors:
            key = name.removeprefix("module.")
            if key not in targets:
                known = ", ".join(list(targets)[:5])
                raise KeyError(f"load_weights: no parameter named {name!r} in the model (e.g. {known}, ...)")
            targets[key].copy_(tensor)
            count += 1
    return count
