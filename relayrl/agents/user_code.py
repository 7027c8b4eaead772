"""Running user code: a user's Python file imported as a fresh module, a user callable on a daemon thread.

    module = load_module_from_file("examples/reward_func.py", "reward")    errors name the file and line
    result = await run_in_thread(fn, *args, timeout=60.0)                  TimeoutError after `timeout` s

Both are generic (no relayrl imports): the agent loader (loader.py), the executors (user `reset` / `step`)
and the reward sources (reward_func files, a local reward model's forward) build on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
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
        except BaseException as e:
            result, ok = e, False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(_settle, ok, result)

    threading.Thread(target=_run, daemon=True, name=f"reward-{getattr(fn, '__name__', 'fn')}").start()
    return await asyncio.wait_for(fut, timeout)
