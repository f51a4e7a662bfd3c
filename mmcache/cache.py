"""FeatureCache: the asyncio tiered (GPU -> pinned host) cache of multimodal features."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
from prometheus_client import CollectorRegistry

from mmcache.compute_on_miss import ComputeFn, ComputeOnMiss
from mmcache.core.entry import Entry, Member, State, check_key, key_list
from mmcache.core.put_checks import check_items
from mmcache.core.thread_hits import GIL_ENABLED
from mmcache.device import Device, Stream
from mmcache.errors import InvalidValueError
from mmcache.group_lookups import GroupLookups
from mmcache.layouts import check_strided
from mmcache.lifecycle import Lifecycle
from mmcache.lookups import Lookups
from mmcache.remote.codec import server_key
from mmcache.settings import CacheSettings
from mmcache.stats import CacheStats
from mmcache.threadsafe import run_threadsafe

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["FeatureCache"]


class FeatureCache:
    """A size-bounded, two-tier cache of feature tensors for an asyncio serving loop.

    Hot features stay on the device; cold ones are offloaded to a pinned host
    arena through fenced asynchronous copies and promoted back on use. Every
    read resolves only after the copies it depends on have finished.

    With group= (a torch.distributed ProcessGroup: the ranks of a tensor-parallel group,
    each with its cache), get, get_many and get_or_compute are collectives: every rank
    makes them with the same keys in the same order, and every rank gets the same hits
    (a key missing on any rank is a miss on all). Every other method stays local.
    """

    def __init__(
        self,
        settings: CacheSettings | None = None,
        device: str | Device = "cuda",
        *,
        name: str = "default",
        registry: CollectorRegistry | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        self.settings = settings if settings is not None else CacheSettings()
        self.name = name
        self._group = group
        # What the cache owns, and the loop it serves on, from here to its close.
        self._life = life = Lifecycle(
            self.settings, device, name=name, registry=registry, group=group
        )
        self._device = life.device
        self._remote = life.remote  # the shared third tier (remote_url), or None
        # The parts a get or put reaches on every call, without a lookup through core.
        self._core = core = life.core
        self._entries = core.index  # key -> its entry, or its place in a group's entry
        self._counters = core.counters
        self._puts = core.puts
        self._reads = core.reads
        self._turn_reads = core.turn_reads
        self._thread_hits = life.thread_hits
        self._unapplied = life.thread_hits.unapplied  # read by every call: one attribute
        # Off with a group (a get is a collective) and without the GIL (see thread_hits).
        self._thread_reads = group is None and GIL_ENABLED
        self._lookups = Lookups(core, life.remote)
        self._on_miss = ComputeOnMiss(
            life.inflight, device=self._device, reads=core.reads, put=self.put
        )
        self._group_lookups = (
            None
            if life.agreement is None
            else GroupLookups(life, life.agreement, self._lookups, core.reads, self._on_miss)
        )

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running event loop and allocate the host arena (in the background)."""
        await self._life.start()

    async def close(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Finish queued copies (waiting up to timeout s each step), release everything, stop.

        Every call returns once the whole close has: a caller cancelled meanwhile leaves it
        running, and a later call (or `async with`'s exit) waits for it.
        """
        await self._life.close(timeout)

    async def wait_host_ready(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until the whole pinned host arena is allocated (it pins in the background).

        The arena serves chunk by chunk as it is pinned (`stats().host_ready_bytes`):
        meanwhile evictions go to the pinned part and drop their entries (counted in
        `dropped`) only where it has no room. Returns False if timeout passed first, or
        if the arena could not be allocated, whole or in part (the error is logged).
        """
        await self._life.ready_to_serve()
        return await self._core.host.wait_ready(timeout)

    async def __aenter__(self) -> FeatureCache:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def drain(self) -> None:
        """Wait until every queued copy, deferred release and remote write has completed."""
        await self._life.ready_to_serve()
        await self._life.drain()

    def remote_key(self, key: Hashable) -> bytes:
        """The remote tier's key of key: <len>:<namespace>:<a stable encoding>, in any process."""
        check_key(key)
        return server_key(self.settings.remote_namespace, key)

    @property
    def device(self) -> Device:
        """The device the cache keeps its GPU tier on."""
        return self._device

    @property
    def group(self) -> ProcessGroup | None:
        """The process group whose ranks agree on every lookup's hits (None: no group)."""
        return self._group

    # --- public API ---------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        check_key(key)
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    async def put(
        self,
        key: Hashable,
        value: torch.Tensor,
        *,
        stream: Stream | None = None,
        wait: bool = True,
        cost: float | None = None,
    ) -> bool:
        """Cache value under key, taking ownership of it; wait for budget unless wait=False.

        cost: seconds it takes to compute value again, which eviction_policy="cost" weighs
        (other policies ignore it); unset, that policy charges the mean seconds per byte of
        the features it was given a cost for (put_many and put_split give none).
        Returns False (and drops the value) when wait=False and the tier has no room
        now, or when both tiers are off.
        """
        if stream is None:
            stream = self._device.current_stream()  # read before any await: it is per thread
        if self._unapplied and self._life.serving is asyncio.get_running_loop():
            self._thread_hits.apply()  # hits served to threads first: their recency is older
        check_key(key)
        if cost is not None:
            cost = _checked_cost(cost)
        if type(value) is not torch.Tensor or value.layout is not torch.strided or value.is_nested:
            check_strided(value, "put()")  # names what is wrong, or lets it pass
        holder = [value]
        del value  # the cache owns it now: no frame of ours keeps it alive past its release
        if (
            self._puts.takes_new(key, holder[0])
            and self._life.serving is asyncio.get_running_loop()
        ):
            done = await self._puts.put_new(key, holder, stream, wait, cost)
        else:
            if self._life.serving is not asyncio.get_running_loop():
                await self._life.ready_to_serve()  # starts the cache, or raises the reason
            done = await self._puts.put_batch([(key, holder.pop())], stream, wait, cost)
        if done and self._remote is not None:
            self._remote.stored((key,))
        return done

    async def put_many(
        self,
        items: Iterable[tuple[Hashable, torch.Tensor]],
        *,
        stream: Stream | None = None,
        wait: bool = True,
    ) -> bool:
        """Cache several features at once (an image batch, a video's frames), all or none.

        One reservation covers them all and their offloads share copies, which is what
        makes many small features cheap. Keys must be distinct. Returns False (dropping
        them all) when wait=False and the tier cannot take them all now.
        """
        if stream is None:
            stream = self._device.current_stream()
        if self._unapplied and self._life.serving is asyncio.get_running_loop():
            self._thread_hits.apply()  # hits served to threads first: their recency is older
        batch = list(items)
        del items  # the caller's container must not outlive the values the cache now owns
        check_items(batch)
        if not batch:
            return True
        if self._life.serving is not asyncio.get_running_loop():
            await self._life.ready_to_serve()
        keys = [key for key, _ in batch] if self._remote is not None else []
        done = await self._puts.put_batch(batch, stream, wait)
        if done and self._remote is not None:
            self._remote.stored(keys)
        return done

    async def put_split(
        self,
        keys: Sequence[Hashable],
        value: torch.Tensor,
        split_sizes: Sequence[int],
        *,
        stream: Stream | None = None,
        wait: bool = True,
    ) -> bool:
        """Cache value.split(split_sizes) under keys, all or none, without a tensor per key.

        For an encoder's batch output, whose rows are the features of several items one
        after another. Reads and discards stay per key, as after put_many; the features
        are cached together (one recency slot, one host block, one offload copy) and, when
        value owns its storage and one host block can take it, with no copy at all.
        Returns False (dropping them all) when wait=False and the tier cannot take them now.
        """
        if stream is None:
            stream = self._device.current_stream()
        if self._unapplied and self._life.serving is asyncio.get_running_loop():
            self._thread_hits.apply()  # hits served to threads first: their recency is older
        keys, rows = self._core.put_checks.check_split(keys, value, split_sizes)
        holder = [value]
        del value  # the cache owns it now: no frame of ours keeps it alive past its release
        if self._life.serving is not asyncio.get_running_loop():
            await self._life.ready_to_serve()
        done = await self._puts.put_rows(keys, holder, rows, stream, wait)
        if done and self._remote is not None:
            self._remote.stored(keys)
        return done

    async def get(
        self,
        key: Hashable,
        *,
        device: str | torch.device | None = None,
        rows: slice | None = None,
        stream: Stream | None = None,
    ) -> torch.Tensor | None:
        """The cached tensor (or rows of it), or None on a miss.

        On the device (default) it is usable on `stream` (the current one if None);
        with device="cpu" it is a host copy the caller owns, after any pending offload.
        """
        if stream is None:
            stream = self._device.current_stream()
        if self._unapplied and self._life.serving is asyncio.get_running_loop():
            self._thread_hits.apply()  # hits served to threads first: their recency is older
        if self._group_lookups is not None:  # a collective: no await before its place is taken
            return await self._group_lookups.get(key, device, rows, stream)
        to_host = False if device is None else self._reads.wants_host(device)
        if self._life.serving is not asyncio.get_running_loop():
            await self._life.ready_to_serve()
        check_key(key)
        found = self._entries.get(key)
        if found is None:
            if self._remote is not None:  # both local tiers missed: ask the shared one
                found = await self._remote.fetch(key)
            if found is None:
                self._counters.miss()
                return None
        elif (
            rows is None
            and not to_host
            and (found.group if isinstance(found, Member) else found).state is State.HOST
        ):
            # A host hit: served with the turn's other gets, one copy batch for all.
            return await self._turn_reads.read(key, stream)
        return await self._reads.serve(found, rows, to_host, stream)

    async def get_many(
        self,
        keys: Iterable[Hashable],
        *,
        device: str | torch.device | None = None,
        stream: Stream | None = None,
    ) -> list[torch.Tensor | None]:
        """get() of several keys at once (the images of a request): a list, None per miss.

        Each feature as get returns it; the host-tier hits come back to the device through
        one batch of copies behind one fence. A key given twice is read once.
        """
        if stream is None:
            stream = self._device.current_stream()
        if self._unapplied and self._life.serving is asyncio.get_running_loop():
            self._thread_hits.apply()  # hits served to threads first: their recency is older
        if self._group_lookups is not None:  # a collective: no await before its place is taken
            return await self._group_lookups.get_many(keys, device, stream)
        batch = key_list(keys, "get_many")
        to_host = False if device is None else self._reads.wants_host(device)
        if self._life.serving is not asyncio.get_running_loop():
            await self._life.ready_to_serve()
        if to_host or self._remote is not None:
            return await self._lookups.read_many(batch, to_host, stream)
        # Host hits are read with the other gets of this loop turn: one copy batch, fence
        # and wait.
        return await self._turn_reads.read_many(batch, stream)

    async def get_or_compute(
        self,
        key: Hashable,
        fn: ComputeFn,
        *,
        device: str | torch.device | None = None,
        rows: slice | None = None,
        stream: Stream | None = None,
    ) -> torch.Tensor:
        """get(key), or compute it once for all concurrent callers, cache it and return it.

        fn() returns a device tensor (or an awaitable of one). A caller that is cancelled
        does not cancel the shared computation; its result is cached even with no caller left.
        The result is put with put's cost= measured: the host's wall time from calling fn
        until it returned the tensor (or its awaitable did), so device work that fn queued
        and did not wait for is not in it. With a group, the lookup is the group's: fn runs
        on every rank or on none (a computation of key running here counts as this rank's
        hit, joined where every rank hit); once the ranks agreed on a miss, fn runs on every
        rank even where the caller was cancelled meanwhile.
        """
        if stream is None:
            stream = self._device.current_stream()
        if self._group_lookups is not None:  # a collective: no await before its place is taken
            return await self._group_lookups.get_or_compute(key, fn, device, rows, stream)
        found = await self.get(key, device=device, rows=rows, stream=stream)
        if found is not None:
            return found
        return await self._on_miss.compute(key, fn, device, rows, stream)

    async def _get_noting(
        self, key: Hashable, stream: Stream, note: Callable[[], _N]
    ) -> tuple[torch.Tensor | None, _N]:
        """get(key) with a group, and note() taken in the same step as this rank's read
        (see GroupLookups.get_noting)."""
        assert self._group_lookups is not None
        return await self._group_lookups.get_noting(key, stream, note)

    def put_threadsafe(
        self,
        key: Hashable,
        value: torch.Tensor,
        *,
        stream: Stream | None = None,
        wait: bool = True,
        timeout: float | None = None,
        cost: float | None = None,
    ) -> bool:
        """put() from a thread other than the cache's loop; blocks that thread until done.

        The stream is the calling thread's current one, read here (streams are per thread).
        Past timeout the put is cancelled: TimeoutError means it inserted nothing (and
        never will), True that it completed just before.
        """
        if stream is None:
            stream = self._device.current_stream()
        coro = self.put(key, value, stream=stream, wait=wait, cost=cost)
        del value
        return run_threadsafe(self._life.loop, self._life.closed, coro, timeout)

    def get_threadsafe(
        self,
        key: Hashable,
        *,
        device: str | torch.device | None = None,
        rows: slice | None = None,
        stream: Stream | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor | None:
        """get() from a thread other than the cache's loop; blocks that thread until done.

        A feature resident on the device is served from this thread without waiting for the
        loop (get_resident_threadsafe); anything else is handed to the loop.
        """
        if stream is None:
            stream = self._device.current_stream()
        if device is None:
            out = self.get_resident_threadsafe(key, rows=rows, stream=stream)
            if out is not None:
                return out
        coro = self.get(key, device=device, rows=rows, stream=stream)
        return run_threadsafe(self._life.loop, self._life.closed, coro, timeout)

    def get_resident_threadsafe(
        self,
        key: Hashable,
        *,
        rows: slice | None = None,
        stream: Stream | None = None,
    ) -> torch.Tensor | None:
        """get() of a feature resident on the device, from a thread other than the loop's,
        with no hand-off to the loop: a fresh alias (or rows of it) ordered on stream.

        None where it cannot be served so (not resident, or its producer's fence is not
        done on a device that cannot order the read on stream, or the entry changed while
        it was read, or this is the loop's thread, or the cache is closed or not started,
        or it has a group): call get_threadsafe then, which hands the read to the loop. A
        None is not a miss, and counts nothing; a hit counts as get's does once the loop
        drains the thread hits (within 10 ms; stats() sees it at once).
        """
        if stream is None:
            stream = self._device.current_stream()
        check_key(key)
        life = self._life
        if not self._thread_reads or life.serving is None or threading.get_ident() == life.thread:
            return None
        return self._thread_hits.serve(key, rows, stream)

    def touch(self, key: Hashable) -> bool:
        """Mark key as just used, as a hit does, without reading it; False if absent.

        Never a collective, with a group too: it looks at this rank's cache alone.
        """
        found = self._local_entry(key)
        if found is None:
            return False
        self._reads.touch(found)
        return True

    def _local_entry(self, key: Hashable) -> Entry | Member | None:
        """key's entry in this cache's own tiers (open, on its loop, a valid key), or None."""
        self._life.check_open()
        self._life.check_loop()
        if self._unapplied:
            self._thread_hits.apply()  # hits served to threads first: their recency is older
        check_key(key)
        return self._entries.get(key)

    def discard(self, key: Hashable) -> bool:
        """Remove key; its memory is released after the fences that use it. True if present."""
        found = self._local_entry(key)
        if found is None:
            return False
        self._core.remove(found)
        self._core.room_freed()
        return True

    @contextlib.asynccontextmanager
    async def borrow(self, key: Hashable) -> AsyncIterator[torch.Tensor | None]:
        """Zero-copy host access to a host-resident feature for the duration of the block.

        Yields None on a miss, and a host copy the caller owns for a feature that is
        only on the device, or whose host bytes cross two pinned chunks of the arena (a
        device copy of the view would be refused). Do not keep or write to the tensor
        after the block.

        Never a collective, with a group too: it reads this rank's cache alone.
        """
        stream = self._device.current_stream()
        await self._life.ready_to_serve()
        if self._unapplied:
            self._thread_hits.apply()  # hits served to threads first: their recency is older
        check_key(key)
        found = self._entries.get(key)
        if found is None or not self._reads.can_borrow(found):
            # get(key, device="cpu")'s read, of this rank's tiers alone: no agreement.
            yield (await self._lookups.read_one(key, None, True, stream))[0]
            return
        async with self._reads.borrow(found) as view:
            yield view

    def stats(self) -> CacheStats:
        """A snapshot of the ledger and counters; also audits it for leaked bytes.

        Hits served to other threads are counted in it (the loop applies them first).
        """
        return self._life.stats()


_N = TypeVar("_N")


def _checked_cost(cost: object) -> float:
    """put's cost= as float seconds, or InvalidValueError saying what a cost must be."""
    if isinstance(cost, (int, float)) and not isinstance(cost, bool):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            seconds = float(cost)
            if math.isfinite(seconds) and seconds >= 0:
                return seconds
    raise InvalidValueError(
        f"cost must be a finite number of seconds >= 0 (the time to compute the value "
        f"again), not {cost!r}"
    )


def _leak_gpu_grant_for_tests(cache: FeatureCache, nbytes: int) -> bool:
    """Test-only: take nbytes of GPU budget as a put would, then end without inserting or
    giving it back, as a put path that forgot to would; the audit must count it leaked.

    Returns whether the budget was granted (False: no room now, nothing taken).
    """
    state = cache._core.state
    grant = state.open_grant()
    try:
        return cache._core.evictor.take(nbytes, grant)
    finally:
        state.close_grant(grant)
