"""FeatureCache: the asyncio tiered (GPU -> pinned host) cache of multimodal features."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import math
import threading
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Sequence,
)
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from mmcache.agreement import Agreement, check_group
from mmcache.closing import CloseOnce, off_the_loop
from mmcache.core.entry import Entry, Member, State, check_key, key_list, row_range
from mmcache.core.machine import check_budgets_fit
from mmcache.core.put_checks import check_items, owns_storage
from mmcache.core.thread_hits import GIL_ENABLED, ThreadHits
from mmcache.core.tiers import Tiers
from mmcache.device import Device, Fence, Stream, resolve_device
from mmcache.errors import (
    CacheClosedError,
    CopyTimeoutError,
    InvalidValueError,
    WrongLoopError,
)
from mmcache.host_copy import warm_up as warm_host_copies
from mmcache.layouts import check_strided
from mmcache.metrics import CacheMetrics, DeferredPush, ensure_metrics_server
from mmcache.remote.codec import server_key
from mmcache.remote.tier import remote_tier_for
from mmcache.settings import CacheSettings
from mmcache.single_flight import SingleFlight
from mmcache.stats import CacheStats
from mmcache.threadsafe import run_threadsafe
from mmcache.waiting import FenceWatcher

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["FeatureCache"]

ComputeFn = Callable[[], "torch.Tensor | Awaitable[torch.Tensor]"]
_T = TypeVar("_T")


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
        if group is not None:
            check_group(group)  # before anything is allocated
        self._owns_device = not isinstance(device, Device)
        self._device = resolve_device(device)
        try:
            check_budgets_fit(self.settings, self._device)  # before anything is registered
        except BaseException:
            if self._owns_device:
                self._device.close()
            raise
        self._gpu_capacity = self.settings.gpu_cache_bytes
        self._registry = registry
        self._metrics = CacheMetrics(name, registry)
        self._group = group
        self._agreement: Agreement | None = None
        if group is not None:
            try:
                self._agreement = Agreement(
                    group, cache_name=name, device_name=self._device.name, metrics=self._metrics
                )
            except BaseException:
                self._metrics.close()
                if self._owns_device:
                    self._device.close()
                raise
        self._metrics.set_capacity("gpu", self._gpu_capacity)
        self._tiers = DeferredPush(self._push_tier_gauges)
        self._copy_timeout = self.settings.copy_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._watcher: FenceWatcher | None = None
        self._closed = False
        self._closing = CloseOnce()
        self._core = core = Tiers(
            self.settings,
            self._device,
            self._metrics,
            when_done=self._when_done,
            when_done_lazily=self._when_done_lazily,
            changed=self._tiers.request,
        )
        # The parts a get or put reaches on every call, without a lookup through core.
        self._entries = core.index  # key -> its entry, or its place in a group's entry
        self._counters = core.counters
        self._puts = core.puts
        self._reads = core.reads
        self._turn_reads = core.turn_reads
        self._inflight: SingleFlight[tuple[torch.Tensor, Fence]] = SingleFlight()
        # Resident hits served to other threads without a hand-off to the loop; the loop
        # applies their counts and recency (before each eviction plan, and stats()).
        self._thread_hits = ThreadHits(
            index=core.index,
            device=self._device,
            counters=self._counters,
            gpu_order=core.state.gpu_order,
        )
        core.state.before_plan = self._thread_hits.apply
        # Off with a group (a get is a collective) and without the GIL (see thread_hits).
        self._thread_reads = group is None and GIL_ENABLED
        # The shared third tier (remote_url): asked on local misses, written in the background.
        self._remote = remote_tier_for(
            self.settings,
            name=name,
            core=core,
            device=self._device,
            changed=self._tiers.request,
            metrics=self._metrics,
        )

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind to the running event loop and allocate the host arena (in the background)."""
        if self._closed:
            raise CacheClosedError("this FeatureCache was closed; create a new one")
        if self._loop is not None:
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._thread_hits.bind(
            functools.partial(loop.call_soon_threadsafe, self._thread_hits.apply)
        )
        self._tiers.bind(loop)
        self._core.producers.bind(loop)
        self._core.packings.bind(loop)
        self._watcher = FenceWatcher(loop)
        self._core.pipeline.bind(loop, self._watcher)
        warm_host_copies()  # on the loop's thread, where host reads copy
        port = self.settings.metrics_port
        if port is not None and self._registry is None:
            # One server per process serves every cache on the default registry.
            ensure_metrics_server(port, self.settings.metrics_addr)
        if self._remote is not None:
            self._remote.start()  # warns, in the background, of a server that can fill up
        arena = self._core.host.start(loop, self._when_done, self._host_ready)
        if arena is not None and arena.done():
            await asyncio.sleep(0)  # let the host tier take it: the simulator's is ready now
        self._tiers.request()

    async def close(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Finish queued copies (waiting up to timeout s each step), release everything, stop.

        Every call returns once the whole close has: a caller cancelled meanwhile leaves it
        running, and a later call (or `async with`'s exit) waits for it.
        """
        if not self._closing.begun:
            self._check_loop()
            self._closed = True  # before any await: no put or get starts from here on
            self._core.closing()
        await self._closing.run(functools.partial(self._close, timeout))

    async def _close(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """close()'s work, in a task of its own (see close)."""
        self._tiers.unbind()
        self._core.producers.unbind()
        if self._agreement is not None:
            await self._agreement.close()  # a stuck peer must not hold close() up
        if timeout is None:
            timeout = self._copy_timeout  # a stuck copy must not hang close() for ever
        self._core.fail_waiting()  # and watch landings at once from here on
        for task in self._inflight.running():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), timeout)
        if self._remote is not None:
            await self._remote.close()  # sends what it can within remote_timeout_sec
        remove = self._core.remove
        for found in list(self._entries.values()):
            remove(found)
        if self._watcher is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._core.pipeline.all_landed(), timeout)
        with contextlib.suppress(CopyTimeoutError):
            await self._core.packings.wait_all(timeout)  # one that never ends keeps its values
        self._tiers.request()
        self._metrics.close()
        if self._owns_device:
            # Off the loop: unpinning a large arena takes the driver long enough to stall
            # it (BENCHMARKS.md), and the device also joins its threads.
            await off_the_loop(self._device.close)

    async def wait_host_ready(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until the whole pinned host arena is allocated (it pins in the background).

        The arena serves chunk by chunk as it is pinned (`stats().host_ready_bytes`):
        meanwhile evictions go to the pinned part and drop their entries (counted in
        `dropped`) only where it has no room. Returns False if timeout passed first, or
        if the arena could not be allocated, whole or in part (the error is logged).
        """
        await self._ready_to_serve()
        return await self._core.host.wait_ready(timeout)

    async def __aenter__(self) -> FeatureCache:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def drain(self) -> None:
        """Wait until every queued copy, deferred release and remote write has completed."""
        await self._ready_to_serve()
        core = self._core
        await core.pipeline.all_landed()
        while core.packings:  # a group lost to its packing copy may start more work
            await core.packings.wait_all(None)
            await core.pipeline.all_landed()
        if self._remote is not None:
            await self._remote.drain()

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
        check_key(key)
        if cost is not None:
            cost = _checked_cost(cost)
        if type(value) is not torch.Tensor or value.layout is not torch.strided or value.is_nested:
            check_strided(value, "put()")  # names what is wrong, or lets it pass
        holder = [value]
        del value  # the cache owns it now: no frame of ours keeps it alive past its release
        if self._short_put_applies(key, holder[0]):
            done = await self._puts.put_new(key, holder, stream, wait, cost)
        else:
            if self._closed or self._loop is not asyncio.get_running_loop():
                await self._ready_to_serve()  # starts the cache, or raises the reason
            done = await self._puts.put_batch([(key, holder.pop())], stream, wait, cost)
        if done and self._remote is not None:
            self._remote.stored((key,))
        return done

    def _short_put_applies(self, key: Hashable, value: object) -> bool:
        """Whether Puts.put_new can take this put: a new key, and a device tensor that owns its
        storage and fits the GPU tier, of a cache serving on this loop."""
        return (
            isinstance(value, torch.Tensor)
            and self._device.is_device_tensor(value)  # first: nbytes raises for some layouts
            and 0 < value.nbytes <= self._gpu_capacity
            and key not in self._entries
            and not self._closed
            and self._loop is asyncio.get_running_loop()
            and owns_storage(value)
        )

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
        batch = list(items)
        del items  # the caller's container must not outlive the values the cache now owns
        check_items(batch)
        if not batch:
            return True
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()
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
        keys, rows = self._core.put_checks.check_split(keys, value, split_sizes)
        holder = [value]
        del value  # the cache owns it now: no frame of ours keeps it alive past its release
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()
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
        to_host = False if device is None else self._reads.wants_host(device)
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()
        check_key(key)
        if self._agreement is not None:
            read = functools.partial(self._read_one, key, rows, to_host, stream)
            return (await self._agreement.agree("get", (key,), read))[0]
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

    async def _read_one(
        self, key: Hashable, rows: slice | None, to_host: bool, stream: Stream
    ) -> list[torch.Tensor | None]:
        """get's read of key in this cache alone (local tiers, then the remote one)."""
        found = self._entries.get(key)
        if found is None:
            if self._remote is not None:
                found = await self._remote.fetch(key)
            if found is None:
                self._counters.miss()
                return [None]
        return [await self._reads.serve(found, rows, to_host, stream)]

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
        batch = key_list(keys, "get_many")
        to_host = self._reads.wants_host(device)
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()
        if self._agreement is not None:
            read = functools.partial(self._read_many, batch, to_host, stream)
            return await self._agreement.agree("get_many", batch, read)
        return await self._read_many(batch, to_host, stream)

    async def _read_many(
        self, batch: list[Hashable], to_host: bool, stream: Stream
    ) -> list[torch.Tensor | None]:
        """get_many's reads of batch in this cache alone (local tiers, then the remote one)."""
        if to_host:
            return [(await self._read_one(key, None, True, stream))[0] for key in batch]
        if self._remote is not None:  # what both local tiers miss, asked of the shared one
            await self._remote.fetch_missing(batch)
        return await self._core.batch_reads.get_many(batch, stream)

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
        on every rank or on none (the single flight stays per rank).
        """
        if stream is None:
            stream = self._device.current_stream()
        found = await self.get(key, device=device, rows=rows, stream=stream)
        if found is not None:
            return found
        task = self._inflight.run(key, functools.partial(self._compute, key, fn, stream))
        value, ready = await asyncio.shield(task)
        span = row_range(rows, tuple(value.shape))
        if self._reads.wants_host(device):
            return await self._reads.download(value, ready, span)
        return await self._reads.serve_device(value, ready, span, stream)

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
        """
        if stream is None:
            stream = self._device.current_stream()
        coro = self.put(key, value, stream=stream, wait=wait, cost=cost)
        del value
        return run_threadsafe(self._loop, self._closed, coro, timeout)

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
        return run_threadsafe(
            self._loop,
            self._closed,
            self.get(key, device=device, rows=rows, stream=stream),
            timeout,
        )

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
        next turns (stats() sees it at once).
        """
        if stream is None:
            stream = self._device.current_stream()
        check_key(key)
        if (
            not self._thread_reads
            or self._closed
            or self._loop is None
            or threading.get_ident() == self._loop_thread
        ):
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
        self._check_open()
        self._check_loop()
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
        """
        await self._ready_to_serve()
        check_key(key)
        found = self._entries.get(key)
        if found is None or not self._reads.can_borrow(found):
            yield await self.get(key, device="cpu")
            return
        async with self._reads.borrow(found) as view:
            yield view

    def stats(self) -> CacheStats:
        """A snapshot of the ledger and counters; also audits it for leaked bytes.

        Hits served to other threads are counted in it (the loop applies them first).
        """
        self._apply_thread_hits()
        self._tiers.flush()
        stats = self._core.stats()
        if self._remote is not None:
            remote: dict[str, Any] = self._remote.stats()
            stats = dataclasses.replace(stats, **remote)
        if self._agreement is not None:
            stats = dataclasses.replace(stats, group_misses=self._agreement.misses)
        return stats

    def _apply_thread_hits(self) -> None:
        """Count (and touch) the hits served off the loop so far: on the loop, where it
        runs; from another thread, by asking it and waiting (up to copy_timeout_s)."""
        hits = self._thread_hits
        if not hits.pending:
            return
        loop = self._loop
        if loop is None or self._on_loop_thread() or not loop.is_running() or loop.is_closed():
            hits.apply()  # no loop runs that could change the state meanwhile
            return
        applied = threading.Event()

        def apply() -> None:
            try:
                hits.apply()
            finally:
                applied.set()

        try:
            loop.call_soon_threadsafe(apply)
        except RuntimeError:  # closed just now
            hits.apply()
            return
        applied.wait(self._copy_timeout)

    # --- checks -------------------------------------------------------------------------

    def _on_loop_thread(self) -> bool:
        return threading.get_ident() == self._loop_thread

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("this FeatureCache is closed")

    def _check_loop(self) -> None:
        """Synchronous methods too must run on the cache's own loop (it has no locks)."""
        loop = self._loop
        if loop is None:
            return
        running = asyncio._get_running_loop()
        foreign = running is not loop if running is not None else not self._on_loop_thread()
        if foreign:
            raise WrongLoopError(
                "this FeatureCache belongs to another event loop or thread; use "
                "put_threadsafe()/get_threadsafe() from other threads"
            )

    async def _ready_to_serve(self) -> None:
        if self._closed:
            raise CacheClosedError("this FeatureCache is closed")
        loop = self._loop
        if loop is None:
            await self.start()
        elif asyncio.get_running_loop() is not loop:
            raise WrongLoopError(
                "this FeatureCache belongs to another event loop; call it from the loop "
                "that started it (asyncio.run_coroutine_threadsafe from other threads)"
            )

    def _host_ready(self, capacity: int, ready: int) -> None:
        """The host arena's first ready bytes are pinned: report them and its capacity."""
        self._metrics.set_capacity("cpu", capacity)
        self._metrics.set_host_ready(ready)

    # --- single flight ------------------------------------------------------------------

    async def _compute(
        self, key: Hashable, fn: ComputeFn, stream: Stream
    ) -> tuple[torch.Tensor, Fence]:
        started = time.perf_counter()
        result = fn()
        value = await result if inspect.isawaitable(result) else result
        seconds = time.perf_counter() - started
        del result
        if not isinstance(value, torch.Tensor):
            raise InvalidValueError(
                f"get_or_compute's fn must return a torch.Tensor, not {type(value).__name__}"
            )
        check_strided(value, "get_or_compute()")
        ready = self._device.record(stream)
        # The caller's alias below keeps the tensor valid whatever the cache does next.
        try:
            await self.put(key, value, stream=stream, cost=seconds)
        except BaseException:
            del value  # a failed put's traceback, kept by every caller, must not keep it
            raise
        return value, ready

    # --- bookkeeping --------------------------------------------------------------------

    def _when_done(
        self, fences: Sequence[Fence], callback: Callable[[], None], *, fresh: bool = False
    ) -> None:
        assert self._watcher is not None
        self._watcher.when_done(fences, callback, fresh=fresh)

    def _when_done_lazily(self, fence: Fence, callback: Callable[[], None]) -> None:
        assert self._watcher is not None
        self._watcher.when_done_lazily(fence, callback)

    def _push_tier_gauges(self) -> None:
        """Tier sizes to the metrics (through self._tiers: once per loop iteration)."""
        self._core.push_gauges()


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
