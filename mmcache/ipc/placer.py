"""SendPlacer: where each send goes (the pool, after a short wait too, the fallback, the line)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from mmcache.errors import CacheClosedError
from mmcache.ipc.control import LaneInfo
from mmcache.ipc.errors import TransportFullError
from mmcache.ipc.memory import SenderMemory
from mmcache.ipc.reclaim import LeaseReclaimer
from mmcache.ipc.room import Placement, SendRoom
from mmcache.metrics import CacheMetrics
from mmcache.settings import CacheSettings

__all__ = ["SendPlacer"]


class SendPlacer:
    """Finds each send its room: a pool slice now, one a receiver frees within
    ipc_pool_wait_s, a fallback block, or else a place in SendRoom's line.

    It owns the pool's stall mark: the pool bytes in use when a wait for pool room last
    timed out (None: none did, or the pool took a send since); sends skip the wait until
    the pool frees some. And fallbacks: the sends that took the fallback, by reason.
    quick_sweep reclaims what receivers released (a quick sweep of the recycler's),
    wake_recycler has the recycler sweep often while sends wait, closed says whether the
    sender began to close.
    """

    def __init__(
        self,
        settings: CacheSettings,
        memory: SenderMemory,
        room: SendRoom,
        reclaimer: LeaseReclaimer,
        metrics: CacheMetrics,
        quick_sweep: Callable[[], None],
        wake_recycler: Callable[[], None],
        closed: Callable[[], bool],
    ) -> None:
        self.settings = settings
        self._memory = memory
        self._room = room
        self._reclaimer = reclaimer
        self._metrics = metrics
        self._quick_sweep = quick_sweep
        self._wake_recycler = wake_recycler
        self._closed = closed
        self._pool_stalled_at: int | None = None
        self.fallbacks: dict[str, int] = {}

    async def place(
        self, nbytes: int, lanes: Sequence[LaneInfo], wait: bool
    ) -> tuple[Placement, str]:
        """Room for nbytes, and why it is not in the pool if it is not."""
        room = self._room
        refusal = room.pool_refusal(nbytes, lanes)
        pool_ok = refusal is None
        room.check_fits(nbytes, refusal)
        reason = refusal or "pool_full"
        if not room.waiters:
            owner = asyncio.current_task()
            placement = None
            if pool_ok:
                # Also after a short wait for receivers' releases: in a burst they free a
                # slice within a receive or two, far sooner than the fallback's two trips
                # over PCIe would take.
                placement = self._try_place(nbytes, owner, pool=True)
                if placement is not None:
                    self._pool_stalled_at = None
                elif wait and self._pool_wait_worthwhile():
                    placement = await self._wait_for_pool(nbytes, owner)
            if placement is None:
                placement = self._try_place(nbytes, owner, pool=False)
            if placement is not None:
                return placement, reason
        if not wait:
            raise TransportFullError(room.full_message(nbytes, None))
        return await self._wait_for_room(nbytes, pool_ok), reason

    def count_fallback(self, reason: str) -> None:
        """Count a send that took the fallback, and why (its metric too)."""
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self._metrics.ipc_fallback(reason)

    def _try_place(
        self, nbytes: int, owner: asyncio.Task[object] | None, *, pool: bool
    ) -> Placement | None:
        """A pool slice (pool) or a fallback block now, after a quick sweep if it is due."""
        placement = self._room.try_place(nbytes, pool, owner, host_ok=not pool)
        if placement is None and self._reclaimer.due():
            self._quick_sweep()
            placement = self._room.try_place(nbytes, pool, owner, host_ok=not pool)
        return placement

    def _pool_wait_worthwhile(self) -> bool:
        """Whether a send that found the pool full should wait for it: not when waiting is
        off, and not again before a slice was freed since the last wait that timed out
        (a pool held by slow readers would make every send pay the whole wait)."""
        pool = self._memory.pool
        if pool is None or self.settings.ipc_pool_wait_s <= 0:
            return False
        return self._pool_stalled_at is None or pool.used_bytes < self._pool_stalled_at

    async def _wait_for_pool(
        self, nbytes: int, owner: asyncio.Task[object] | None
    ) -> Placement | None:
        """A pool slice freed within ipc_pool_wait_s, or None (then the fallback is used).

        Receivers release slices by writing shared cells, which wake nobody: the loop
        looks again each time it has run what else is ready, as a slice's fences landing
        do, for this short while only.
        """
        loop = asyncio.get_running_loop()
        pool = self._memory.pool
        assert pool is not None
        deadline = loop.time() + self.settings.ipc_pool_wait_s
        while True:
            await asyncio.sleep(0)
            if self._closed():
                raise CacheClosedError("the IPC sender closed while send waited for room")
            self._quick_sweep()
            placement = self._room.try_place(nbytes, True, owner, host_ok=False)
            if placement is not None:
                return placement
            if self._room.waiters or loop.time() >= deadline:
                self._pool_stalled_at = pool.used_bytes
                return None

    async def _wait_for_room(self, nbytes: int, pool_ok: bool) -> Placement:
        waiter = self._room.waiters.join((nbytes, pool_ok, asyncio.current_task()))
        self._wake_recycler()  # the recycler sweeps often while sends wait
        timeout = self.settings.ipc_lease_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._room.waiters.wait(waiter)  # gives back a grant come too late
        except TimeoutError:
            raise TransportFullError(self._room.full_message(nbytes, timeout)) from None
