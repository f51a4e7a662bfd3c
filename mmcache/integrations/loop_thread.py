"""LoopThread: an event loop on a thread of its own, called synchronously from other threads."""

from __future__ import annotations

import _thread
import asyncio
import dataclasses
import threading
import types
from collections.abc import Coroutine, Generator
from typing import Any, Generic, TypeVar, final

from mmcache.errors import CacheClosedError, WrongLoopError

__all__ = ["LoopThread"]

_T = TypeVar("_T")


@final
class LoopThread:
    """Runs an asyncio loop on a daemon thread; run(coro) blocks the caller until coro is done.

    Lighter than asyncio.run_coroutine_threadsafe: one call_soon_threadsafe to start the
    coroutine and one bare lock to wake the caller, with no concurrent Future in between.
    With eager=True the coroutine's first step runs in that callback, and one that ends
    without suspending (a cache hit) needs no task and no further pass of the loop; it
    must not need asyncio.current_task() before its first suspension.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(started.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def alive(self) -> bool:
        """Whether the loop's thread is still running."""
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, _T], *, eager: bool = False) -> _T:
        """Run coro on the loop and return its result (or raise its exception)."""
        if self._closed:
            coro.close()
            raise CacheClosedError("this cache is closed; create a new one")
        if threading.current_thread() is self._thread:
            coro.close()
            raise WrongLoopError("called from the cache's own loop thread, which would deadlock")
        done = _thread.allocate_lock()
        done.acquire()
        box: list[asyncio.Task[_T] | _Outcome[_T]] = []

        def finished(task: asyncio.Task[_T]) -> None:
            box.append(task)
            done.release()

        def start() -> None:
            try:
                if eager:
                    try:
                        yielded = coro.send(None)
                    except StopIteration as stop:
                        box.append(_Outcome(stop.value, None))
                        done.release()
                        return
                    task = self.loop.create_task(_finish(coro, yielded))
                else:
                    task = self.loop.create_task(coro)
            except BaseException as exc:
                box.append(_Outcome(None, exc))
                done.release()
                return
            task.add_done_callback(finished)

        self.loop.call_soon_threadsafe(start)
        done.acquire()
        outcome = box[0]
        if isinstance(outcome, _Outcome):
            if outcome.error is not None:
                raise outcome.error
            return outcome.value  # type: ignore[return-value]
        return outcome.result()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop and wait for its thread to end; later run() calls raise."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)


@final
@dataclasses.dataclass(slots=True)
class _Outcome(Generic[_T]):
    """A coroutine's result or exception, where it ended without a task."""

    value: _T | None
    error: BaseException | None


@types.coroutine
def _resumed(coro: Coroutine[Any, Any, _T], yielded: Any) -> Generator[Any, Any, _T]:
    """Drive coro on from where its first step suspended, yielding what it awaits."""
    while True:
        try:
            sent = yield yielded
        except BaseException as exc:
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]


async def _finish(coro: Coroutine[Any, Any, _T], yielded: Any) -> _T:
    """A task's coroutine for the rest of coro, after its first step yielded."""
    return await _resumed(coro, yielded)
