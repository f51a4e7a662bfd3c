"""SingleFlight: concurrent callers of one key share one computation."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar, final

__all__ = ["SingleFlight"]

log = logging.getLogger("mmcache")

_T = TypeVar("_T")


@final
class SingleFlight(Generic[_T]):
    """One task per key computing its value; every caller of the key awaits that task.

    Outside the cache's core, as cachetools keeps its decorators outside `Cache`: it
    knows nothing of tiers, only of keys and tasks. Callers await the task through
    asyncio.shield, so one cancelled caller does not cancel the others' work.
    """

    __slots__ = ("_running",)

    def __init__(self) -> None:
        self._running: dict[Hashable, asyncio.Task[_T]] = {}

    def run(
        self, key: Hashable, compute: Callable[[], Coroutine[Any, Any, _T]]
    ) -> asyncio.Task[_T]:
        """The task computing key's value: the one running, else a new one of compute()."""
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(compute())
            self._running[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
        return task

    def running(self) -> list[asyncio.Task[_T]]:
        """The computations not finished yet."""
        return list(self._running.values())

    def _done(self, key: Hashable, task: asyncio.Task[_T]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled() and task.exception() is not None:
            log.debug("computing %r failed: %s", key, task.exception())
