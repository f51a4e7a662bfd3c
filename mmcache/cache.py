"""FeatureCache: the asyncio tiered (GPU -> pinned host) cache of multimodal features."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import logging
import math
import operator
import reprlib
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Hashable,
    Iterable,
    Iterator,
    Sequence,
)
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from mmcache.closing import CloseOnce, off_the_loop
from mmcache.device import Device, Fence, Stream, resolve_device
from mmcache.device.base import feature_bytes
from mmcache.entry import Entry, GroupKey, Member, State, check_key, check_keys, row_range
from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    CopyTimeoutError,
    DeviceOutOfMemoryError,
    InvalidKeyError,
    InvalidValueError,
    ReentrantComputeError,
    ValueTooLargeError,
    WrongLoopError,
)
from mmcache.grants import Grant, Grants
from mmcache.host_copy import copy_host_bytes_in_slices
from mmcache.host_copy import warm_up as warm_host_copies
from mmcache.host_pool import HostBlock, HostPool
from mmcache.layouts import check_strided
from mmcache.metrics import CacheMetrics, DeferredPush, ensure_metrics_server
from mmcache.producer_fences import ProducerFences
from mmcache.settings import CacheSettings
from mmcache.stats import CacheStats
from mmcache.waiting import FenceWatcher, wait_fences

__all__ = ["FeatureCache"]

log = logging.getLogger("mmcache")

MiB = 1024 * 1024
_BATCH_BYTES = 8 * MiB  # ≈150 µs of copy at PCIe Gen5 speed per batched offload
# put_many packs features below this size into groups. On the H200 hosts that made 64 KB
# features through put_many 1.8x faster (median of alternating runs) but 1 MB ones about a
# quarter slower than the per-feature batched offload, which they keep (BENCHMARKS.md).
_GROUP_BELOW = 512 * 1024
_PACKED_CHECK_S = 0.002  # how soon an idle loop lets go of the values of finished packings
# How late the waiter thread is asked to report a landing while no put waits for room.
_WATCH_DELAY_S = 0.001
ComputeFn = Callable[[], "torch.Tensor | Awaitable[torch.Tensor]"]
_T = TypeVar("_T")
# The get_or_compute computations this context runs inside: a task copies its creator's
# context, so fn and the tasks it starts see their own computation here.
# Weakly: timers armed inside a computation keep its context, which must not keep the
# task and its value alive.
_computing: ContextVar[frozenset[weakref.ref[asyncio.Task[Any]]]] = ContextVar(
    "mmcache_computing", default=frozenset()
)


@dataclass(slots=True, eq=False)
class _Offload:
    """One queued offload copy: its fence, the entries it moves, when it was queued."""

    fence: Fence
    batch: list[Entry]
    started: float


@dataclass(slots=True, eq=False)
class _Packing:
    """A put_many group's packing copy and the values it reads (group None: a put gave up)."""

    fence: Fence
    values: list[torch.Tensor]
    group: Entry | None
    watched: bool = False  # a fence callback will look again (the loop went idle)


@dataclass(slots=True, eq=False)
class _BudgetWaiter:
    nbytes: int
    future: asyncio.Future[None]
    grant: Grant | None = None  # what a GPU waiter's room is granted into


class FeatureCache:
    """A size-bounded, two-tier cache of feature tensors for an asyncio serving loop.

    Hot features stay on the device; cold ones are offloaded to a pinned host
    arena through fenced asynchronous copies and promoted back on use. Every
    read resolves only after the copies it depends on have finished.
    """

    def __init__(
        self,
        settings: CacheSettings | None = None,
        device: str | Device = "cuda",
        *,
        name: str = "default",
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings if settings is not None else CacheSettings()
        self.name = name
        self._owns_device = not isinstance(device, Device)
        self._device = resolve_device(device)
        self._gpu_capacity = self.settings.gpu_cache_bytes
        self._cpu_capacity = self.settings.cpu_cache_bytes
        self._promote = self.settings.promote_on_hit
        self._small_copy_bytes = self.settings.small_copy_bytes
        # Offloading a little ahead keeps the copy engine busy while the next puts run,
        # instead of each put waiting for the one copy that makes its room.
        self._evict_ahead = int(self._gpu_capacity * self.settings.evict_ahead)
        self._registry = registry
        self._metrics = CacheMetrics(name, registry)
        self._metrics.set_capacity("gpu", self._gpu_capacity)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._host_ready: asyncio.Event | None = None
        self._watcher: FenceWatcher | None = None
        self._pool: HostPool | None = None
        self._closed = False
        self._closing = CloseOnce()
        # key -> its entry, or its place in a put_many group's entry
        self._entries: dict[Hashable, Entry | Member] = {}
        self._done_fence = self._device.completed_fence()
        self._producers = ProducerFences(self._device)
        # Recency per tier only (least recent first); the byte ledger is ours. Every offloaded
        # feature is inserted, evicted and re-inserted here: an OrderedDict does that in
        # 0.5 µs, cachetools' LRUCache (size accounting per item) in 2.2 µs.
        self._gpu_lru: OrderedDict[Hashable, Entry] = OrderedDict()
        self._host_lru: OrderedDict[Hashable, Entry] = OrderedDict()
        self._gpu_waiters: deque[_BudgetWaiter] = deque()
        self._host_waiters: deque[_BudgetWaiter] = deque()
        self._inflight: dict[Hashable, asyncio.Task[tuple[torch.Tensor, Fence]]] = {}

        # GPU ledger: _gpu_used = entries on the device + granted reservations + releasing.
        self._gpu_used = 0
        self._grants = Grants()  # reserved for puts that have not inserted yet
        self._gpu_releasing = 0  # entries being offloaded and tensors released after fences
        self._gpu_released_pending = 0  # the part of _gpu_releasing not owned by an entry
        self._gpu_entries = 0
        self._cpu_entries = 0
        # Every offload in flight (linked or already discarded) -> whether it is GPU-charged.
        self._offloading: dict[Entry, bool] = {}
        # Offload batches not yet handled, in the order queued (and so, on one copy stream,
        # the order they land) -> their landing callbacks.
        self._landing: OrderedDict[_Offload, Callable[[], None]] = OrderedDict()
        self._landing_watched = False  # the waiter thread watches the oldest of them
        self._watch_timer: asyncio.TimerHandle | None = None  # arms that watch a little late
        self._watchdog: asyncio.TimerHandle | None = None  # quarantines overdue offloads
        # Packing copies of put_many groups not yet seen done. The loop looks at them itself
        # (at the next put_many, or once 2 ms later): a fence callback for each would cost a
        # hand-over of the GIL from the waiter thread per group. Only those still running
        # then get a callback, so nothing polls.
        self._packing: list[_Packing] = []
        self._packing_timer: asyncio.TimerHandle | None = None
        # Offloads past copy_timeout_s -> (device bytes, host bytes) they still pin.
        self._quarantined: dict[Entry, tuple[int, int]] = {}
        self._copy_timeout = self.settings.copy_timeout_s
        self._pending = {"d2h": 0, "h2d": 0}
        self._tiers = DeferredPush(self._push_tier_gauges)
        self._c = dict.fromkeys(
            (
                "hits_gpu",
                "hits_cpu",
                "misses",
                "evictions_gpu",
                "evictions_cpu",
                "dropped",
                "d2h_bytes",
                "h2d_bytes",
                "rejected",
                "promotions",
                "copy_failures",
                "alloc_failures",
            ),
            0,
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
        self._tiers.bind(loop)
        self._producers.bind(loop)
        self._watcher = FenceWatcher(loop)
        warm_host_copies()  # on the loop's thread, where host reads copy
        port = self.settings.metrics_port
        if port is not None and self._registry is None:
            # One server per process serves every cache on the default registry.
            ensure_metrics_server(port, self.settings.metrics_addr)
        self._host_ready = asyncio.Event()
        if self._cpu_capacity == 0:
            self._host_ready.set()
        else:
            future = self._device.host_arena_async(self._cpu_capacity)
            future.add_done_callback(lambda f: loop.call_soon_threadsafe(self._arena_ready, f))
            if future.done():
                await asyncio.sleep(0)  # let _arena_ready run: the simulator's arena is ready now
        self._tiers.request()

    async def close(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Finish queued copies (waiting up to timeout s each step), release everything, stop.

        Every call returns once the whole close has: a caller cancelled meanwhile leaves it
        running, and a later call (or `async with`'s exit) waits for it.
        """
        if not self._closing.begun:
            self._check_loop()
            self._closed = True  # before any await: no put or get starts from here on
        await self._closing.run(functools.partial(self._close, timeout))

    async def _close(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """close()'s work, in a task of its own (see close)."""
        self._tiers.unbind()
        self._producers.unbind()
        if self._watch_timer is not None:  # landings are watched at once from here on
            self._watch_timer.cancel()
            self._watch_timer = None
        if timeout is None:
            timeout = self._copy_timeout  # a stuck copy must not hang close() for ever
        for waiters in (self._gpu_waiters, self._host_waiters):
            while waiters:
                w = waiters.popleft()
                if not w.future.done():
                    w.future.set_exception(CacheClosedError("the cache closed while put waited"))
        for task in list(self._inflight.values()):
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), timeout)
        for found in list(self._entries.values()):
            self._remove(found)
        if self._watcher is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_landed(), timeout)
        with contextlib.suppress(CopyTimeoutError):
            await self._packings_done(timeout)  # one that never ends keeps its values
        if self._packing_timer is not None:
            self._packing_timer.cancel()
            self._packing_timer = None
        self._tiers.request()
        self._metrics.close()
        if self._owns_device:
            # Off the loop: unpinning the default 4 GiB arena took the driver 105 ms on the
            # H200 (0.2 ms per registered chunk), and the device also joins its threads.
            await off_the_loop(self._device.close)

    async def wait_host_ready(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until the pinned host arena is allocated (it pins in the background).

        Until then the GPU tier serves as usual and evictions drop their entries
        (counted in `dropped`). Returns False if timeout passed first, or if the
        arena could not be allocated (the error is logged).
        """
        await self._ready_to_serve()
        assert self._host_ready is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._host_ready.wait(), timeout)
        return self._pool is not None or self._cpu_capacity == 0

    async def __aenter__(self) -> FeatureCache:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def drain(self) -> None:
        """Wait until every queued copy and deferred release has completed."""
        await self._ready_to_serve()
        await self._all_landed()
        while self._packing:  # a group lost to its packing copy may start more work
            await self._packings_done(None)
            await self._all_landed()

    async def _all_landed(self) -> None:
        """Wait until every queued offload has landed and been handled, and every other
        callback waiting on fences has run. Watches landings at once, never late."""
        assert self._watcher is not None
        while True:
            self._watch_landings(now=True)
            await self._watcher.idle()
            if not self._landing:
                return

    @property
    def device(self) -> Device:
        """The device the cache keeps its GPU tier on."""
        return self._device

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
    ) -> bool:
        """Cache value under key, taking ownership of it; wait for budget unless wait=False.

        Returns False (and drops the value) when wait=False and the tier has no room
        now, or when both tiers are off.
        """
        if stream is None:
            stream = self._device.current_stream()  # read before any await: it is per thread
        check_key(key)
        check_strided(value, "put()")
        holder = [value]
        del value  # the cache owns it now: no frame of ours keeps it alive past its release
        if self._short_put_applies(key, holder[0]):
            return await self._put_new(key, holder, stream, wait)
        return await self._put_batch([(key, holder.pop())], stream, wait)

    def _short_put_applies(self, key: Hashable, value: object) -> bool:
        """Whether _put_new can take this put: a new key, and a device tensor that owns its
        storage and fits the GPU tier, of a cache serving on this loop."""
        return (
            isinstance(value, torch.Tensor)
            and self._device.is_device_tensor(value)  # first: nbytes raises for some layouts
            and 0 < value.nbytes <= self._gpu_capacity
            and key not in self._entries
            and not self._closed
            and self._loop is asyncio.get_running_loop()
            and _owns_storage(value)
        )

    async def _put_new(
        self, key: Hashable, holder: list[torch.Tensor], stream: Stream, wait: bool
    ) -> bool:
        """put of one new feature (see _short_put_applies) into the GPU tier.

        What _put_batch and _insert_units do for it, without their lists and loops: per
        put, they cost the loop a few µs of its ≈25 a 1 MB feature may take at copy speed.
        A put that must wait for room continues through _insert_units.
        """
        tensor = holder.pop()
        nbytes = tensor.nbytes
        ready = self._producers.fence(stream)
        own = self._device.adopt(tensor, stream)
        del tensor
        grant = self._grants.open()
        try:
            if self._take_gpu(nbytes, grant):
                entry: Entry | None = Entry(
                    key, tuple(own.shape), own.dtype, nbytes, State.GPU, own, ready
                )
                self._grants.settle(grant, nbytes)
            else:
                entry = None
        except BaseException:
            self._return_grant(grant)
            self._give_back([(own, ready)], [], [[]])
            del own  # nor may the traceback of a put that failed keep it alive
            raise
        finally:
            self._grants.close(grant)
        if entry is None:
            return await self._insert_units(
                [key], [], [(0, 1)], [nbytes], [(own, ready)], [[]], ready, wait
            )
        self._entries[key] = entry
        self._gpu_lru[key] = entry
        self._gpu_entries += 1
        # No put waits now (_take_gpu grants nothing ahead of one): none to wake.
        self._tiers.request()
        return True

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
        keys = []
        for item in batch:
            if not isinstance(item, tuple) or len(item) != 2:
                raise InvalidValueError(
                    f"put_many takes (key, tensor) pairs, not {type(item).__name__}"
                )
            check_strided(item[1], "put_many()")
            keys.append(item[0])
        check_keys(keys)  # before hashing: an unhashable key gets a clear error
        if len(set(keys)) != len(batch):
            raise InvalidKeyError("put_many got the same key twice; keys must be distinct")
        if not batch:
            return True
        return await self._put_batch(batch, stream, wait)

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
        if isinstance(keys, (str, bytes)):
            raise InvalidKeyError(
                f"put_split takes a sequence of keys, one per item, not one {type(keys).__name__}"
            )
        keys = list(keys)
        sizes_given = list(split_sizes)
        try:
            rows = list(map(operator.index, sizes_given))
        except TypeError:
            raise InvalidValueError(
                f"split sizes must be a sequence of ints, not {split_sizes!r}"
            ) from None
        check_keys(keys)
        if len(set(keys)) != len(keys):
            raise InvalidKeyError("put_split got the same key twice; keys must be distinct")
        if len(rows) != len(keys):
            raise InvalidValueError(
                f"put_split got {len(keys)} keys and {len(rows)} split sizes; one size per key"
            )
        check_strided(value, "put_split()")
        self._check_value(value, "put_split()")
        if value.dim() == 0:
            raise InvalidValueError("put_split splits a tensor by rows; got a 0-dim tensor")
        if rows and (min(rows) <= 0 or bool in set(map(type, sizes_given))):
            raise InvalidValueError(f"split sizes must be positive ints, got {sizes_given}")
        if sum(rows) != value.shape[0]:
            raise InvalidValueError(
                f"split sizes add up to {sum(rows)} rows; the tensor has {value.shape[0]}"
            )
        holder = [value]
        del value  # the cache owns it now: no frame of ours keeps it alive past its release
        return await self._put_rows(keys, holder, rows, stream, wait)

    async def _put_rows(
        self,
        keys: list[Hashable],
        holder: list[torch.Tensor],
        rows: list[int],
        stream: Stream,
        wait: bool,
    ) -> bool:
        """put_split once its arguments are checked; holder is emptied once the cache owns it.

        The tensor is one unit when one host block can take it; otherwise runs of its
        features up to _BATCH_BYTES each are copied into storage of their own.
        """
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()
        tensor = holder[0]
        row_bytes = tensor.nbytes // tensor.shape[0]
        sizes = [n * row_bytes for n in rows]
        total = tensor.nbytes
        to_gpu = self._gpu_capacity > 0
        if not to_gpu and self._cpu_capacity == 0:
            return False
        self._check_fits(max(sizes), to_gpu)  # one feature too large: names the setting
        self._check_group_fits(total, to_gpu)
        host_limit = self._host_limit()
        if len(keys) == 1 or not host_limit or total <= host_limit:
            spans = [(0, len(keys))]
        else:
            spans = _runs(sizes, None, min(_BATCH_BYTES, host_limit))
        produced = self._producers.fence(stream)
        owned: list[tuple[torch.Tensor, Fence]] = []
        try:
            if len(spans) == 1:
                owned.append(self._own(tensor, stream, produced))
            else:
                starts = [0, *itertools.accumulate(rows)]
                for i, j in spans:
                    owned.append(self._own(tensor[starts[i] : starts[j]], stream, produced))
        except BaseException:
            self._give_back(owned, [], [[] for _ in owned])
            raise
        holder.clear()
        del tensor
        return await self._insert_units(
            keys, rows, spans, sizes, owned, [[] for _ in spans], produced, wait
        )

    async def _put_batch(
        self, items: list[tuple[Hashable, torch.Tensor]], stream: Stream, wait: bool
    ) -> bool:
        """put for one or more features: check all, take all, reserve once, insert all.

        Small features of one put_many that share dtype and row shape become groups
        (_group_spans): each is packed into one device tensor and cached as one entry.
        items is emptied once the cache owns the values.
        """
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()  # starts the cache, or raises the reason
        keys = []
        sizes = []
        to_gpu = self._gpu_capacity > 0
        # Checked in one pass (keys are checked by put and put_many): per feature, every
        # call here is paid thousands of times a second for small features.
        if to_gpu:
            limit: float = self._gpu_capacity
        else:  # both tiers off: put returns False below, once every value is checked
            limit = self._host_limit() if self._cpu_capacity else math.inf
        on_device = self._device.is_device_tensor
        for key, tensor in items:
            keys.append(key)
            if not isinstance(tensor, torch.Tensor) or not on_device(tensor):
                self._check_value(tensor)  # raises, saying what is wrong
            nbytes = tensor.nbytes
            if nbytes == 0 or nbytes > limit:
                self._check_value(tensor)  # raises for an empty tensor
                self._check_fits(nbytes, to_gpu)  # raises, with the setting to change
            sizes.append(nbytes)
        total = sum(sizes)
        if not to_gpu and self._cpu_capacity == 0:
            return False
        self._check_group_fits(total, to_gpu)
        if len(items) == 1:
            spans = [(0, 1)]
        else:
            below = min(self._small_copy_bytes, _GROUP_BELOW)
            spans = _group_spans(items, sizes, below, self._host_limit())
            if self._packing:
                self._reap_packed()  # the values of earlier groups, already read
        # Rows of each feature, for the members' ranges.
        rows = [t.shape[0] if t.dim() else 1 for _, t in items] if len(spans) < len(items) else []
        produced: Fence | None = None  # recorded for single features only: groups have their own
        owned: list[tuple[torch.Tensor, Fence]] = []
        # A group's values, held until its packing copy has read them (none for a single).
        sources: list[list[torch.Tensor]] = []
        try:
            for i, j in spans:
                if j - i == 1:
                    if produced is None:
                        produced = self._producers.fence(stream)
                    owned.append(self._own(items[i][1], stream, produced))
                    sources.append([])
                else:
                    values = [tensor for _, tensor in items[i:j]]
                    owned.append(self._pack(values, stream))
                    sources.append(values)
                    del values
        except BaseException:
            self._give_back(owned, [], sources)
            raise
        # From here on the cache owns the values: no frame of ours (nor a traceback of a
        # failed put) may keep the caller's tensors alive past their release.
        items.clear()
        del tensor
        return await self._insert_units(keys, rows, spans, sizes, owned, sources, produced, wait)

    async def _insert_units(
        self,
        keys: list[Hashable],
        rows: list[int],
        spans: list[tuple[int, int]],
        sizes: list[int],
        owned: list[tuple[torch.Tensor, Fence]],
        sources: list[list[torch.Tensor]],
        produced: Fence | None,
        wait: bool,
    ) -> bool:
        """Second half of a put: reserve room for the owned units, then index them.

        Unit u holds the features keys[i:j] of spans[u] (one entry, or a group whose
        members have rows[i:j] rows each); sources[u] are the values its packing copy
        reads, produced the fence of the producer's stream, if recorded.
        """
        to_gpu = self._gpu_capacity > 0
        total = sum(sizes)
        # Replace first, then reserve: the old values' bytes must not push others out
        # (nor be offloaded for nothing). A put that then fails leaves them absent.
        self._remove_keys(keys, wake=True)
        blocks: list[HostBlock] = []
        grant = self._grants.open()
        try:
            # Without room now, a put waits (yielding to the loop); a put that finds it, the
            # common case, takes it without a coroutine of its own.
            waited = True
            try:
                if to_gpu:
                    ok = self._take_gpu(total, grant)
                    if ok:
                        waited = False
                    elif wait:
                        await self._wait_gpu(total, grant)
                        ok = True
                else:
                    unit_sizes = [sum(sizes[i:j]) for i, j in spans]
                    ok = await self._reserve_host_blocks(unit_sizes, wait, blocks)
            except BaseException:
                self._return_grant(grant)
                self._give_back(owned, blocks, sources)
                raise
            if not ok:
                self._give_back(owned, blocks, sources)
                self._c["rejected"] += len(keys)
                return False
            made: list[Entry] = []
            try:
                offloads, compacted = self._index_units(
                    keys, rows, spans, sizes, owned, sources, produced, blocks, made, waited
                )
            except BaseException:
                # Nothing of a put that fails here stays: its entries leave the index, and
                # its budget and values go back.
                self._unindex(made)
                self._return_grant(grant)
                self._give_back(owned, blocks, sources)
                raise
            if to_gpu:
                self._grants.settle(grant, total)
        finally:
            self._grants.close(grant)
        if to_gpu:
            self._gpu_entries += len(keys)
            if self._gpu_waiters:
                self._wake_gpu()  # the next waiter may need these entries offloaded
        else:
            self._start_offloads(offloads, charged_gpu=False)
        # Our compaction copies may fail (or have failed while we waited for room): such
        # an entry is dropped, once it is in the tier's lists and counts like the others.
        for entry in compacted:
            self._when_done([entry.ready], functools.partial(self._check_ready, entry, entry.ready))
        self._tiers.request()
        return True

    def _index_units(
        self,
        keys: list[Hashable],
        rows: list[int],
        spans: list[tuple[int, int]],
        sizes: list[int],
        owned: list[tuple[torch.Tensor, Fence]],
        sources: list[list[torch.Tensor]],
        produced: Fence | None,
        blocks: list[HostBlock],
        made: list[Entry],
        waited: bool,
    ) -> tuple[list[tuple[Entry, HostBlock]], list[Entry]]:
        """Index a put's units once their room is reserved (appending each entry to made).

        Returns the host-tier offloads to start (GPU tier off) and the entries whose
        compaction copies to check.
        """
        if waited:
            self._remove_keys(keys, wake=False)  # other puts of these keys done meanwhile
        to_gpu = self._gpu_capacity > 0
        offloads: list[tuple[Entry, HostBlock]] = []
        compacted: list[Entry] = []
        entries = self._entries
        for u, ((i, j), (own, ready)) in enumerate(zip(spans, owned, strict=True)):
            if j - i == 1:
                key = keys[i]
                entry = Entry(key, tuple(own.shape), own.dtype, sizes[i], State.GPU, own, ready)
                made.append(entry)
                entries[key] = entry
            else:
                entry = self._insert_group(keys[i:j], rows[i:j], own, ready, sum(sizes[i:j]))
                made.append(entry)
            if sources[u]:
                # Its values stay referenced until the packing copy has read them, and a
                # packing that failed drops the group then.
                self._hold_values(ready, sources[u], entry)
            elif ready is not produced:
                compacted.append(entry)
            if to_gpu:
                self._gpu_lru[entry.key] = entry
            else:
                offloads.append((entry, blocks[u]))
        return offloads, compacted

    def _unindex(self, made: list[Entry]) -> None:
        """Take the entries of a failed put out of the index; its caller gives back the rest."""
        for entry in made:
            self._forget(entry)
            self._gpu_lru.pop(entry.key, None)
            entry.state = State.GONE
            entry.tensor = None

    def _remove_keys(self, keys: list[Hashable], *, wake: bool) -> None:
        """Remove what the index holds under keys (a put replacing them); wake: after each
        removal, let waiting puts use the room it made."""
        entries = self._entries
        if entries.keys().isdisjoint(keys):
            return
        for key in keys:
            old = entries.get(key)
            if old is not None:
                self._remove(old)
                if wake:
                    self._wake_gpu()

    def _insert_group(
        self, keys: list[Hashable], rows: list[int], packed: torch.Tensor, ready: Fence, nbytes: int
    ) -> Entry:
        """Index a packed group: one entry for the tiers, one member per key (keys absent)."""
        group = Entry(
            GroupKey(keys[0], len(keys)),
            tuple(packed.shape),
            packed.dtype,
            nbytes,
            State.GPU,
            packed,
            ready,
            count=len(keys),
        )
        stops = list(itertools.accumulate(rows))
        members = list(map(Member, zip(keys, itertools.repeat(group), [0, *stops], stops)))
        self._entries.update(zip(keys, members, strict=True))
        group.members = members
        return group

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
        to_host = self._wants_host(device)
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()
        check_key(key)
        found = self._entries.get(key)
        if found is None:
            self._c["misses"] += 1
            self._metrics.lookup("miss")
            return None
        member = None
        if isinstance(found, Member):
            member = found
            entry = found.group
            span: tuple[int, int] | None = found.span(row_range(rows, found.shape))
        else:
            entry = found
            span = row_range(rows, entry.shape)
        del found
        state = entry.state
        if state is State.GPU or state is State.D2H:
            self._c["hits_gpu"] += 1
            self._metrics.lookup("hit_gpu")
            if state is State.GPU:
                self._gpu_lru.move_to_end(entry.key)
            assert entry.tensor is not None
            if to_host:
                if state is State.D2H:
                    return await self._read_host(entry, span)
                return await self._download(entry.tensor, entry.ready, span, entry)
            return await self._serve_device(entry.tensor, entry.ready, span, stream)
        self._c["hits_cpu"] += 1
        self._metrics.lookup("hit_cpu")
        self._host_lru.move_to_end(entry.key)
        if to_host:
            return await self._read_host(entry, span)
        return await self._upload(entry, span, stream, member if rows is None else None)

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

        fn() returns a device tensor (or an awaitable of one). The computation is
        shared: a caller that is cancelled does not cancel it, and its result is
        cached even if every caller went away.
        """
        if stream is None:
            stream = self._device.current_stream()
        found = await self.get(key, device=device, rows=rows, stream=stream)
        if found is not None:
            return found
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._compute(key, fn, stream))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._computed(key, t))
        elif weakref.ref(task) in _computing.get():
            # Waiting would be waiting for ourselves: the computation awaits this call.
            raise ReentrantComputeError(
                f"get_or_compute({reprlib.repr(key)}) was called from inside its own fn "
                "(directly or through a task that fn started and awaits), which would wait "
                "for itself for ever; compute the value in fn instead of asking the cache"
            )
        value, ready = await asyncio.shield(task)
        span = row_range(rows, tuple(value.shape))
        if self._wants_host(device):
            return await self._download(value, ready, span)
        return await self._serve_device(value, ready, span, stream)

    def put_threadsafe(
        self,
        key: Hashable,
        value: torch.Tensor,
        *,
        stream: Stream | None = None,
        wait: bool = True,
        timeout: float | None = None,
    ) -> bool:
        """put() from a thread other than the cache's loop; blocks that thread until done.

        The stream is the calling thread's current one, read here (streams are per thread).
        """
        if stream is None:
            stream = self._device.current_stream()
        coro = self.put(key, value, stream=stream, wait=wait)
        del value
        return self._run_threadsafe(coro, timeout)

    def get_threadsafe(
        self,
        key: Hashable,
        *,
        device: str | torch.device | None = None,
        rows: slice | None = None,
        stream: Stream | None = None,
        timeout: float | None = None,
    ) -> torch.Tensor | None:
        """get() from a thread other than the cache's loop; blocks that thread until done."""
        if stream is None:
            stream = self._device.current_stream()
        return self._run_threadsafe(self.get(key, device=device, rows=rows, stream=stream), timeout)

    def _run_threadsafe(self, coro: Coroutine[Any, Any, _T], timeout: float | None) -> _T:
        loop = self._loop
        if loop is None or self._closed:
            coro.close()
            raise CacheClosedError("start the cache on its loop before calling it from threads")
        if asyncio._get_running_loop() is loop:
            coro.close()
            raise WrongLoopError(
                "put_threadsafe()/get_threadsafe() on the cache's own loop would deadlock; "
                "await put()/get() instead"
            )
        future: concurrent.futures.Future[_T] = asyncio.run_coroutine_threadsafe(coro, loop)
        return future.result(timeout)

    def discard(self, key: Hashable) -> bool:
        """Remove key; its memory is released after the fences that use it. True if present."""
        self._check_open()
        self._check_loop()
        check_key(key)
        found = self._entries.get(key)
        if found is None:
            return False
        self._remove(found)
        self._wake_gpu()
        self._tiers.request()
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
        entry = None if found is None else _holder(found)
        if entry is None or entry.block is None or self._pool is None:
            yield await self.get(key, device="cpu")
            return
        block = entry.block
        self._pool.pin(block)
        try:
            if entry.copy_fence is not None:
                self._observe_wait(await self._wait([entry.copy_fence]))
            if isinstance(found, Member):
                view = entry.host_view(*found.span(None), block)
            else:
                view = entry.host_whole(block)
            if self._device.one_pinned_range(view):
                yield view
            else:
                out = await self._host_copy(view)
                del view
                yield out
        finally:
            self._pool.unpin(block)

    def stats(self) -> CacheStats:
        """A snapshot of the ledger and counters; also audits it for leaked bytes."""
        self._tiers.flush()
        leaked = self._audit()
        pool = self._pool
        return CacheStats(
            gpu_bytes=self._gpu_used,
            cpu_bytes=pool.used_bytes if pool else 0,
            gpu_capacity_bytes=self._gpu_capacity,
            cpu_capacity_bytes=pool.capacity_bytes if pool else self._cpu_capacity,
            gpu_entries=self._gpu_entries,
            cpu_entries=self._cpu_entries,
            pending_copies=self._pending["d2h"] + self._pending["h2d"],
            leaked_bytes=leaked["gpu"] + leaked["cpu"],
            quarantined_bytes=sum(g + c for g, c in self._quarantined.values()),
            host_ready=pool is not None or self._cpu_capacity == 0,
            **self._c,
        )

    # --- checks -------------------------------------------------------------------------

    def _wants_host(self, device: str | torch.device | None) -> bool:
        """True for a host read ("cpu"); False for this cache's own device (None or its name)."""
        if device is None:
            return False
        name = str(device)
        if name == "cpu":
            return True
        own = self._device.name
        if name == own or name == own.split(":")[0]:
            return False
        raise InvalidValueError(
            f"get(device={device!r}): this cache returns tensors on {own!r}"
            f"{self._device.tensor_note} (device=None) or host copies (device='cpu'); move the "
            f"result yourself for another device"
        )

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

    def _check_value(self, value: object, caller: str = "put()") -> int:
        nbytes = feature_bytes(self._device, value, caller)
        if nbytes == 0:
            assert isinstance(value, torch.Tensor)
            raise InvalidValueError(f"refusing an empty tensor of shape {tuple(value.shape)}")
        return nbytes

    def _check_fits(self, nbytes: int, to_gpu: bool) -> None:
        if to_gpu and nbytes > self._gpu_capacity:
            raise ValueTooLargeError(
                f"value of {nbytes / MiB:.1f} MB exceeds the GPU tier "
                f"({self._gpu_capacity / MiB:.1f} MB); raise "
                f"{self.settings.how_to_change('gpu_cache_mb')}"
            )
        limit = self._host_limit()
        if not to_gpu and nbytes > limit:
            raise ValueTooLargeError(
                f"value of {nbytes / MiB:.1f} MB exceeds the host tier ({limit / MiB:.1f} MB), "
                f"and the GPU tier is off; raise "
                f"{self.settings.how_to_change('cpu_cache_mb')}"
            )

    def _check_group_fits(self, total: int, to_gpu: bool) -> None:
        """Features put together must fit their tier together: none of them would go in."""
        capacity = self._gpu_capacity if to_gpu else self._cpu_capacity
        if total > capacity:
            tier = "GPU" if to_gpu else "host"
            raise ValueTooLargeError(
                f"features of {total / MiB:.1f} MB in all exceed the {tier} tier "
                f"({capacity / MiB:.1f} MB); put them in smaller groups"
            )

    def _host_limit(self) -> int:
        """The largest feature the host tier can take."""
        return self._cpu_capacity if self._pool is None else self._pool.max_block_bytes

    def _own(self, value: torch.Tensor, stream: Stream, ready: Fence) -> tuple[torch.Tensor, Fence]:
        """The cache's own alias of value; a view of a larger storage is compacted first."""
        if _owns_storage(value):
            return self._device.adopt(value, stream), ready
        # Charging the budget for a view would under-count what it keeps alive: copy it
        # into storage of its own, ordered after the producer on the producer's stream.
        own = self._allocate(tuple(value.shape), value.dtype, stream)
        return own, self._device.copy_d2d(value, own, stream)

    def _pack(self, values: list[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, Fence]:
        """A group's values packed into one device tensor of the cache's own, on stream."""
        with self._counting_oom():
            return self._device.pack(values, stream)

    def _allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, stream: Stream | None = None
    ) -> torch.Tensor:
        """device.empty, counting an out-of-memory failure before it reaches the caller."""
        with self._counting_oom():
            return self._device.empty(shape, dtype, stream)

    @contextlib.contextmanager
    def _counting_oom(self) -> Iterator[None]:
        """Count a device allocation that fails for lack of memory, then let it raise."""
        try:
            yield
        except DeviceOutOfMemoryError:
            self._c["alloc_failures"] += 1
            self._metrics.fault("oom")
            raise

    def _give_back(
        self,
        owned: list[tuple[torch.Tensor, Fence]],
        blocks: list[HostBlock],
        sources: list[list[torch.Tensor]],
    ) -> None:
        """Undo a put that took its values but will not insert them (emptying the lists).

        Emptied because the frames of a put that failed, which its traceback keeps, must
        not keep the values alive past their release.
        """
        assert len(owned) == len(sources)
        while owned:
            own, ready = owned.pop()
            values = sources.pop()
            self._device.release(own, after=[ready])
            del own
            if values:  # a packing copy may still read them
                self._hold_values(ready, values, None)
        for block in blocks:
            assert self._pool is not None
            self._pool.free(block)
        blocks.clear()

    # --- GPU budget ---------------------------------------------------------------------

    def _gpu_free(self) -> int:
        return self._gpu_capacity - self._gpu_used

    def _take_gpu(self, nbytes: int, grant: Grant) -> bool:
        """Reserve nbytes of the GPU tier into grant if it has room now and no put waits
        before us."""
        ahead = self._evict_ahead
        if self._landing and self._gpu_free() < nbytes + ahead:
            self._reap_landed()
        if not self._gpu_waiters and self._gpu_free() + self._gpu_releasing < nbytes + ahead // 2:
            # Below the low-water mark: offload a batch now, so the copies of the next
            # batch overlap with the puts that use the room this one makes. Topping up a
            # batch saves a copy only where a host tier takes it (else it drops more).
            slack = ahead // 2 if self._pool is not None else 0
            self._evict_gpu_for(nbytes + ahead, slack=slack)
        if not self._gpu_waiters and self._gpu_free() >= nbytes:
            self._gpu_used += nbytes
            self._grants.take(grant, nbytes)
            return True
        return False

    def _return_grant(self, grant: Grant) -> None:
        """Give back the GPU budget grant holds (its put will not insert), waking waiters."""
        nbytes = grant.nbytes
        if nbytes:
            self._gpu_used -= nbytes
            self._grants.settle(grant, nbytes)
            self._wake_gpu()

    async def _wait_gpu(self, nbytes: int, grant: Grant) -> None:
        """Wait in line until nbytes of the GPU tier are granted into grant (after _take_gpu
        failed)."""
        assert self._loop is not None
        waiter = _BudgetWaiter(nbytes, self._loop.create_future(), grant)
        self._gpu_waiters.append(waiter)
        self._wake_gpu()  # offloads for us, and grants at once what drops freed
        self._watch_landings()  # now, not late: we wait for the room they make
        try:
            await waiter.future
        except BaseException:
            with contextlib.suppress(ValueError):
                self._gpu_waiters.remove(waiter)
            self._return_grant(grant)  # granted just as we were cancelled: give it back
            self._wake_gpu()
            raise
        if self._closed:  # granted, then close() ran before we resumed: insert nothing
            self._return_grant(grant)
            raise CacheClosedError("the cache closed while put waited")

    def _evict_gpu_for(self, needed: int, *, slack: int = 0) -> None:
        """Offload least recently used entries until needed bytes are free or on their way.

        Features below small_copy_bytes go in batches of about _BATCH_BYTES behind one
        fence: per-copy work (an enqueue, an event, a wake-up on landing) would otherwise
        cap small features far below the copy engine's bandwidth. Up to slack bytes more
        may go to top up a last batch left part full with the next small victims: on its
        own it would pay a copy, a fence and a landing for a few features (a lone 1 MB
        feature's copy took 29 µs of the loop on the H200).
        """
        lru = self._gpu_lru
        small_limit = self._small_copy_bytes
        limit = needed + slack
        batch: list[Entry] = []
        batched = evicted = 0
        while lru:
            have = self._gpu_free() + self._gpu_releasing + batched
            if have >= needed:
                if not batch:
                    break
                oldest = lru[next(iter(lru))]
                if oldest.nbytes >= small_limit or have + oldest.nbytes > limit:
                    break
            _, entry = lru.popitem(last=False)
            evicted += entry.count
            if entry.nbytes < small_limit:
                batch.append(entry)
                batched += entry.nbytes
                if batched >= _BATCH_BYTES:
                    # One fence frees a whole batch: bounded, so room comes back in steps.
                    self._offload_batch(batch)
                    batch, batched = [], 0
            else:
                if batch:  # older victims get their host room first, in LRU order
                    self._offload_batch(batch)
                    batch, batched = [], 0
                self._offload_batch([entry])
        if batch:
            self._offload_batch(batch)
        if evicted:
            self._c["evictions_gpu"] += evicted
            self._metrics.eviction("gpu", evicted)

    def _offload_batch(self, entries: list[Entry]) -> None:
        """Offload GPU entries through one fence, dropping those the host tier cannot take."""
        pool = self._pool
        # One run of blocks for a batch: one search in the pool, not one per feature, and
        # one range for the device to fill. Holes smaller than the batch are left to
        # features placed one by one (large ones, and batches when no range takes them).
        blocks = None
        if pool is not None and len(entries) > 1:
            blocks = pool.allocate_run([e.nbytes for e in entries])
        if blocks is not None:
            items = list(zip(entries, blocks, strict=True))
        else:  # one feature, or no single free range takes them all: one by one
            items = []
            for entry in entries:
                block = self._host_alloc(entry.nbytes)
                if block is None:
                    self._drop(entry)
                else:
                    items.append((entry, block))
        if items:
            self._start_offloads(items, charged_gpu=True)

    def _wake_gpu(self) -> None:
        """Grant waiting puts in arrival order while they fit; offload more for the rest."""
        waiters = self._gpu_waiters
        while True:
            while waiters:
                head = waiters[0]
                if head.future.done():
                    waiters.popleft()
                    continue
                if self._gpu_free() < head.nbytes:
                    break
                waiters.popleft()
                self._gpu_used += head.nbytes
                assert head.grant is not None
                self._grants.take(head.grant, head.nbytes)
                head.future.set_result(None)
            if not waiters:
                return
            free_before = self._gpu_free()
            self._evict_gpu_for(sum(w.nbytes for w in waiters))
            if self._gpu_free() == free_before:
                return  # the rest is on its way (copies in flight)

    def _release_device(self, tensor: torch.Tensor, nbytes: int, after: Sequence[Fence]) -> None:
        """Release a device tensor charged to the GPU tier once after's fences are done."""
        pending = [f for f in after if not f.done()]
        self._device.release(tensor, after=pending)
        if not pending:
            self._gpu_used -= nbytes
            return
        self._gpu_releasing += nbytes
        self._gpu_released_pending += nbytes

        def released() -> None:
            self._gpu_releasing -= nbytes
            self._gpu_released_pending -= nbytes
            self._gpu_used -= nbytes
            self._wake_gpu()
            self._tiers.request()

        self._when_done(pending, released)

    # --- host tier ----------------------------------------------------------------------

    def _arena_ready(self, future: Any) -> None:
        if self._closed or self._watcher is None:
            return
        assert self._host_ready is not None
        self._host_ready.set()
        try:
            arena = future.result()
        except Exception as e:
            log.error("host arena of %d bytes could not be allocated: %s", self._cpu_capacity, e)
            self._wake_host()  # puts waiting for host room (GPU tier off) give up
            return
        self._pool = HostPool(
            self._device,
            arena,
            alignment=self.settings.host_alignment,
            defer=self._when_done,
            on_free=self._wake_host,
            chunk_bytes=self._device.arena_chunk_bytes,
        )
        self._metrics.set_capacity("cpu", self._pool.capacity_bytes)
        self._wake_host()

    def _host_alloc(self, nbytes: int) -> HostBlock | None:
        """A host block now, dropping least recently used host entries if needed; never waits."""
        pool = self._pool
        if pool is None or nbytes > pool.max_block_bytes:
            return None
        while True:
            block = pool.allocate(nbytes)
            if block is not None or not self._host_lru:
                return block
            self._evict_host_head()

    def _evict_host_head(self) -> None:
        """Drop the least recently used host entry (counted as a host-tier eviction)."""
        _, victim = self._host_lru.popitem(last=False)
        self._c["evictions_cpu"] += victim.count
        self._metrics.eviction("cpu", victim.count)
        self._unlink(victim)

    async def _reserve_host_blocks(
        self, sizes: Sequence[int], wait: bool, blocks: list[HostBlock]
    ) -> bool:
        """Host blocks (appended to blocks) for a put that bypasses the GPU tier (budget 0).

        All at once or none: a put holding some blocks while it waits for the rest could
        fragment the arena so that the rest never fit. Until the arena is pinned a put
        waits for it (or returns False with wait=False); if it cannot be allocated, False.
        """
        self._reap_landed()
        if not self._host_waiters:
            taken = self._host_alloc_all(sizes)
            if taken is not None:
                blocks.extend(taken)
                return True
        if not wait or self._host_tier_failed():
            return False
        assert self._loop is not None
        waiter = _BudgetWaiter(sum(sizes), self._loop.create_future())
        self._host_waiters.append(waiter)
        self._watch_landings()  # now, not late: landings let us evict their entries
        try:
            while True:
                await waiter.future
                if self._closed:  # woken, then close() ran before we resumed
                    raise CacheClosedError("the cache closed while put waited")
                if self._host_tier_failed():
                    return False
                taken = self._host_alloc_all(sizes)
                if taken is not None:
                    blocks.extend(taken)
                    return True
                waiter.future = self._loop.create_future()
                self._host_waiters.appendleft(waiter)
                self._watch_landings()  # a report just took us off the line: watch on
        finally:
            with contextlib.suppress(ValueError):
                self._host_waiters.remove(waiter)
            self._wake_host()

    def _host_alloc_all(self, sizes: Sequence[int]) -> list[HostBlock] | None:
        """A host block for each size now, or none (dropping host entries as _host_alloc does).

        One by one first; if that fails, as one run, which an emptied arena always takes.
        None while the arena is not pinned yet.
        """
        if self._pool is None:
            return None
        taken: list[HostBlock] = []
        for nbytes in sizes:
            block = self._host_alloc(nbytes)
            if block is None:
                break
            taken.append(block)
        else:
            return taken
        for block in taken:
            self._pool.free(block)
        if len(sizes) == 1 or sum(sizes) > self._pool.max_block_bytes:
            return None  # no run could take them: evicting more would be for nothing
        while True:
            run = self._pool.allocate_run(sizes)
            if run is not None or not self._host_lru:
                return run
            self._evict_host_head()

    def _host_tier_failed(self) -> bool:
        """The host arena could not be allocated: the host tier will never take anything."""
        ready = self._host_ready
        return self._pool is None and ready is not None and ready.is_set()

    def _wake_host(self) -> None:
        # Host waiters retry their allocation in order; wake the first live one.
        while self._host_waiters:
            head = self._host_waiters.popleft()
            if not head.future.done():
                head.future.set_result(None)
                return

    # --- offload, promotion, release ----------------------------------------------------

    def _start_offloads(
        self, items: Sequence[tuple[Entry, HostBlock]], *, charged_gpu: bool
    ) -> None:
        """Queue the device -> host copies of entries into blocks, after their producers."""
        assert self._pool is not None
        srcs: list[torch.Tensor] = []
        offsets: list[int] = []
        # Producers long finished need no ordering; failed ones must fail the copy too.
        # A put_many group shares one producer fence: look at each fence once.
        readies: list[Fence] = []
        last: Fence | None = None
        for entry, block in items:
            assert entry.tensor is not None
            srcs.append(entry.tensor)
            offsets.append(block.offset)
            ready = entry.ready
            if ready is not last:
                last = ready
                if not ready.done() or ready.exception() is not None:
                    readies.append(ready)
        try:
            fence = self._device.copy_d2h_batch(
                srcs, self._pool.arena, offsets, after=readies, owned=True
            )
        except Exception as e:
            # Refused at enqueue (e.g. no memory for a gather buffer, or a driver error):
            # nothing was queued, so the victims are dropped as if the host tier could not
            # take them, and the put that evicted or inserted them goes on.
            del srcs
            self._copy_failed("offload", None, e)
            for entry, block in items:
                self._pool.free(block)
                if charged_gpu:
                    self._drop(entry)
                else:  # a put straight to the host tier: nothing was charged to the GPU tier
                    self._count_dropped(self._forget(entry))
                    entry.state = State.GONE
                    tensor, entry.tensor = entry.tensor, None
                    assert tensor is not None
                    self._device.release(tensor, after=[entry.ready])
            return
        del srcs  # the entries keep the sources alive until the copy has landed
        started = time.perf_counter()
        offloading = self._offloading
        features = 0
        for entry, block in items:
            entry.state = State.D2H
            entry.block = block
            entry.copy_fence = fence
            offloading[entry] = charged_gpu
            features += entry.count
        batch = [entry for entry, _ in items]
        nbytes = sum(entry.nbytes for entry in batch)
        self._cpu_entries += features
        if charged_gpu:
            self._gpu_releasing += nbytes
        self._copy_started("d2h", features)

        offload = _Offload(fence, batch, started)

        def landed() -> None:
            self._copy_finished("d2h", nbytes, started, features)
            # Asked once: a batch's fence may be many fences (simulator).
            self._offloads_done(batch, fence.exception(), charged_gpu)
            if charged_gpu:
                self._wake_gpu()
            elif self._host_waiters:  # a put straight to the host tier can evict them now
                self._wake_host()
            self._tiers.request()

        self._landing[offload] = landed
        self._watch_landings()
        if self._watchdog is None:
            self._arm_watchdog(started + self._copy_timeout)

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
                    self._quarantine(entry, offload.fence)

    def _reap_landed(self) -> None:
        """Handle offloads that have landed, oldest first, without waiting to be told.

        A put short of room looks here first, and often finds its room already copied out.
        A landing that raises goes to the loop's exception handler, as a raising callback
        would: it must not fail the put that happened to reap it, nor stop the reaping.
        """
        landing = self._landing
        while landing:
            offload, landed = next(iter(landing.items()))
            if not offload.fence.done():
                return
            del landing[offload]
            try:
                landed()
            except Exception as exc:
                assert self._loop is not None
                self._loop.call_exception_handler(
                    {"message": "mmcache: handling a landed offload failed", "exception": exc}
                )

    def _watch_landings(self, *, now: bool = False) -> None:
        """Have the device's waiter thread report when the oldest queued offload lands.

        One watch at a time, not one per offload: a report takes the GIL on the waiter
        thread, and a busy loop pays for that hand-over in its next torch call (a 4-9 µs
        copy enqueue took 17-24 µs on the H200 with a waiter reporting each copy). A
        loop that keeps putting reaps landings itself; the watch serves an idle loop and
        puts waiting for room. It is armed at once while a put waits for room (or with
        now), else _WATCH_DELAY_S later and only if landings are still unhandled then:
        a loop that yields between batches of puts would otherwise take a report per
        landing (1 MB features put 8 MiB between yields on the H200: 34-38 GB/s with
        them, 40-43 without, the median rounds of three alternating pairs).
        """
        if self._landing_watched or not self._landing:
            return
        if not (now or self._gpu_waiters or self._host_waiters):
            if self._watch_timer is None and not self._closed:
                assert self._loop is not None
                self._watch_timer = self._loop.call_later(_WATCH_DELAY_S, self._watch_late)
            return
        self._landing_watched = True
        oldest = next(iter(self._landing))
        # Fresh: the oldest was queued just now, or was just seen still copying. Armed
        # after waits for later copies, it is not held behind them (Fence.add_done_callback).
        self._when_done([oldest.fence], self._landing_reported, fresh=True)

    def _watch_late(self) -> None:
        """The delayed watch: handle what has landed, then watch the rest at once."""
        self._watch_timer = None
        try:
            self._reap_landed()
        finally:
            self._watch_landings(now=True)

    def _landing_reported(self) -> None:
        # Still marked watched while reaping: offloads the landings start need no watch
        # of their own until the reap has found the oldest one still copying.
        try:
            self._reap_landed()
        finally:  # a landing that raised must not leave the rest unwatched
            self._landing_watched = False
            self._watch_landings()

    def _offloads_done(
        self, batch: list[Entry], failed: BaseException | None, charged_gpu: bool
    ) -> None:
        """An offload copy has finished: its entries become host-resident, or are lost.

        Runs once per landed copy for all its features; the ledger moves once per batch.
        """
        offloading = self._offloading
        quarantined = self._quarantined
        host_lru = self._host_lru
        release = self._device.release
        done_fence = self._done_fence
        moved = released = features = 0
        for entry in batch:
            del offloading[entry]
            features += entry.count
            if quarantined:
                quarantined.pop(entry, None)  # a late fence: its bytes come back now
            tensor, entry.tensor = entry.tensor, None
            assert tensor is not None
            nbytes = entry.nbytes
            moved += nbytes
            # A host get's download may still read the device tensor.
            readers = entry.device_readers_pending() if entry.device_readers else None
            if readers and charged_gpu:
                self._release_device(tensor, nbytes, readers)
            else:
                release(tensor, readers or ())
                released += nbytes
            if entry.state is State.D2H and failed is None:
                entry.state = State.HOST
                # Both copies are done and good: a shared finished fence stands in for them,
                # so a host entry keeps no CUDA event (nor the batch's fence) alive.
                entry.copy_fence = entry.ready = done_fence
                host_lru[entry.key] = entry
            else:
                self._offload_lost(entry, failed)
        if charged_gpu:
            self._gpu_releasing -= moved
            self._gpu_entries -= features
            self._gpu_used -= released
        if failed is None:
            self._c["d2h_bytes"] += moved

    def _offload_lost(self, entry: Entry, failed: BaseException | None) -> None:
        """An offloaded entry that was discarded meanwhile, or whose copy failed."""
        if entry.state is State.D2H:  # the copy failed: the feature is lost
            self._copy_failed("offload", entry.key, failed)
            self._count_dropped(self._forget(entry))
            entry.state = State.GONE
        self._free_block(entry)

    def _quarantine(self, entry: Entry, fence: Fence) -> None:
        """An offload past copy_timeout_s: drop its entry, keep its bytes reserved as leaked.

        The copy may still run and read the tensor or write the block, so neither can be
        reused; if its fence completes later, _offloads_done releases both.
        """
        if fence.done() or entry not in self._offloading or entry in self._quarantined:
            return
        block = entry.block
        self._quarantined[entry] = (
            entry.nbytes if self._offloading[entry] else 0,
            block.nbytes if block is not None else 0,
        )
        log.error(
            "offload of %r did not complete within %g s (MMCACHE_COPY_TIMEOUT_SEC): entry "
            "dropped, its %d bytes quarantined",
            entry.key,
            self._copy_timeout,
            entry.nbytes,
        )
        self._metrics.fault("quarantined")
        lost = self._forget(entry)
        if lost:
            self._count_dropped(lost)
        entry.state = State.GONE
        self._tiers.request()

    def _copy_failed(self, what: str, key: Hashable | None, exc: BaseException | None) -> None:
        """Count a failed copy (every direction) for stats and operators."""
        # A string, not the exception: a log handler keeping the record would otherwise keep
        # its traceback, and every frame and tensor in it, alive.
        log.warning("%s copy of %r failed: %s", what, key, str(exc))
        self._c["copy_failures"] += 1
        self._metrics.fault("copy_failed")

    def _lose(self, entry: Entry) -> None:
        """Drop an entry whose data a failed copy destroyed, and hand its room on."""
        self._drop(entry)
        self._wake_gpu()
        self._tiers.request()

    def _hold_values(self, fence: Fence, values: list[torch.Tensor], group: Entry | None) -> None:
        """Keep a group's values until its packing copy (fence) has read them."""
        self._packing.append(_Packing(fence, values, group))
        self._arm_packing_timer()

    def _arm_packing_timer(self) -> None:
        if self._packing_timer is None and not self._closed:
            assert self._loop is not None
            self._packing_timer = self._loop.call_later(_PACKED_CHECK_S, self._packing_timeout)

    def _packing_timeout(self) -> None:
        """The loop's second look: packings still running get a fence callback each."""
        self._packing_timer = None
        self._reap_packed()
        for packing in self._packing:
            if not packing.watched:
                packing.watched = True
                self._when_done([packing.fence], self._reap_packed)

    def _reap_packed(self) -> None:
        """Let go of the values of finished packing copies; drop groups whose copy failed.

        Every record is looked at: packings on different streams finish in any order.
        (Each one still running is covered: by the timer its put armed, or by a callback.)
        """
        running = []
        for packing in self._packing:
            if not packing.fence.done():
                running.append(packing)
            elif packing.group is not None:
                self._check_ready(packing.group, packing.fence)
        self._packing = running

    async def _packings_done(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """Wait for every packing copy queued so far, then let go of their values.

        Raises CopyTimeoutError if one is not done within timeout (it keeps its values).
        """
        while self._packing:
            fences = [packing.fence for packing in self._packing]
            try:
                await wait_fences(fences, timeout)
            except CopyTimeoutError:
                raise
            except CopyFailedError:
                pass  # its group is dropped below
            self._reap_packed()

    def _check_ready(self, entry: Entry, ready: Fence) -> None:
        """A put whose producing copy failed (a compaction) must not serve poison: drop it."""
        if ready.exception() is None or entry.ready is not ready:
            return
        self._copy_failed("compaction", entry.key, ready.exception())
        if entry.state is not State.GONE:
            self._lose(entry)

    def _drop(self, entry: Entry) -> None:
        """Lose an entry (a GPU one the host tier cannot take now, or a destroyed one)."""
        self._count_dropped(entry.count)
        self._unlink(entry)

    def _count_dropped(self, features: int = 1) -> None:
        """Features the cache lost: the stats counter and the metric move together."""
        self._c["dropped"] += features
        self._metrics.dropped(features)

    def _remove(self, found: Entry | Member) -> None:
        """Remove a key's feature: its entry, or its place in a group."""
        if isinstance(found, Member):
            self._leave_group(found)
        else:
            self._unlink(found)

    def _leave_group(self, member: Member) -> None:
        """Remove a member from the index; its group goes with its last member.

        Its rows stay charged to the group's tier until then: a group is one block of
        memory on either side, and slicing it would cost the copies it saves.
        """
        if self._entries.get(member.key) is not member:
            return
        del self._entries[member.key]
        group = member.group
        group.count -= 1
        state = group.state
        if state is State.GPU:
            self._gpu_entries -= 1
        elif state is State.HOST:
            self._cpu_entries -= 1
        elif state is State.D2H:  # counted in the host tier since queued, in the GPU one if charged
            self._cpu_entries -= 1
            if self._offloading.get(group):
                self._gpu_entries -= 1
        if group.count == 0:
            self._unlink(group)

    def _forget(self, entry: Entry) -> int:
        """Remove entry's keys (a group's: its members') from the index; how many there were."""
        entries = self._entries
        if entry.members is None:
            if entries.get(entry.key) is entry:
                del entries[entry.key]
                return 1
            return 0
        forgotten = 0
        for member in entry.members:
            if entries.get(member.key) is member:
                del entries[member.key]
                forgotten += 1
        # Members name their group: without this the two would die only by the cyclic
        # collector (whose pauses grow with the objects it walks).
        entry.members = []
        return forgotten

    def _unlink(self, entry: Entry) -> None:
        """Remove entry from the index and release what it holds after its fences."""
        self._forget(entry)
        state, entry.state = entry.state, State.GONE
        if state is State.GPU:
            self._gpu_lru.pop(entry.key, None)
            self._gpu_entries -= entry.count
            tensor, entry.tensor = entry.tensor, None
            assert tensor is not None
            self._release_device(
                tensor, entry.nbytes, [entry.ready, *entry.device_readers_pending()]
            )
        elif state is State.HOST:
            self._host_lru.pop(entry.key, None)
            self._free_block(entry)
        # State.D2H: _offloads_done releases both sides once the copy has finished.

    def _free_block(self, entry: Entry) -> None:
        block, entry.block = entry.block, None
        if block is not None and self._pool is not None:
            self._cpu_entries -= entry.count
            self._pool.free(block, after=entry.readers_pending())

    # --- reads --------------------------------------------------------------------------

    async def _serve_device(
        self, tensor: torch.Tensor, ready: Fence, span: tuple[int, int] | None, stream: Stream
    ) -> torch.Tensor:
        """A fresh alias (or row view) of a device tensor, ordered after ready on stream."""
        # The alias exists before any wait: a reader holds what it will read, so a release
        # that lands meanwhile cannot recycle it.
        out = tensor.detach() if span is None else tensor[span[0] : span[1]]
        if ready.done():
            # Checked here, not before the alias: a copy that failed in between must not
            # slip through as done.
            if ready.exception() is not None:
                del out
                _raise_if_failed(ready)
        else:
            if self._device.stream_ordered_reads:
                self._device.wait_on(stream, ready)
            else:
                try:
                    self._observe_wait(await self._wait([ready]))
                except BaseException:
                    del out  # a cancelled read must not keep it alive through its traceback
                    raise
        self._device.use_on(out, stream)
        return out

    async def _download(
        self,
        tensor: torch.Tensor,
        ready: Fence,
        span: tuple[int, int] | None,
        entry: Entry | None = None,
    ) -> torch.Tensor:
        """A host copy the caller owns of a device tensor (or rows of it)."""
        _raise_if_failed(ready)
        src = tensor if span is None else tensor[span[0] : span[1]]
        dst = self._device.host_empty(tuple(src.shape), src.dtype)
        fence = self._device.copy_d2h(src, dst, after=[ready])
        if entry is not None:
            # A release of the tensor waits for this copy too.
            entry.add_device_reader(fence)
        del src
        started = time.perf_counter()
        self._copy_started("d2h")
        try:
            self._observe_wait(await self._wait([fence]))
        except CopyTimeoutError:
            raise
        except CopyFailedError as e:
            self._copy_failed("download", entry.key if entry else None, e)
            raise
        finally:
            if fence.done():
                self._copy_finished("d2h", dst.nbytes, started)
            else:  # cancelled: account for it when it lands
                self._when_done([fence], lambda: self._copy_finished("d2h", dst.nbytes, started))
        return dst

    async def _read_host(self, entry: Entry, span: tuple[int, int] | None) -> torch.Tensor:
        """A copy the caller owns of (rows of) the host copy, after the offload completes."""
        block = entry.block
        fence = entry.copy_fence
        pool = self._pool
        assert block is not None and pool is not None and fence is not None
        pool.pin(block)  # a discard while we wait must not recycle the block under us
        try:
            try:
                self._observe_wait(await self._wait([fence]))
            except CopyTimeoutError:
                self._quarantine(entry, fence)
                raise
            view = entry.host_whole(block) if span is None else entry.host_view(*span, block)
            return await self._host_copy(view)
        finally:
            pool.unpin(block)

    async def _host_copy(self, view: torch.Tensor) -> torch.Tensor:
        """A copy the caller owns of a view of the arena (pinned before this is called).

        Caller-owned, as a download's is: from torch's cache of pinned blocks on CUDA (no
        page faults once warm; a later upload of it is asynchronous). Copied a slice per
        loop turn (mmcache.host_copy), so a large one does not hold the loop: by memcpy,
        1 MiB a turn, or, once a burst of reads repays waking them and unless they stalled
        lately, on torch's intra-op threads, 1 MiB per thread a turn.
        """
        out = self._device.host_empty(tuple(view.shape), view.dtype)
        await copy_host_bytes_in_slices(out, view)
        return out

    async def _upload(
        self,
        entry: Entry,
        span: tuple[int, int] | None,
        stream: Stream,
        member: Member | None = None,
    ) -> torch.Tensor:
        """A device copy of a host-resident entry (or of rows of it, or of a whole group
        member); promotes the entry or the member back to the GPU tier if it fits."""
        assert entry.block is not None and entry.copy_fence is not None
        promote = (
            (span is None or member is not None)
            and self._promote
            and not self._gpu_waiters
            and self._gpu_free() >= (entry.nbytes if member is None else member.nbytes)
        )
        start, stop = span if span is not None else (0, entry.shape[0] if entry.shape else 1)
        src = entry.host_whole() if span is None else entry.host_view(start, stop)
        dst = self._allocate(tuple(src.shape), entry.dtype)
        try:
            fence = self._device.copy_h2d(src, dst, after=[entry.copy_fence])
        except BaseException:
            self._device.release(dst, after=())  # nothing was queued: nothing reads it
            raise
        del src
        entry.add_host_reader(fence)
        started = time.perf_counter()
        self._copy_started("h2d")
        nbytes = dst.nbytes
        if promote and member is not None:
            # The member leaves its group as an entry of its own, made from this copy.
            entry = self._promote_member(member, dst, fence)
        self._when_done([fence], lambda: self._upload_done(entry, fence, nbytes, started))
        if promote:
            if member is None:
                self._promote_entry(entry, dst, fence)
            return await self._serve_device(dst, fence, None, stream)
        try:
            return await self._serve_device(dst, fence, None, stream)
        except CopyTimeoutError:
            self._metrics.fault("quarantined")  # dst and the host block stay pinned by it
            raise
        finally:
            self._device.release(dst, after=[fence])  # the caller's alias keeps it alive

    def _upload_done(self, entry: Entry, fence: Fence, nbytes: int, started: float) -> None:
        self._copy_finished("h2d", nbytes, started)
        if fence.exception() is None:
            self._c["h2d_bytes"] += nbytes
            return
        self._copy_failed("upload", entry.key, fence.exception())
        if entry.state is State.GPU and entry.ready is fence:
            self._lose(entry)  # promoted from a copy that failed: the data is gone

    def _promote_member(self, member: Member, tensor: torch.Tensor, fence: Fence) -> Entry:
        """A GPU-resident entry of its own for a group member, from its uploaded rows."""
        group = member.group
        shape, nbytes = member.shape, member.nbytes
        entry = Entry(member.key, shape, group.dtype, nbytes, State.GPU, tensor, fence)
        self._leave_group(member)
        self._entries[entry.key] = entry
        self._promoted(entry)
        return entry

    def _promote_entry(self, entry: Entry, tensor: torch.Tensor, fence: Fence) -> None:
        """Make entry GPU-resident again (exclusive tiers: its host block is freed)."""
        self._host_lru.pop(entry.key, None)
        self._free_block(entry)
        entry.state = State.GPU
        entry.tensor = tensor
        entry.ready = fence
        entry.copy_fence = None
        self._promoted(entry)

    def _promoted(self, entry: Entry) -> None:
        """Charge a promoted GPU-state entry to the GPU tier, most recently used."""
        self._gpu_used += entry.nbytes
        self._gpu_entries += 1
        self._gpu_lru[entry.key] = entry
        self._c["promotions"] += 1
        self._tiers.request()

    # --- single flight ------------------------------------------------------------------

    async def _compute(
        self, key: Hashable, fn: ComputeFn, stream: Stream
    ) -> tuple[torch.Tensor, Fence]:
        task = asyncio.current_task()
        assert task is not None
        # This task's own context, which fn and the tasks it starts share or copy.
        _computing.set(_computing.get() | {weakref.ref(task)})
        del task  # a failure's traceback must not hold the task, and through it the value
        result = fn()
        value = await result if inspect.isawaitable(result) else result
        del result
        if not isinstance(value, torch.Tensor):
            raise InvalidValueError(
                f"get_or_compute's fn must return a torch.Tensor, not {type(value).__name__}"
            )
        check_strided(value, "get_or_compute()")
        ready = self._device.record(stream)
        # The caller's alias below keeps the tensor valid whatever the cache does next.
        try:
            await self.put(key, value, stream=stream)
        except BaseException:
            del value  # a failed put's traceback, kept by every caller, must not keep it
            raise
        return value, ready

    def _computed(self, key: Hashable, task: asyncio.Task[tuple[torch.Tensor, Fence]]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled() and task.exception() is not None:
            log.debug("get_or_compute(%r) failed: %s", key, task.exception())

    # --- bookkeeping --------------------------------------------------------------------

    async def _wait(self, fences: Sequence[Fence]) -> float:
        """wait_fences bounded by copy_timeout_s (a fence that never completes fails the read)."""
        return await wait_fences(fences, self._copy_timeout)

    def _when_done(
        self, fences: Sequence[Fence], callback: Callable[[], None], *, fresh: bool = False
    ) -> None:
        assert self._watcher is not None
        self._watcher.when_done(fences, callback, fresh=fresh)

    def _copy_started(self, direction: str, count: int = 1) -> None:
        self._pending[direction] += count
        self._metrics.copy_started(direction, count)

    def _copy_finished(self, direction: str, nbytes: int, started: float, count: int = 1) -> None:
        """count features of nbytes in all, moved by one copy queued at started."""
        self._pending[direction] -= count
        self._metrics.copy_finished(direction, nbytes, time.perf_counter() - started, count)

    def _observe_wait(self, seconds: float) -> None:
        if seconds:
            self._metrics.get_wait(seconds)

    def _push_tier_gauges(self) -> None:
        """Tier sizes to the metrics (through self._tiers: once per loop iteration)."""
        self._metrics.set_tier("gpu", self._gpu_used, self._gpu_entries)
        pool = self._pool
        self._metrics.set_tier("cpu", pool.used_bytes if pool else 0, self._cpu_entries)

    def _entry(self, key: Hashable) -> Entry:
        """The entry that holds key's feature (its group's, for a member); KeyError if none."""
        return _holder(self._entries[key])

    def _held_entries(self) -> list[Entry]:
        """Every entry the index reaches, once each (a group once for all its members)."""
        held = {}
        for found in self._entries.values():
            entry = _holder(found)
            held[id(entry)] = entry
        return list(held.values())

    def _audit(self) -> dict[str, int]:
        """Bytes in the ledgers that no entry, copy or pending release owns (should be 0)."""
        # Granted bytes count as owned only while the put they were granted to runs.
        gpu_owned = self._grants.held_bytes() + self._gpu_released_pending
        holders = {id(e): e for e in self._held_entries()}
        for e, charged in self._offloading.items():
            holders[id(e)] = e  # discarded while offloading: still holds both sides
            if charged:
                gpu_owned += e.nbytes
        cpu_owned = 0
        for e in holders.values():
            if e.state is State.GPU:
                gpu_owned += e.nbytes
            if e.block is not None:
                cpu_owned += e.block.nbytes
        pool = self._pool
        cpu_used = pool.used_bytes - pool.freeing_bytes if pool else 0
        leaked = {"gpu": self._gpu_used - gpu_owned, "cpu": cpu_used - cpu_owned}
        for gpu_bytes, cpu_bytes in self._quarantined.values():  # owned, but maybe never back
            leaked["gpu"] += gpu_bytes
            leaked["cpu"] += cpu_bytes
        for tier, nbytes in leaked.items():
            self._metrics.set_leaked(tier, nbytes)
        return leaked


def _owns_storage(value: torch.Tensor) -> bool:
    """Whether the cache may hold value itself: it is its whole storage, contiguous.

    Not a lazy conjugate (or negation) either: its bytes are not its values, and offloads
    copy bytes. Anything else is compacted at put.
    """
    return (
        value.is_contiguous()
        and value.untyped_storage().nbytes() == value.nbytes
        and not value.is_conj()
        and not value.is_neg()
    )


def _raise_if_failed(ready: Fence) -> None:
    """A feature whose producing copy already failed is an error to read, never poison."""
    if ready.done() and ready.exception() is not None:
        raise CopyFailedError(f"the copy that made this feature failed: {ready.exception()}")


def _holder(found: Entry | Member) -> Entry:
    """The entry that holds a key's feature: its own, or its group's."""
    return found.group if isinstance(found, Member) else found


def _group_spans(
    items: Sequence[tuple[Hashable, torch.Tensor]],
    sizes: Sequence[int],
    small_bytes: int,
    host_limit: int,
) -> list[tuple[int, int]]:
    """put_many's units: runs of small features of one dtype and row shape, up to
    _BATCH_BYTES a run (and what one host block can take); others alone.
    """
    cap = min(_BATCH_BYTES, host_limit) if host_limit else _BATCH_BYTES
    # A scalar has no rows to stack: never in a group.
    kinds = [
        (t.dtype, t.shape[1:]) if n < small_bytes and t.dim() else None
        for (_, t), n in zip(items, sizes, strict=True)
    ]
    return _runs(sizes, kinds, cap)


def _runs(
    sizes: Sequence[int], kinds: Sequence[object | None] | None, cap: int
) -> list[tuple[int, int]]:
    """Index ranges of features to cache together: runs of alike ones (the same kind, not
    None; all alike when kinds is None) up to cap bytes a run; others alone.

    A group is one tensor on the device, so its features need no copy of their own when
    offloaded, nor entry, recency slot, host block or landing of their own.
    """
    spans = []
    first = 0
    run_bytes = 0
    kind: object | None = None
    for i, nbytes in enumerate(sizes):
        mine = True if kinds is None else kinds[i]
        if mine is None or mine != kind or run_bytes + nbytes > cap:
            if i > first:
                spans.append((first, i))
            first = i
            run_bytes = 0
        kind = mine
        run_bytes += nbytes
    spans.append((first, len(sizes)))
    return spans


def _leak_gpu_grant_for_tests(cache: FeatureCache, nbytes: int) -> bool:
    """Test-only: take nbytes of GPU budget as a put would, then end without inserting or
    giving it back, as a put path that forgot to would; the audit must count it leaked.

    Returns whether the budget was granted (False: no room now, nothing taken).
    """
    grant = cache._grants.open()
    try:
        return cache._take_gpu(nbytes, grant)
    finally:
        cache._grants.close(grant)
