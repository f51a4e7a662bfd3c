"""OffloadPipeline: offload copies queued and landing, in order, and the one watch on them."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from typing import Final, final

from mmcache.core.counters import Counters
from mmcache.core.entry import Entry
from mmcache.core.state import Offload, OffloadItems, Release, TierState
from mmcache.device import Device, Fence
from mmcache.waiting import FenceWatcher

__all__ = ["WATCH_DELAY_S", "OffloadPipeline"]

log = logging.getLogger("mmcache")

#: how late the waiter thread is asked to report a landing while no put waits for room
WATCH_DELAY_S: Final = 0.001

WhenDone = Callable[..., None]  # FenceWatcher.when_done(fences, callback, *, fresh=False)


@final
class OffloadPipeline:
    """Device -> host copies from queueing to landing (the state makes the transitions).

    Offloads land in the order they were queued (one copy stream), so the oldest is the
    only one worth watching: a put short of room reaps what has landed itself, and one
    watch at a time on the device's waiter thread serves an idle loop and waiting puts.
    Offloads past copy_timeout_s are quarantined by one watchdog timer for all.
    """

    def __init__(
        self,
        *,
        device: Device,
        state: TierState,
        counters: Counters,
        carry_out: Callable[[Sequence[Release]], None],
        after_landing: Callable[[bool], None],
        lines: Sequence[Collection[object]],
        changed: Callable[[], None],
        copy_timeout: float,
    ) -> None:
        self._state = state
        self._counters = counters
        self._carry_out = carry_out  # releases what a landing or a quarantine gave up
        self._after_landing = after_landing  # hands the room on (charged_gpu or not)
        # The lines of puts waiting for room: while one waits, watch at once, not late.
        self._lines = lines
        self._changed = changed  # the tiers' figures changed outside a landing
        self._copy_timeout = copy_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: FenceWatcher | None = None
        # Offloads not yet handled, in the order queued (and so the order they land).
        self._landing: OrderedDict[Offload, None] = OrderedDict()
        #: the offloads not yet handled (read-only): truthy while any is, with no call
        self.queued: Collection[Offload] = self._landing
        self._watched = False  # the waiter thread watches the oldest of them
        self._watch_timer: asyncio.TimerHandle | None = None  # arms that watch a little late
        self._watchdog: asyncio.TimerHandle | None = None  # quarantines overdue offloads
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop, watcher: FenceWatcher) -> None:
        """Arm timers on loop and watch fences through watcher from now on."""
        self._loop = loop
        self._watcher = watcher

    def __bool__(self) -> bool:
        """Whether an offload is queued and not yet handled."""
        return bool(self._landing)

    def __len__(self) -> int:
        return len(self._landing)

    @property
    def watched(self) -> bool:
        """Whether the waiter thread watches the oldest offload now."""
        return self._watched

    def fences(self) -> list[Fence]:
        """The fences of the offloads not yet handled, oldest first."""
        return [offload.fence for offload in self._landing]

    def queue(self, fence: Fence, items: OffloadItems, *, charged_gpu: bool) -> None:
        """Entries whose copies into blocks were queued behind fence: D2H until it lands."""
        started = time.perf_counter()
        offload = self._state.offload_queued(items, fence, started, charged_gpu=charged_gpu)
        self._counters.offload_started(offload.features)
        self._landing[offload] = None
        self.watch()
        if self._watchdog is None:
            self._arm_watchdog(started + self._copy_timeout)

    def reap(self) -> None:
        """Handle offloads that have landed, oldest first, without waiting to be told.

        A put short of room looks here first, and often finds its room already copied out.
        A landing that raises goes to the loop's exception handler, as a raising callback
        would: it must not fail the put that happened to reap it, nor stop the reaping.
        """
        landing = self._landing
        while landing:
            offload = next(iter(landing))
            if not offload.fence.done():
                return
            del landing[offload]
            try:
                self._land(offload)
            except Exception as exc:
                assert self._loop is not None
                self._loop.call_exception_handler(
                    {"message": "mmcache: handling a landed offload failed", "exception": exc}
                )

    def watch(self, *, now: bool = False) -> None:
        """Have the device's waiter thread report when the oldest queued offload lands.

        One watch at a time, not one per offload: a report takes the GIL on the waiter
        thread, and a busy loop pays for that hand-over in its next torch call. A loop
        that keeps putting reaps landings itself; the watch serves an idle loop and puts
        waiting for room. It is armed at once while a put waits for room (or with now),
        else WATCH_DELAY_S later and only if landings are still unhandled then: a loop
        that yields between batches of puts would otherwise take a report per landing
        (BENCHMARKS.md has the cost of each).
        """
        if self._watched or not self._landing:
            return
        if not (now or any(self._lines)):
            if self._watch_timer is None and not self._closed:
                assert self._loop is not None
                self._watch_timer = self._loop.call_later(WATCH_DELAY_S, self._watch_late)
            return
        self._watched = True
        oldest = next(iter(self._landing))
        assert self._watcher is not None
        # Fresh: the oldest was queued just now, or was just seen still copying. Armed
        # after waits for later copies, it is not held behind them (Fence.add_done_callback).
        self._watcher.when_done([oldest.fence], self._reported, fresh=True)

    async def all_landed(self) -> None:
        """Wait until every queued offload has landed and been handled, and every other
        callback waiting on fences has run. Watches landings at once, never late."""
        assert self._watcher is not None
        while True:
            self.watch(now=True)
            await self._watcher.idle()
            if not self._landing:
                return

    def close(self) -> None:
        """Watch landings at once from now on (the cache is closing)."""
        self._closed = True
        if self._watch_timer is not None:
            self._watch_timer.cancel()
            self._watch_timer = None

    def quarantine(self, entry: Entry, fence: Fence) -> None:
        """An offload past copy_timeout_s: its entry is dropped, its bytes kept reserved as
        leaked (the copy may still run); its landing releases both if it ever ends. Puts
        waiting for GPU room are woken: the room they counted on from it is not coming,
        so other entries are evicted for them."""
        charged_gpu = self._state.charged(entry)
        if not self._state.quarantine_offload(entry, fence):
            return
        log.error(
            "offload of %r did not complete within %g s (MMCACHE_COPY_TIMEOUT_SEC): entry "
            "dropped, its %d bytes quarantined",
            entry.key,
            self._copy_timeout,
            entry.nbytes,
        )
        self._after_landing(charged_gpu)  # hands on what is left (and pushes the figures)

    def _watch_late(self) -> None:
        """The delayed watch: handle what has landed, then watch the rest at once."""
        self._watch_timer = None
        try:
            self.reap()
        finally:
            self.watch(now=True)

    def _reported(self) -> None:
        # Still marked watched while reaping: offloads the landings start need no watch
        # of their own until the reap has found the oldest one still copying.
        try:
            self.reap()
        finally:  # a landing that raised must not leave the rest unwatched
            self._watched = False
            self.watch()

    def _arm_watchdog(self, deadline: float) -> None:
        assert self._loop is not None
        delay = max(0.0, deadline - time.perf_counter())
        self._watchdog = self._loop.call_later(delay, self._check_overdue)

    def _check_overdue(self) -> None:
        """Quarantine offloads past copy_timeout_s: one timer for all, oldest first."""
        self._watchdog = None
        now = time.perf_counter()
        for offload in list(self._landing):
            deadline = offload.started + self._copy_timeout
            if deadline > now:
                self._arm_watchdog(deadline)
                return
            if not offload.fence.done():
                for entry in offload.batch:
                    self.quarantine(entry, offload.fence)

    def _land(self, offload: Offload) -> None:
        """An offload copy has finished: the state makes its entries host-resident (or
        lost); the device tensors and lost blocks are released here."""
        self._counters.copy_finished("d2h", offload.nbytes, offload.started, offload.features)
        landing = self._state.offload_landed(offload)
        self._carry_out(landing.releases)
        if landing.failed is None:
            self._counters.offloaded(offload.nbytes)
        self._after_landing(offload.charged_gpu)
