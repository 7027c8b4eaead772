"""Running user code: a user's Python file imported as a fresh module, a user callable on a daemon thread.

    module = load_module_from_file("examples/reward_func.py", "reward")    errors name the file and line
    result = await run_in_thread(fn, *args, timeout=60.0)                  TimeoutError after `timeout` s
    fn = guard_exit(fn, "reward_func")                                     sys.exit() -> UserCodeExit

User code never ends the process: a `sys.exit(...)` (SystemExit) in a user file, at import or in any call made
through these functions, becomes an error naming the file, the line and the exit code (`UserCodeExit`, or an
ImportError at import). It is fatal for a run (the callers re-raise it instead of counting a failed sample):
the file asked to stop, so the run stops with that error, never with exit code 0 and nothing written.

Both are generic (no relayrl imports): the agent loader (loader.py), the executors (user `reset` / `step`)
and the reward sources (reward_func files, a local reward model's forward) build on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import sys
import threading
import traceback
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _user_line(err: BaseException, path: Path) -> int | None:
    """The line of `path` where `err` was raised (the innermost frame in that file)."""
    target = str(path.resolve())
    lines = [
        f.lineno for f in traceback.extract_tb(err.__traceback__) if str(Path(f.filename).resolve()) == target
    ]
    return lines[-1] if lines else None


class UserCodeExit(RuntimeError):
    """User code raised SystemExit (called `sys.exit()` / `exit()`): an error of that file, never the end of
    the process (see module doc)."""


def exit_error(e: SystemExit, what: str) -> UserCodeExit:
    """The UserCodeExit for a SystemExit raised by user code `what` (e.g. "reward_func of r.py"): names the
    file and line that called sys.exit (the innermost frame) and the exit code."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}, line {frames[-1].lineno}" if frames else ""
    return UserCodeExit(
        f"{what} called sys.exit({e.code!r}){where}: user code must return a value or raise an exception, "
        "not exit the process; fix the file"
    )


def describe(fn: Any) -> str:
    """'name (file)' of a user callable, for error messages."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f"{name} ({code.co_filename})" if code is not None else str(name)


def guard_exit(fn: Callable[..., Any], what: str | None = None) -> Callable[..., Any]:
    """`fn` (sync or `async def`) with a SystemExit it raises turned into `UserCodeExit` (naming `what`,
    default `describe(fn)`); signature and async-ness kept (`inspect.signature` / `iscoroutinefunction` see
    through it)."""
    label = what or describe(fn)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def guarded_async(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except SystemExit as e:
                raise exit_error(e, label) from None

        return guarded_async

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            raise exit_error(e, label) from None

    return guarded


async def await_user(awaitable: Any, what: str) -> Any:
    """`await awaitable` (a coroutine of user code) with a SystemExit turned into `UserCodeExit`."""
    try:
        return await awaitable
    except SystemExit as e:
        raise exit_error(e, what) from None


def load_module_from_file(path: str | Path, prefix: str) -> types.ModuleType:
    """Import a user's Python file as a fresh module; errors name the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{prefix} file {str(path)!r} does not exist")
    name = f"relayrl_user_{prefix}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {str(path)!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:  # sys.exit() at module level: an error of the file, not the end of the process
        del sys.modules[name]
        line = _user_line(e, path)
        raise ImportError(
            f"cannot load {prefix} file {str(path)!r}: it called sys.exit({e.code!r}) while being imported"
            f"{f' (line {line})' if line else ''}; a {prefix} file must only define functions / classes"
        ) from None
    except Exception as e:  # SyntaxError, a failing import, a raise at module level: name the file
        del sys.modules[name]
        line = e.lineno if isinstance(e, SyntaxError) else _user_line(e, path)
        where = f" (line {line})" if line else ""
        raise ImportError(
            f"cannot load {prefix} file {str(path)!r}{where}: {type(e).__name__}: {e}; fix the file "
            "(try `python FILE` to see the full traceback)"
        ) from e
    return module


async def run_in_thread(fn: Callable[..., Any], *args: Any, timeout: float | None, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on a daemon thread, awaited with a timeout (TimeoutError).

    A thread cannot be killed: on timeout it runs on in the background, but as a daemon it never blocks
    the event loop, the next batch or interpreter exit (asyncio.to_thread's pool would wait for it)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def _settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def _run() -> None:
        try:
            result, ok = fn(*args, **kwargs), True
        except SystemExit as e:  # never re-raised on the event loop, where it would end the process
            result, ok = exit_error(e, describe(fn)), False
        except BaseException as e:
            result, ok = e, False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_settle, ok, result)

    threading.Thread(target=_run, daemon=True, name=f"reward-{getattr(fn, '__name__', 'fn')}").start()
    return await asyncio.wait_for(fut, timeout)
