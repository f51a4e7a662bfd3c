"""HostTier: the pinned host arena, its order of victims, and puts waiting for host room."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, final

from mmcache.core.counters import Counters
from mmcache.core.ledger import TierLedger
from mmcache.core.policy import EvictionPolicy, make_policy
from mmcache.device import Device, Fence
from mmcache.entry import Entry
from mmcache.errors import CacheClosedError
from mmcache.host_pool import HostBlock, HostPool

__all__ = ["HostTier"]

log = logging.getLogger("mmcache")


class _Landings(Protocol):
    """What a put waiting for host room needs of the offload pipeline."""

    def reap(self) -> None: ...
    def watch(self, *, now: bool = False) -> None: ...


@final
class HostTier:
    """The host tier: arena (pinned in the background), order of victims, waiting puts.

    Its bytes are the pool's own ledger; its entry count is the TierLedger's. Nothing
    here waits for room except a put that bypasses the GPU tier (its budget is 0).
    """

    def __init__(
        self,
        device: Device,
        capacity: int,
        *,
        alignment: int,
        policy: str,
        counters: Counters,
        ledger: TierLedger,
        unlink: Callable[[Entry], None],
    ) -> None:
        self._device = device
        self.capacity = capacity
        self._alignment = alignment
        self._counters = counters
        self._ledger = ledger
        self._unlink = unlink  # removes an evicted entry from the index and its tier
        #: the order in which host entries are dropped for room
        self.order: EvictionPolicy = make_policy(policy)
        self.pool: HostPool | None = None
        self._ready: asyncio.Event | None = None
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False
        #: told of each entry the tier drops for room, before it goes (the remote tier's)
        self.on_evict: Callable[[Entry], None] | None = None

    @property
    def waiting(self) -> bool:
        """Whether a put waits for host room."""
        return bool(self._waiters)

    @property
    def ready(self) -> bool:
        """Whether the arena is pinned (or the tier is off)."""
        return self.pool is not None or self.capacity == 0

    def failed(self) -> bool:
        """The arena could not be allocated: the host tier will never take anything."""
        ready = self._ready
        return self.pool is None and ready is not None and ready.is_set()

    def limit(self) -> int:
        """The largest feature the host tier can take."""
        return self.capacity if self.pool is None else self.pool.max_block_bytes

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        defer: Callable[[Sequence[Fence], Callable[[], None]], None],
        on_capacity: Callable[[int], None],
    ) -> concurrent.futures.Future[Any] | None:
        """Pin the arena in the background; the future to await once, None if the tier is off.

        defer runs a callback once fences are done (the pool's deferred frees); on_capacity
        reports the arena's bytes once pinned.
        """
        self._ready = asyncio.Event()
        if self.capacity == 0:
            self._ready.set()
            return None
        future = self._device.host_arena_async(self.capacity)

        def arrived(f: concurrent.futures.Future[Any]) -> None:
            loop.call_soon_threadsafe(self._arena_ready, f, defer, on_capacity)

        future.add_done_callback(arrived)
        return future

    async def wait_ready(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait until the arena is pinned; False if timeout passed first or it failed."""
        assert self._ready is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout)
        return self.ready

    def _arena_ready(
        self,
        future: concurrent.futures.Future[Any],
        defer: Callable[[Sequence[Fence], Callable[[], None]], None],
        on_capacity: Callable[[int], None],
    ) -> None:
        if self._closed:
            return
        assert self._ready is not None
        self._ready.set()
        try:
            arena = future.result()
        except Exception as e:
            log.error("host arena of %d bytes could not be allocated: %s", self.capacity, e)
            self.wake()  # puts waiting for host room (GPU tier off) give up
            return
        self.pool = HostPool(
            self._device,
            arena,
            alignment=self._alignment,
            defer=defer,
            on_free=self.wake,
            chunk_bytes=self._device.arena_chunk_bytes,
        )
        on_capacity(self.pool.capacity_bytes)
        self.wake()

    def allocate(self, nbytes: int) -> HostBlock | None:
        """A host block now, dropping host entries in the policy's order if needed; never waits."""
        pool = self.pool
        if pool is None or nbytes > pool.max_block_bytes:
            return None
        while True:
            block = pool.allocate(nbytes)
            if block is not None or not self.order:
                return block
            self._evict_one()

    def allocate_run(self, sizes: Sequence[int]) -> list[HostBlock] | None:
        """One run of blocks for sizes in one free range, dropping nothing; None if none."""
        return None if self.pool is None else self.pool.allocate_run(sizes)

    def free(self, block: HostBlock, after: Sequence[Fence] = ()) -> None:
        """Give a block back (reused only after the fences of copies that read it)."""
        assert self.pool is not None
        self.pool.free(block, after=after)

    def free_block(self, entry: Entry) -> None:
        """Release entry's host block, if any, after its readers; it leaves the tier's count."""
        block, entry.block = entry.block, None
        if block is not None and self.pool is not None:
            self._ledger.host_left(entry.count)
            self.pool.free(block, after=entry.readers_pending())

    async def reserve(
        self, sizes: Sequence[int], wait: bool, blocks: list[HostBlock], landings: _Landings
    ) -> bool:
        """Host blocks (appended to blocks) for a put that bypasses the GPU tier (budget 0).

        All at once or none: a put holding some blocks while it waits for the rest could
        fragment the arena so that the rest never fit. Until the arena is pinned a put
        waits for it (or returns False with wait=False); if it cannot be allocated, False.
        """
        landings.reap()
        if not self._waiters:
            taken = self._allocate_all(sizes)
            if taken is not None:
                blocks.extend(taken)
                return True
        if not wait or self.failed():
            return False
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        landings.watch()  # now, not late: landings let us evict their entries
        try:
            while True:
                await waiter
                if self._closed:  # woken, then close() ran before we resumed
                    raise CacheClosedError("the cache closed while put waited")
                if self.failed():
                    return False
                taken = self._allocate_all(sizes)
                if taken is not None:
                    blocks.extend(taken)
                    return True
                waiter = loop.create_future()
                self._waiters.appendleft(waiter)
                landings.watch()  # a report just took us off the line: watch on
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            self.wake()

    def wake(self) -> None:
        """Wake the first waiting put: waiters retry their allocation in order."""
        while self._waiters:
            head = self._waiters.popleft()
            if not head.done():
                head.set_result(None)
                return

    def close(self) -> None:
        """No put waiting for host room inserts from now on; the arena arriving is ignored."""
        self._closed = True

    def fail_waiters(self) -> None:
        """Raise CacheClosedError in every put waiting for host room."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(CacheClosedError("the cache closed while put waited"))

    def _evict_one(self) -> None:
        """Drop the host entry the policy gives up first (counted as a host-tier eviction)."""
        victim = self.order.evict()
        self._counters.evicted_cpu(victim.count)
        if self.on_evict is not None:
            self.on_evict(victim)
        self._unlink(victim)

    def _allocate_all(self, sizes: Sequence[int]) -> list[HostBlock] | None:
        """A host block for each size now, or none (dropping host entries as allocate does).

        One by one first; if that fails, as one run, which an emptied arena always takes.
        None while the arena is not pinned yet.
        """
        pool = self.pool
        if pool is None:
            return None
        taken: list[HostBlock] = []
        for nbytes in sizes:
            block = self.allocate(nbytes)
            if block is None:
                break
            taken.append(block)
        else:
            return taken
        for block in taken:
            pool.free(block)
        if len(sizes) == 1 or sum(sizes) > pool.max_block_bytes:
            return None  # no run could take them: evicting more would be for nothing
        while True:
            run = pool.allocate_run(sizes)
            if run is not None or not self.order:
                return run
            self._evict_one()
