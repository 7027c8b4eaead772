"""A Python `reward_func(queries, prompts, labels, **kwargs)` loaded from a file (OpenRLHF's contract).

    queries  [B] str   prompt + response text (see `base.queries_of`)
    prompts  [B] str   prompt text
    labels   [B]       the samples' labels
    kwargs             passed only if the function accepts them (by name or **kwargs):
                       responses [B] str (response text only), datasources [B] str,
                       images [B] list of PIL images (a vision-language sample's prompt and environment
                       images, in order; [] for text), image_paths [B] list of str (where each came from)

It returns {"rewards": [B], "scores": [B], "extra_logs": {...}} or a plain [B] list / tensor. It is called on
batches of `batch_size` trajectories, on a daemon thread (never on the event loop), each call bounded by
`timeout` seconds; an `async def reward_func` is awaited on the event loop instead (same timeout). A function
that raises is a failed sample (counted, logged); one that calls `sys.exit()` is an error of the run naming the
file and the exit code (`UserCodeExit`, relayrl.agents.user_code).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relayrl.agents.base import Trajectory
from relayrl.agents.failures import FailureLog, ScalarError
from relayrl.agents.rewards.base import (
    chunks,
    fail_all,
    fill,
    parse_reward_output,
    pending,
    queries_of,
)
from relayrl.agents.user_code import UserCodeExit, guard_exit, load_module_from_file, run_in_thread

EXTRA_KWARGS = ("responses", "datasources", "images", "image_paths")


def load_reward_func(path: str | Path, name: str = "reward_func") -> Callable[..., Any]:
    """The function `name` from a Python file; errors name the file."""
    module = load_module_from_file(path, "reward")
    func = getattr(module, name, None)
    if not callable(func):
        raise AttributeError(f"{path} has no function `{name}(queries, prompts, labels, **kwargs)`")
    return guard_exit(func, f"{name} in reward file {str(path)!r}")  # sys.exit() in it: UserCodeExit


def _accepted_kwargs(func: Callable[..., Any]) -> set[str]:
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return set()
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return set(EXTRA_KWARGS)
    return {p.name for p in params} & set(EXTRA_KWARGS)


class RewardFuncSource:
    """Scores trajectories with a user reward function (see module doc)."""

    def __init__(
        self,
        func: Callable[..., Any] | str | Path,
        *,
        tokenizer: Any = None,
        timeout: float | None = 60.0,
        batch_size: int | None = None,
        log: FailureLog | None = None,
    ) -> None:
        """`tokenizer`: when given, queries are the decode of all token ids (OpenRLHF); `batch_size`: most
        trajectories per call (None: one call per `score`); batches run concurrently."""
        self.func = load_reward_func(func) if isinstance(func, str | Path) else guard_exit(func)
        self.name = f"reward_func {getattr(self.func, '__module__', '')}.{getattr(self.func, '__name__', '')}"
        self.tokenizer, self.timeout, self.batch_size, self.log = tokenizer, timeout, batch_size, log
        self._kwargs = _accepted_kwargs(self.func)

    async def score(self, trajs: list[Trajectory]) -> None:
        await asyncio.gather(*(self._score_chunk(c) for c in chunks(pending(trajs), self.batch_size)))

    async def _score_chunk(self, chunk: list[Trajectory]) -> None:
        kwargs: dict[str, Any] = {}
        if "responses" in self._kwargs:
            kwargs["responses"] = [t.response_text for t in chunk]
        if "datasources" in self._kwargs:
            kwargs["datasources"] = [t.sample.datasource for t in chunk]
        if "images" in self._kwargs:
            kwargs["images"] = [list(t.images.images) if t.images is not None else [] for t in chunk]
        if "image_paths" in self._kwargs:
            kwargs["image_paths"] = [list(t.images.sources) if t.images is not None else [] for t in chunk]
        queries = queries_of(chunk, self.tokenizer)
        prompts = [t.sample.prompt for t in chunk]
        labels = [t.sample.label for t in chunk]
        try:
            if inspect.iscoroutinefunction(self.func):  # an `async def reward_func` runs on the event loop
                out = await asyncio.wait_for(self.func(queries, prompts, labels, **kwargs), self.timeout)
            else:
                out = await run_in_thread(self.func, queries, prompts, labels, timeout=self.timeout, **kwargs)
            batch = parse_reward_output(out, len(chunk))
        except TimeoutError:
            return fail_all(chunk, "timeout", f"no result within {self.timeout}s", self.name, self.log)
        except ScalarError as e:
            return fail_all(chunk, e.kind, str(e), self.name, self.log)
        except UserCodeExit:
            raise  # the file called sys.exit(): an error of the run, not a failed sample (relayrl.agents.user_code)
        except Exception as e:
            return fail_all(chunk, "exception", f"raised {type(e).__name__}: {e}", self.name, self.log)
        fill(chunk, batch, self.name, self.log)
