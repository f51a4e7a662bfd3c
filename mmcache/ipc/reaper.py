"""FenceReaper: per-feature bookkeeping of the IPC transport, run once each fence is done.

A receiver releases each slice once its copy out (or its lease's stream work) is done;
a sender publishes each pool slice's ready mark once its copy in is done. A device
thread's report per feature would wake a thread and take the GIL from the loop for
every feature. Instead the loop looks at the fences itself, at each call and on a
short timer while any is pending, and runs the callback of every one that is done (in
any order: fences of different streams complete in any order). Where the loop stops
looking (it ended, or the object is used from another loop), a watchdog thread,
running while callbacks are pending, hands them to device threads, so none is lost.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

from mmcache.device import Fence

__all__ = ["FenceReaper"]

log = logging.getLogger("mmcache.ipc")

_LOOK_MIN_S: Final = 0.001  # the loop's first look after a callback is queued
_LOOK_MAX_S: Final = 0.01  # looks back off to this while fences stay pending
#: A loop that has not looked for this long is taken to have stopped.
WATCHDOG_S: Final = 0.05


class FenceReaper:
    """Runs each queued callback exactly once, after its fence is done."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Fence, Callable[[], None]] = {}
        self._handed: set[Fence] = set()  # given to device threads to report
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._delay = _LOOK_MIN_S
        self._last_look = time.monotonic()
        self._watchdog: threading.Thread | None = None
        self._wake = threading.Event()

    def add(self, fence: Fence, callback: Callable[[], None]) -> None:
        """Run callback() once fence is done (call on the owner's loop)."""
        with self._lock:
            self._pending[fence] = callback
            start = self._watchdog is None
            if start:
                self._watchdog = threading.Thread(
                    target=self._watch, name="mmcache-ipc-reaper", daemon=True
                )
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._timer is None:
            self._loop, self._delay = loop, _LOOK_MIN_S
            self._last_look = time.monotonic()
            self._timer = loop.call_later(self._delay, self._look, loop)
        if start:
            assert self._watchdog is not None
            self._watchdog.start()

    def reap(self, *, full: bool = True) -> None:
        """Run the callbacks whose fences are done now (any thread).

        full=False looks at the oldest only, up to the first still running: fences of one
        stream complete in the order they were queued, and the timer's full looks find
        those of other streams that completed earlier.
        """
        self._last_look = time.monotonic()
        with self._lock:
            done = []
            for fence in self._pending:
                if fence.done():
                    done.append(fence)
                elif not full:
                    break
        for fence in done:
            self._run(fence)

    def _run(self, fence: Fence) -> None:
        with self._lock:
            callback = self._pending.pop(fence, None)
            self._handed.discard(fence)
        if callback is not None:  # the loop's look or a device thread, whichever came first
            callback()

    def _look(self, loop: asyncio.AbstractEventLoop) -> None:
        if loop is not self._loop:
            return  # the receiver moved to another loop, which looks from now on
        self._timer = None
        self.reap()
        if self._pending:
            self._delay = min(2 * self._delay, _LOOK_MAX_S)
            self._timer = loop.call_later(self._delay, self._look, loop)
        else:
            self._delay = _LOOK_MIN_S

    def _watch(self) -> None:
        while True:
            self._wake.wait(WATCHDOG_S)
            self._wake.clear()
            with self._lock:
                if not self._pending:  # the next callback starts another
                    self._watchdog = None
                    return
                if time.monotonic() - self._last_look < WATCHDOG_S:
                    continue
                stale = [fence for fence in self._pending if fence not in self._handed]
                self._handed.update(stale)
            for fence in stale:
                try:
                    fence.add_done_callback(functools.partial(self._run, fence))
                except Exception:  # its device closed under it: nothing will report it
                    log.exception("handing a fence to the device's threads failed")
