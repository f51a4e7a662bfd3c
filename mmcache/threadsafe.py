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
    future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
    return future.result(timeout)
