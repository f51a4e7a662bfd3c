"""Calls into a cache's event loop from other threads, blocking the calling thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

from mmcache.errors import CacheClosedError, WrongLoopError

__all__ = ["run_threadsafe"]

T = TypeVar("T")


def run_threadsafe(
    loop: asyncio.AbstractEventLoop | None,
    closed: bool,
    coro: Coroutine[Any, Any, T],
    timeout: float | None,
) -> T:
    """Run coro on loop (the cache's, None if not started) from another thread; its result.

    Refused on the loop's own thread, where waiting for the loop would deadlock it.
    """
    if loop is None or closed:
        coro.close()
        raise CacheClosedError("start the cache on its loop before calling it from threads")
    if asyncio._get_running_loop() is loop:
        coro.close()
        raise WrongLoopError(
            "put_threadsafe()/get_threadsafe() on the cache's own loop would deadlock; "
            "await put()/get() instead"
        )
    if timeout is None:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()
    return _with_timeout(loop, coro, timeout)


def _with_timeout(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout: float
) -> T:
    """coro's result within timeout; past it the call is cancelled on the loop, and what it
    did decides: its result if it completed first (a put that inserted returns True), else
    TimeoutError, and then it did nothing (a put never inserts after the caller gave up)."""
    outcome: concurrent.futures.Future[T] = concurrent.futures.Future()
    tasks: list[asyncio.Task[T]] = []

    def settle(task: asyncio.Task[T]) -> None:
        if task.cancelled():
            outcome.set_exception(TimeoutError(f"the call did not complete within {timeout:g} s"))
        elif (error := task.exception()) is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(task.result())

    def start() -> None:
        tasks.append(loop.create_task(coro))
        tasks[0].add_done_callback(settle)

    def cancel() -> None:
        if tasks:  # started first: call_soon_threadsafe keeps the order
            tasks[0].cancel()

    loop.call_soon_threadsafe(start)
    try:
        return outcome.result(timeout)
    except TimeoutError:
        loop.call_soon_threadsafe(cancel)
    # A cancelled call finishes at once (a put gives its room back); a loop that no longer
    # runs leaves it where it is.
    return outcome.result(timeout)
