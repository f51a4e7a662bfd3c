"""Recycler: the task that runs a sender's sweeps, often while sends wait for room."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

from mmcache.ipc.room import SendRoom

__all__ = ["Recycler"]

log = logging.getLogger("mmcache.ipc")

# Receivers release slices by writing shared cells, which wake nobody: while sends wait
# for room the recycler reads them this often instead of every ipc_recycle_interval_s.
_BACKPRESSURE_POLL_S: Final = 0.002


class Recycler:
    """Runs sweep (a quick sweep of the sender's) every interval s, every 2 ms while
    sends wait in the room's line, and at once when woken.

    It owns the task that does so and the event that wakes it.
    """

    def __init__(
        self, name: str, interval: float, room: SendRoom, sweep: Callable[[], None]
    ) -> None:
        self.name = name
        self._interval = interval
        self._room = room
        self._sweep = sweep
        self._poke = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the task on loop."""
        self._task = loop.create_task(self._run(), name=f"mmcache-ipc-{self.name}")

    def wake(self) -> None:
        """Sweep now, and often while sends wait for room."""
        self._poke.set()

    async def stop(self) -> None:
        """Cancel the task (if it started) and wait for it to end."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def stopped(self) -> bool:
        """Whether the task started and has ended."""
        return self._task is not None and self._task.done()

    async def _run(self) -> None:
        while True:
            delay = (
                min(self._interval, _BACKPRESSURE_POLL_S) if self._room.waiters else self._interval
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), delay)
            self._poke.clear()
            try:
                self._sweep()
            except Exception:
                log.exception("IPC sender %r: a recycler sweep failed", self.name)
