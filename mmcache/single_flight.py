"""SingleFlight: concurrent callers of one key share one computation."""

from __future__ import annotations

import asyncio
import logging
import reprlib
import weakref
from collections.abc import Callable, Coroutine, Hashable
from contextvars import ContextVar
from typing import Any, Generic, TypeVar, final

from mmcache.errors import ReentrantComputeError

__all__ = ["SingleFlight"]

log = logging.getLogger("mmcache")

_T = TypeVar("_T")

# The computations this context runs inside: a task copies its creator's context, so a
# computation and the tasks it starts see their own computation here. Weakly: timers
# armed inside a computation keep its context, which must not keep the task and its
# value alive.
_computing: ContextVar[frozenset[weakref.ref[asyncio.Task[Any]]]] = ContextVar(
    "mmcache_computing", default=frozenset()
)


@final
class SingleFlight(Generic[_T]):
    """One task per key computing its value; every caller of the key awaits that task.

    Outside the cache's core, as cachetools keeps its decorators outside `Cache`: it
    knows nothing of tiers, only of keys and tasks. Callers await the task through
    asyncio.shield, so one cancelled caller does not cancel the others' work.
    """

    __slots__ = ("_displaced", "_running")

    def __init__(self) -> None:
        self._running: dict[Hashable, asyncio.Task[_T]] = {}
        # Computations that a newer one of their key took the place of (start), until done.
        self._displaced: set[asyncio.Task[_T]] = set()

    def __len__(self) -> int:
        return len(self._running) + len(self._displaced)

    def run(
        self, key: Hashable, compute: Callable[[], Coroutine[Any, Any, _T]]
    ) -> asyncio.Task[_T]:
        """The task computing key's value: the one running, else a new one of compute().

        Raises ReentrantComputeError when called from inside key's own computation
        (directly, or from a task it started and awaits): waiting would be for ever.
        """
        task = self.joinable(key)
        if task is None:
            task = self.start(key, compute)
        return task

    def joinable(self, key: Hashable) -> asyncio.Task[_T] | None:
        """The task computing key's value, or None where none runs.

        Raises ReentrantComputeError when called from inside that computation (see run).
        """
        task = self._running.get(key)
        if task is not None and weakref.ref(task) in _computing.get():
            raise ReentrantComputeError(
                f"get_or_compute({reprlib.repr(key)}) was called from inside its own fn "
                "(directly or through a task that fn started and awaits), which would wait "
                "for itself for ever; compute the value in fn instead of asking the cache"
            )
        return task

    def start(
        self, key: Hashable, compute: Callable[[], Coroutine[Any, Any, _T]]
    ) -> asyncio.Task[_T]:
        """A new task of compute(), which later callers of key join; one already running
        for key still runs, for the callers it has."""
        task = asyncio.ensure_future(_as_computation(compute))
        old = self._running.get(key)
        if old is not None:
            self._displaced.add(old)
        self._running[key] = task
        task.add_done_callback(lambda t: self._done(key, t))
        return task

    def running(self) -> list[asyncio.Task[_T]]:
        """The computations not finished yet."""
        return [*self._running.values(), *self._displaced]

    def _done(self, key: Hashable, task: asyncio.Task[_T]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        self._displaced.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("computing %r failed: %s", key, task.exception())


async def _as_computation(compute: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """compute(), in a task that its own context names as a computation."""
    task = asyncio.current_task()
    assert task is not None
    # This task's own context, which compute and the tasks it starts share or copy.
    _computing.set(_computing.get() | {weakref.ref(task)})
    del task  # a failure's traceback must not hold the task, and through it the value
    return await compute()
