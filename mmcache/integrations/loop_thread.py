"""LoopThread: an event loop on a thread of its own, called synchronously from other threads."""

from __future__ import annotations

import _thread
import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar, final

from mmcache.errors import CacheClosedError, WrongLoopError

__all__ = ["LoopThread"]

_T = TypeVar("_T")


@final
class LoopThread:
    """Runs an asyncio loop on a daemon thread; run(coro) blocks the caller until coro is done.

    Lighter than asyncio.run_coroutine_threadsafe: one call_soon_threadsafe to start the
    task and one bare lock to wake the caller, with no concurrent Future in between.
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

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run coro as a task on the loop and return its result (or raise its exception)."""
        if self._closed:
            coro.close()
            raise CacheClosedError("this cache is closed; create a new one")
        if threading.current_thread() is self._thread:
            coro.close()
            raise WrongLoopError("called from the cache's own loop thread, which would deadlock")
        done = _thread.allocate_lock()
        done.acquire()
        box: list[asyncio.Task[_T] | BaseException] = []

        def finished(task: asyncio.Task[_T]) -> None:
            box.append(task)
            done.release()

        def start() -> None:
            try:
                task = self.loop.create_task(coro)
            except BaseException as exc:
                box.append(exc)
                done.release()
                raise
            task.add_done_callback(finished)

        self.loop.call_soon_threadsafe(start)
        done.acquire()
        outcome = box[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome.result()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop and wait for its thread to end; later run() calls raise."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
