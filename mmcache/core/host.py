"""HostTier: the pinned host arena as it pins, and puts waiting for host room."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any, Final, Protocol, final

import torch

from mmcache.core.entry import Entry
from mmcache.core.state import Release, TierState
from mmcache.device import Device, Fence
from mmcache.errors import CacheClosedError, CopyTimeoutError
from mmcache.host_pool import HostBlock, HostPool
from mmcache.node_host import NodeHost

__all__ = ["HostTier"]

log = logging.getLogger("mmcache")

#: Pinned room kept free ahead of the puts (a quarter of a smaller arena). Below it the
#: arena pins at full speed, above it at the device's pace (PIN_PACE): pinning holds the
#: driver lock that the engine's kernel launches wait for.
PINNED_HEADROOM_BYTES: Final = 256 << 20


class _Landings(Protocol):
    """What a put waiting for host room needs of the offload pipeline."""

    def reap(self) -> None: ...
    def watch(self, *, now: bool = False) -> None: ...


@final
class HostTier:
    """The host tier's arena (served chunk by chunk as it pins) and the puts waiting for
    its room.

    The pool, its blocks and the host order are the TierState's; this part pins the
    arena, hands each pinned chunk to the state's pool, and keeps the line of puts that
    bypass the GPU tier (its budget is 0), the only ones that wait for host room.
    """

    def __init__(
        self,
        device: Device,
        state: TierState,
        capacity: int,
        *,
        alignment: int,
        carry_out: Callable[[Sequence[Release]], None],
        node: NodeHost | None = None,
    ) -> None:
        self._device = device
        #: the node's shared host tier (host_share="node"): the arena is its, not ours
        self.node = node
        self._state = state
        self.capacity = capacity
        self._alignment = alignment
        self._carry_out = carry_out
        #: the arena's allocator once its first chunk is pinned (the state's too)
        self.pool: HostPool | None = None
        self._ready: asyncio.Event | None = None  # set once pinning ended, done or failed
        self._complete = False  # the whole arena is pinned
        self._waiters: deque[asyncio.Future[None]] = deque()
        # wait_ready calls and puts waiting for room under way: the arena pins at full speed
        self._awaited = 0
        #: the puts waiting for host room (read-only): truthy while any waits
        self.line: Collection[object] = self._waiters
        self._closed = False
        #: set by leave_node once every block of the node's pool is given back
        self._unused: asyncio.Future[None] | None = None

    @property
    def waiting(self) -> bool:
        """Whether a put waits for host room."""
        return bool(self._waiters)

    @property
    def ready(self) -> bool:
        """Whether the whole arena is pinned (or the tier is off)."""
        return self._complete or self.capacity == 0

    @property
    def ready_bytes(self) -> int:
        """Bytes of the arena pinned and usable so far."""
        return 0 if self.pool is None else self.pool.ready_bytes

    def failed(self, sizes: Sequence[int] = ()) -> bool:
        """Pinning ended and the arena will never take anything (or all of sizes at once)."""
        ready = self._ready
        if ready is None or not ready.is_set():
            return False
        pool = self.pool
        if pool is None:
            return True
        # An arena pinned only in part ends short: a put waiting for more must give up.
        return bool(sizes) and (
            max(sizes) > pool.max_block_bytes or sum(map(pool.rounded, sizes)) > pool.capacity_bytes
        )

    def _check_not_held_by_hung_copies(self, sizes: Sequence[int]) -> None:
        """CopyTimeoutError where sizes need more room than the arena has outside the
        quarantine: only a hung copy that completes at last could give it back."""
        quarantine = self._state.quarantine
        pool = self.pool
        if not quarantine or pool is None:
            return
        held = quarantine.host_bytes()
        if sum(map(pool.rounded, sizes)) > pool.capacity_bytes - held:
            raise CopyTimeoutError(
                f"put waits for host room that offload copies hold: {held} bytes of the "
                f"{pool.capacity_bytes}-byte arena are quarantined (their copies did not "
                "complete within MMCACHE_COPY_TIMEOUT_SEC), and the room left cannot take it"
            )

    def limit(self) -> int:
        """The largest feature the host tier can take."""
        return self.capacity if self.pool is None else self.pool.max_block_bytes

    def tell_evictions(self, on_evict: Callable[[Entry], None]) -> None:
        """Call on_evict(entry) for each entry the host tier drops to make room, before it
        goes (the remote tier's remote_write=evict writes them)."""
        self._state.tell_host_evictions(on_evict)

    def start(
        self,
        loop: asyncio.AbstractEventLoop,
        defer: Callable[[Sequence[Fence], Callable[[], None]], None],
        on_ready: Callable[[int, int], None],
    ) -> concurrent.futures.Future[Any] | None:
        """Pin the arena in the background; the future to await once, None if the tier is off.

        Each chunk serves as soon as it is pinned: evictions drop only while no pinned
        room exists. defer runs a callback once fences are done (the pool's deferred
        frees); on_ready(capacity, ready) reports the arena's bytes and those pinned so far.
        """
        self._ready = asyncio.Event()
        if self.capacity == 0 and self.node is None:  # a node's ranks all join: a collective
            self._ready.set()
            return None
        lock = threading.Lock()
        latest: list[tuple[torch.Tensor, int]] = []  # the report the loop has not taken yet

        def grow() -> None:
            with lock:
                arena, nbytes = latest.pop()
            self._grow(arena, nbytes, defer, on_ready)

        def pinned(arena: torch.Tensor, nbytes: int) -> bool:  # on the pinning thread
            with lock:
                first = not latest
                latest[:] = [(arena, nbytes)]
            if first:  # one callback at a time: the loop takes the latest report
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody uses it
                    loop.call_soon_threadsafe(grow)
            return self._pin_in_hurry(nbytes)

        if self.node is not None:
            future = self.node.open(pinned)
        else:
            future = self._device.host_arena(self.capacity, pinned)

        def arrived(f: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._arena_ready, f, defer, on_ready)

        future.add_done_callback(arrived)
        return future

    def _pin_in_hurry(self, ready: int) -> bool:
        """Whether the arena should pin its next chunk at once, its first ready bytes
        pinned: while the pinned room left is short of the headroom (PINNED_HEADROOM_BYTES,
        a quarter of a smaller arena), a put waits for room or someone waits for the whole
        arena. Read on the pinning thread: the loop's figures may be a moment old, which
        moves the pace by a chunk at most."""
        pool = self.pool
        if pool is None or self._awaited:
            return True
        headroom = min(PINNED_HEADROOM_BYTES, self.capacity // 4)
        return ready - pool.used_bytes < headroom

    async def wait_ready(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait until the whole arena is pinned (at full speed meanwhile); False if
        timeout passed first or it failed."""
        assert self._ready is not None
        self._awaited += 1
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), timeout)
        finally:
            self._awaited -= 1
        return self.ready

    def _grow(
        self,
        arena: torch.Tensor,
        nbytes: int,
        defer: Callable[[Sequence[Fence], Callable[[], None]], None],
        on_ready: Callable[[int, int], None],
    ) -> None:
        """The arena's first nbytes are pinned: let blocks use them, and wake waiting puts."""
        if self._closed:
            return
        pool = self.pool
        if pool is None and self.node is not None:
            self.pool = pool = self.node.pool(arena, defer=defer, on_free=self._node_freed)
            self._state.attach_pool(pool)
        elif pool is None:
            self.pool = pool = HostPool(
                self._device,
                arena,
                alignment=self._alignment,
                defer=defer,
                on_free=self.wake,
                chunk_bytes=self._device.arena_chunk_bytes,
                ready_bytes=nbytes,
            )
            self._state.attach_pool(pool)
        elif not pool.grow(nbytes):
            return
        on_ready(pool.capacity_bytes, pool.ready_bytes)
        self.wake()

    def _arena_ready(
        self,
        future: concurrent.futures.Future[Any],
        defer: Callable[[Sequence[Fence], Callable[[], None]], None],
        on_ready: Callable[[int, int], None],
    ) -> None:
        if self._closed:
            return
        assert self._ready is not None
        self._ready.set()
        try:
            arena = future.result()
        except Exception as e:
            pool = self.pool
            if pool is None:
                log.error("host arena of %d bytes could not be allocated: %s", self.capacity, e)
            else:  # the chunks pinned so far keep serving
                log.error(
                    "host arena of %d bytes was pinned only in part (%d bytes): %s",
                    self.capacity,
                    pool.ready_bytes,
                    e,
                )
                pool.end_at_ready()
                on_ready(pool.capacity_bytes, pool.ready_bytes)
            self.wake()  # puts waiting for host room give up, or retry what is there
            return
        self._complete = True
        self._grow(arena, arena.numel(), defer, on_ready)
        self.wake()

    async def reserve(
        self, sizes: Sequence[int], wait: bool, blocks: list[HostBlock], landings: _Landings
    ) -> bool:
        """Host blocks (appended to blocks) for a put that bypasses the GPU tier (budget 0).

        All at once or none: a put holding some blocks while it waits for the rest could
        fragment the arena so that the rest never fit. Until enough of the arena is pinned a
        put waits for it (or returns False with wait=False); if it cannot be allocated, False.
        """
        landings.reap()
        if not self._waiters:
            taken = self._allocate_all(sizes)
            if taken is not None:
                blocks.extend(taken)
                return True
        if not wait or self.failed(sizes):
            return False
        self._check_not_held_by_hung_copies(sizes)
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._waiters.append(waiter)
        landings.watch()  # now, not late: landings let us evict their entries
        self._awaited += 1  # the arena pins at full speed while a put waits for room
        try:
            while True:
                await waiter
                if self._closed:  # woken, then close() ran before we resumed
                    raise CacheClosedError("the cache closed while put waited")
                if self.failed(sizes):
                    return False
                taken = self._allocate_all(sizes)
                if taken is None:
                    self._check_not_held_by_hung_copies(sizes)
                if taken is not None:
                    blocks.extend(taken)
                    return True
                waiter = loop.create_future()
                self._waiters.appendleft(waiter)
                landings.watch()  # a report just took us off the line: watch on
        finally:
            self._awaited -= 1
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
        """No put waiting for host room inserts from now on; the arena arriving is ignored,
        and wait_ready() returns (False if the arena was still pinning)."""
        self._closed = True
        if self._ready is not None:
            self._ready.set()

    async def leave_node(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Give up this rank's blocks of the node's shared host tier once no copy uses them
        (close, waiting up to timeout s); the last rank of the node removes its files."""
        node = self.node
        if node is None:
            return
        pool = self.pool
        if pool is not None and pool.blocks_live:
            # A copy still writes (an offload) or reads one of this rank's blocks: left now,
            # another rank could take those bytes while it runs. Leave once the pool has
            # them all back (a copy that never ends: the others sweep this rank at its exit).
            self._unused = unused = asyncio.get_running_loop().create_future()
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(unused), timeout)
            finally:
                in_use = unused.cancel()  # then _node_freed leaves once the last comes back
            if in_use:
                log.warning(
                    "the node's shared host tier keeps %d block(s) of this rank until the "
                    "copies still using them complete",
                    pool.blocks_live,
                )
                return
        node.close()

    def _node_freed(self) -> None:
        """The node's pool gave a block back: wake a put waiting for room, or, where the
        cache is leaving the node and it was the last, leave (leave_node)."""
        unused = self._unused
        pool = self.pool
        if unused is not None and pool is not None and not pool.blocks_live:
            self._unused = None
            if unused.cancelled():  # leave_node gave up waiting
                assert self.node is not None
                self.node.close()
            else:  # leave_node, still waiting, leaves
                unused.set_result(None)
        self.wake()

    def fail_waiters(self) -> None:
        """Raise CacheClosedError in every put waiting for host room."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(CacheClosedError("the cache closed while put waited"))

    def _allocate_all(self, sizes: Sequence[int]) -> list[HostBlock] | None:
        """A host block for each size now, dropping host entries for room, or none."""
        releases: list[Release] = []
        taken = self._state.allocate_host_all(sizes, releases)
        if releases:
            self._carry_out(releases)
        return taken
