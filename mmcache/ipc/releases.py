"""ReleaseReaper: a receiver's slice releases, run once the reads of each slice are done.

A device thread's report per slice would wake a thread and take the GIL from the
receiver's loop for every feature received. Instead the loop looks at the fences
itself, at each receive and on a short timer while any is pending, and runs the
release of every one that is done (in any order: fences of different streams complete
in any order). Where the loop stops looking (it ended, or the receiver is used from
another loop), a watchdog thread, running while releases are pending, hands them to
device threads, so a release is never lost.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from typing import Final

from mmcache.device import Fence

__all__ = ["ReleaseReaper"]

_LOOK_MIN_S: Final = 0.001  # the loop's first look after a release is queued
_LOOK_MAX_S: Final = 0.01  # looks back off to this while fences stay pending
#: A loop that has not looked for this long is taken to have stopped.
WATCHDOG_S: Final = 0.05


class ReleaseReaper:
    """Runs each queued release exactly once, after its fence is done."""

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

    def add(self, fence: Fence, release: Callable[[], None]) -> None:
        """Run release() once fence is done (call on the receiver's loop)."""
        with self._lock:
            self._pending[fence] = release
            start = self._watchdog is None
            if start:
                self._watchdog = threading.Thread(
                    target=self._watch, name="mmcache-ipc-releases", daemon=True
                )
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._timer is None:
            self._loop, self._delay = loop, _LOOK_MIN_S
            self._last_look = time.monotonic()
            self._timer = loop.call_later(self._delay, self._look, loop)
        if start:
            assert self._watchdog is not None
            self._watchdog.start()

    def reap(self) -> None:
        """Run the releases whose fences are done now (any thread)."""
        self._last_look = time.monotonic()
        with self._lock:
            done = [fence for fence in self._pending if fence.done()]
        for fence in done:
            self._run(fence)

    def _run(self, fence: Fence) -> None:
        with self._lock:
            release = self._pending.pop(fence, None)
            self._handed.discard(fence)
        if release is not None:  # the loop's look or a device thread, whichever came first
            release()

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
                if not self._pending:  # the next release starts another
                    self._watchdog = None
                    return
                if time.monotonic() - self._last_look < WATCHDOG_S:
                    continue
                stale = [fence for fence in self._pending if fence not in self._handed]
                self._handed.update(stale)
            for fence in stale:
                fence.add_done_callback(functools.partial(self._run, fence))
