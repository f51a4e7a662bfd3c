"""Turning fences into awaitables without blocking the event loop or spinning a core.

A fence's completion callback runs on whatever thread completed it (the
simulator's worker, the CUDA waiter thread); it only schedules work on the
loop with call_soon_threadsafe, which wakes the selector through its
self-pipe. That report needs the GIL on the reporting thread, and a loop that
never goes idle can keep it from that thread indefinitely: the loop lets go of
the GIL around each zero-timeout poll of its selector and takes it back before
the waiting thread runs, and each let-go restarts the thread's wait for a forced
switch (CPython's convoy effect: a few busy tasks hold worker threads back for far
longer than any copy). A GPU finishes its copies without the GIL, so while a wait is
outstanding the loop also looks at its fences itself, after LOOP_CHECK_S and then less
and less often: an idle loop hears from the thread first, a busy one finds the fences
done at most LOOP_CHECK_MAX_S after they finish. (The simulator's copies are
Python on a thread: a busy loop starves the copies themselves.)
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence

from mmcache.device.base import Fence
from mmcache.errors import CopyFailedError, CopyTimeoutError

__all__ = [
    "LONG_WAIT_S",
    "LOOP_CHECK_LONG_S",
    "LOOP_CHECK_MAX_S",
    "LOOP_CHECK_S",
    "FenceWatcher",
    "fence_error",
    "wait_fences",
]

log = logging.getLogger(__name__)

#: Seconds before the loop's first own look at the fences of an outstanding wait; each
#: look after that waits twice as long as the one before, up to LOOP_CHECK_MAX_S, and up
#: to LOOP_CHECK_LONG_S once the wait is older than LONG_WAIT_S (a fence that never
#: completes, a copy quarantined, must not keep the loop looking 100 times a second).
#: Looking every LOOP_CHECK_S all along would keep an idle loop busy for nothing; backing
#: off costs it little more than not looking at all.
LOOP_CHECK_S = 0.001
LOOP_CHECK_MAX_S = 0.01
LONG_WAIT_S = 1.0
LOOP_CHECK_LONG_S = 1.0


class _LoopCheck:
    """Calls on_done() on the loop, once, when every fence is done: when the device
    threads have reported each one (one_reported), or when the loop's own look finds them
    done, looking after LOOP_CHECK_S, then ever less often; never after cancel()."""

    __slots__ = (
        "_delay",
        "_fences",
        "_handle",
        "_left",
        "_loop",
        "_on_done",
        "_started",
        "_watcher",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fences: Sequence[Fence],
        on_done: Callable[[], None],
        watcher: FenceWatcher | None = None,
    ) -> None:
        self._loop = loop
        self._watcher = watcher  # told once on_done has run (its outstanding count)
        self._fences = list(fences)
        self._left = len(self._fences)  # fences not yet reported by their threads
        self._on_done = on_done
        self._delay = LOOP_CHECK_S
        self._started = loop.time()
        self._handle: asyncio.TimerHandle | None = None
        if not loop.is_closed():  # nobody is left to call back on a closed loop
            self._handle = loop.call_later(LOOP_CHECK_S, self._check)

    def _check(self) -> None:
        self._handle = None  # this one is running: cancelling it would blank its report
        fences = self._fences
        try:
            while fences and fences[-1].done():  # the last one is usually the last to finish
                fences.pop()
            if fences and all(f.done() for f in fences):
                fences.clear()
        except Exception:  # the device threads' reports still come
            log.exception("looking at a fence failed")
        if fences:
            long_wait = self._loop.time() - self._started > LONG_WAIT_S
            cap = LOOP_CHECK_LONG_S if long_wait else LOOP_CHECK_MAX_S
            self._delay = min(2 * self._delay, cap)
            self._handle = self._loop.call_later(self._delay, self._check)
            return
        self._fire()

    def one_reported(self) -> None:
        """On the loop: a device thread reported one of the fences done."""
        self._left -= 1
        if self._left == 0:
            self._fire()

    def _fire(self) -> None:
        on_done = self._on_done
        self.cancel()  # first: the other way of noticing must not call it again
        try:
            on_done()
        except Exception:
            log.exception("a fence callback raised")
        finally:
            watcher = self._watcher
            if watcher is not None:
                self._watcher = None
                watcher.one_done()

    def cancel(self) -> None:
        """Stop looking; also lets go of on_done, which often refers back to this check."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._on_done = _nothing
        self._fences = []


def _nothing() -> None:
    pass


def fence_error(fences: Sequence[Fence]) -> BaseException | None:
    """The first error among done fences, if any."""
    for f in fences:
        exc = f.exception()
        if exc is not None:
            return exc
    return None


def _call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass  # the loop is closed: nobody is left to tell


async def wait_fences(
    fences: Sequence[Fence],
    timeout: float | None = None,  # noqa: ASYNC109
    *,
    pending: bool = False,
) -> float:
    """Wait until every fence is done; return the seconds waited.

    pending: the caller found none of them done just now (asking again, a driver call
    each, is skipped). Raises CopyFailedError if a copy failed, CopyTimeoutError if
    timeout passed first.
    """
    if pending:
        waiting = list(fences)
    else:
        waiting = []
        for f in fences:
            if not f.done():
                waiting.append(f)
    if waiting:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        future: asyncio.Future[None] = loop.create_future()

        def all_done() -> None:
            if not future.done():  # cancelled by a timeout
                future.set_result(None)

        check = _LoopCheck(loop, waiting, all_done)
        for f in waiting:
            f.add_done_callback(lambda: _call_on_loop(loop, check.one_reported))
        try:
            if timeout is None:
                await future
            else:
                try:
                    await asyncio.wait_for(future, timeout)
                except TimeoutError:
                    raise CopyTimeoutError(
                        f"a device copy did not complete within {timeout:g} s "
                        "(MMCACHE_COPY_TIMEOUT_SEC); its memory is quarantined"
                    ) from None
        finally:
            check.cancel()
        waited = time.perf_counter() - started
    else:
        waited = 0.0
    exc = fence_error(fences)
    if exc is not None:
        if isinstance(exc, CopyFailedError):
            # A copy of the fence's error, not the error itself: raised here, it would take
            # this reader's frames into its traceback, and the fence, which outlives the
            # read, would keep them and whatever they hold (entries, device tensors).
            raise copy.copy(exc) from exc
        raise CopyFailedError(f"device copy failed: {exc}") from exc
    return waited


class FenceWatcher:
    """Runs callbacks on the event loop once all of their fences are done.

    Completions arriving from device threads are queued and handed to the loop by
    one call_soon_threadsafe per burst: a wake-up (and a self-pipe write) per fence
    would cost the loop more than the work it wakes for.
    """

    __slots__ = (
        "_done",
        "_drain_scheduled",
        "_idle",
        "_lazy",
        "_lazy_delay",
        "_lazy_handle",
        "_loop",
        "outstanding",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is not None:
            self.bind(loop)
        self.outstanding = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._done: deque[Callable[[], None]] = deque()  # appended by any thread
        self._drain_scheduled = False
        #: the lazy callbacks of each stream (None: the device's copy streams), in order
        self._lazy: defaultdict[object, deque[tuple[Fence, Callable[[], None]]]]
        self._lazy = defaultdict(deque)
        self._lazy_handle: asyncio.TimerHandle | None = None
        self._lazy_delay = LOOP_CHECK_S

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run callbacks on loop: a watcher made before its loop runs is bound once it does
        (its verbs can be handed out first, with no wrapper to call through)."""
        self._loop = loop

    def when_done(
        self, fences: Sequence[Fence], callback: Callable[[], None], *, fresh: bool = False
    ) -> None:
        """Call callback() on the loop after every fence is done (at once if they are).

        fresh: the fences were recorded just now, so asking whether they are done (a
        driver call each) is skipped; one that is done already is reported at once anyway.
        """
        pending = list(fences) if fresh else [f for f in fences if not f.done()]
        if not pending:
            callback()
            return
        self.outstanding += 1
        self._idle.clear()
        check = _LoopCheck(self._loop, pending, callback, self)
        for f in pending:
            f.add_done_callback(lambda: self._completed(check.one_reported))

    def when_done_lazily(
        self, fence: Fence, callback: Callable[[], None], stream: object = None
    ) -> None:
        """Call callback() on the loop once fence is done, as found by the loop's own looks.

        No device thread is woken: for bookkeeping nobody waits on (an upload's accounting),
        where a thread's report would cost the loop more than the work. fence is on stream
        (None: the device's copy streams); the callbacks of one stream run in the order
        given, each once every fence before it is done too (fences of one stream complete
        in order, so a look asks only the oldest of each), and a fence that never completes
        holds back no other stream's.
        """
        self.outstanding += 1
        self._idle.clear()
        self._lazy[stream].append((fence, callback))
        if self._lazy_handle is None and not self._loop.is_closed():
            self._lazy_delay = LOOP_CHECK_S
            self._lazy_handle = self._loop.call_later(LOOP_CHECK_S, self._look)

    def _look(self) -> None:
        self._lazy_handle = None
        lazy = self._lazy
        for stream, queue in list(lazy.items()):
            try:
                while queue and queue[0][0].done():
                    callback = queue.popleft()[1]
                    try:
                        callback()
                    except Exception:
                        log.exception("a fence callback raised")
                    finally:
                        self.one_done()
            except Exception:  # looked at again at the next turn
                log.exception("looking at a fence failed")
            if not queue:
                del lazy[stream]
        if lazy:
            self._lazy_delay = min(2 * self._lazy_delay, LOOP_CHECK_MAX_S)
            self._lazy_handle = self._loop.call_later(self._lazy_delay, self._look)

    def one_done(self) -> None:
        """One outstanding callback has run (or raised)."""
        self.outstanding -= 1
        if self.outstanding == 0:
            self._idle.set()

    async def idle(self) -> None:
        """Wait until no callback is outstanding."""
        while self.outstanding:
            await self._idle.wait()

    def _completed(self, fn: Callable[[], None]) -> None:
        # Any thread. The flag is cleared before the loop drains, so a completion that
        # races with a drain either is drained by it or schedules the next one.
        self._done.append(fn)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            _call_on_loop(self._loop, self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        done = self._done
        while done:
            fn = done.popleft()
            try:
                fn()
            except Exception:
                log.exception("a fence callback raised")
