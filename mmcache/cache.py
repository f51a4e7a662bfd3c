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
import threading
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Hashable,
    Iterable,
    Sequence,
)
from typing import Any, TypeVar

import torch
from prometheus_client import CollectorRegistry

from mmcache.closing import CloseOnce, off_the_loop
from mmcache.core.counters import Counters
from mmcache.core.evictor import Evictor
from mmcache.core.host import HostTier
from mmcache.core.index import KeyIndex, holder
from mmcache.core.ledger import TierLedger
from mmcache.core.lifecycle import Lifecycle
from mmcache.core.offload import OffloadPipeline
from mmcache.core.packing import BATCH_BYTES, GROUP_BELOW, Packings, group_spans, runs
from mmcache.core.policy import make_policy
from mmcache.core.quarantine import Quarantine
from mmcache.core.reads import Reads
from mmcache.device import Device, Fence, Stream, resolve_device
from mmcache.device.base import feature_bytes
from mmcache.entry import Entry, Member, State, check_key, check_keys, row_range
from mmcache.errors import (
    CacheClosedError,
    CopyTimeoutError,
    InvalidKeyError,
    InvalidValueError,
    ValueTooLargeError,
    WrongLoopError,
)
from mmcache.host_copy import warm_up as warm_host_copies
from mmcache.host_pool import HostBlock
from mmcache.metrics import CacheMetrics, DeferredPush, ensure_metrics_server
from mmcache.producer_fences import ProducerFences
from mmcache.settings import CacheSettings
from mmcache.single_flight import SingleFlight
from mmcache.stats import CacheStats
from mmcache.waiting import FenceWatcher

__all__ = ["FeatureCache"]

log = logging.getLogger("mmcache")

MiB = 1024 * 1024
ComputeFn = Callable[[], "torch.Tensor | Awaitable[torch.Tensor]"]
_T = TypeVar("_T")


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
        self._small_copy_bytes = self.settings.small_copy_bytes
        self._registry = registry
        self._metrics = CacheMetrics(name, registry)
        self._metrics.set_capacity("gpu", self._gpu_capacity)
        self._ledger = TierLedger(self._gpu_capacity)
        self._counters = Counters(self._metrics)
        self._tiers = DeferredPush(self._push_tier_gauges)
        self._copy_timeout = self.settings.copy_timeout_s

        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._watcher: FenceWatcher | None = None
        self._closed = False
        self._closing = CloseOnce()
        # key -> its entry, or its place in a put_many group's entry
        self._entries = KeyIndex()
        self._done_fence = self._device.completed_fence()
        self._producers = ProducerFences(self._device)
        # The order of GPU victims only; the byte ledger is ours. LRU, the default, is an
        # OrderedDict: every offloaded feature is inserted, evicted and re-inserted there.
        self._gpu_order = make_policy(self.settings.eviction_policy)
        self._copy_timeout = self.settings.copy_timeout_s
        self._life = Lifecycle(
            device=self._device,
            ledger=self._ledger,
            counters=self._counters,
            index=self._entries,
            gpu_order=self._gpu_order,
            when_done=self._when_done,
            room_freed=self._room_freed,
            changed=self._tiers.request,
        )
        self._host = HostTier(
            self._device,
            self.settings.cpu_cache_bytes,
            alignment=self.settings.host_alignment,
            policy=self.settings.eviction_policy,
            counters=self._counters,
            ledger=self._ledger,
            unlink=self._life.unlink,
        )
        self._quarantined = Quarantine()
        self._pipeline = OffloadPipeline(
            device=self._device,
            ledger=self._ledger,
            counters=self._counters,
            index=self._entries,
            quarantine=self._quarantined,
            host_insert=self._host.order.__setitem__,
            release_device=self._life.release_device,
            lost=self._life.offload_lost,
            after_landing=self._landed,
            urgent=self._waiting_for_room,
            changed=self._tiers.request,
            copy_timeout=self._copy_timeout,
        )
        self._life.attach(self._host, self._pipeline.charged)
        self._evictor = Evictor(
            device=self._device,
            ledger=self._ledger,
            counters=self._counters,
            index=self._entries,
            order=self._gpu_order,
            host=self._host,
            pipeline=self._pipeline,
            drop=self._life.drop,
            evict_ahead=int(self._gpu_capacity * self.settings.evict_ahead),
            small_copy_bytes=self.settings.small_copy_bytes,
        )
        self._packings = Packings(self._when_done, self._life.check_ready)
        self._reads = Reads(
            device=self._device,
            counters=self._counters,
            ledger=self._ledger,
            host=self._host,
            pipeline=self._pipeline,
            life=self._life,
            gpu_waiting=self._evictor.waiting,
            when_done=self._when_done,
            promote=self.settings.promote_on_hit,
            copy_timeout=self._copy_timeout,
        )
        self._inflight: SingleFlight[tuple[torch.Tensor, Fence]] = SingleFlight()

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
        self._packings.bind(loop)
        self._watcher = FenceWatcher(loop)
        self._pipeline.bind(loop, self._watcher)
        warm_host_copies()  # on the loop's thread, where host reads copy
        port = self.settings.metrics_port
        if port is not None and self._registry is None:
            # One server per process serves every cache on the default registry.
            ensure_metrics_server(port, self.settings.metrics_addr)
        arena = self._host.start(loop, self._when_done, self._host_capacity)
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
            self._packings.close()
            self._host.close()
            self._evictor.close()
        await self._closing.run(functools.partial(self._close, timeout))

    async def _close(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """close()'s work, in a task of its own (see close)."""
        self._tiers.unbind()
        self._producers.unbind()
        self._pipeline.close()  # landings are watched at once from here on
        if timeout is None:
            timeout = self._copy_timeout  # a stuck copy must not hang close() for ever
        self._evictor.fail_waiting()
        self._host.fail_waiters()
        for task in self._inflight.running():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), timeout)
        for found in list(self._entries.values()):
            self._life.remove(found)
        if self._watcher is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pipeline.all_landed(), timeout)
        with contextlib.suppress(CopyTimeoutError):
            await self._packings.wait_all(timeout)  # one that never ends keeps its values
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
        return await self._host.wait_ready(timeout)

    async def __aenter__(self) -> FeatureCache:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def drain(self) -> None:
        """Wait until every queued copy and deferred release has completed."""
        await self._ready_to_serve()
        await self._pipeline.all_landed()
        while self._packings:  # a group lost to its packing copy may start more work
            await self._packings.wait_all(None)
            await self._pipeline.all_landed()

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
        try:
            taken = self._evictor.take(nbytes)
        except BaseException:
            self._give_back([(own, ready)], [], [[]])
            raise
        if not taken:
            return await self._insert_units(
                [key], [], [(0, 1)], [nbytes], [(own, ready)], [[]], ready, wait
            )
        entry = Entry(key, tuple(own.shape), own.dtype, nbytes, State.GPU, own, ready)
        self._entries[key] = entry
        self._gpu_order[key] = entry
        self._ledger.insert(nbytes, 1)
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
        features up to BATCH_BYTES each are copied into storage of their own.
        """
        if self._closed or self._loop is not asyncio.get_running_loop():
            await self._ready_to_serve()
        tensor = holder[0]
        row_bytes = tensor.nbytes // tensor.shape[0]
        sizes = [n * row_bytes for n in rows]
        total = tensor.nbytes
        to_gpu = self._gpu_capacity > 0
        if not to_gpu and self._host.capacity == 0:
            return False
        self._check_fits(max(sizes), to_gpu)  # one feature too large: names the setting
        self._check_group_fits(total, to_gpu)
        host_limit = self._host.limit()
        if len(keys) == 1 or not host_limit or total <= host_limit:
            spans = [(0, len(keys))]
        else:
            spans = runs(sizes, None, min(BATCH_BYTES, host_limit))
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
        (packing.group_spans): each is packed into one device tensor and cached as one entry.
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
            limit = self._host.limit() if self._host.capacity else math.inf
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
        if not to_gpu and self._host.capacity == 0:
            return False
        self._check_group_fits(total, to_gpu)
        if len(items) == 1:
            spans = [(0, 1)]
        else:
            below = min(self._small_copy_bytes, GROUP_BELOW)
            spans = group_spans(items, sizes, below, self._host.limit())
            if self._packings:
                self._packings.reap()  # the values of earlier groups, already read
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
        # Without room now, a put waits (yielding to the loop); a put that finds it, the
        # common case, takes it without a coroutine of its own.
        waited = True
        try:
            if to_gpu:
                ok = self._evictor.take(total)
                if ok:
                    waited = False
                elif wait:
                    await self._evictor.wait(total)
                    ok = True
            else:
                unit_sizes = [sum(sizes[i:j]) for i, j in spans]
                ok = await self._host.reserve(unit_sizes, wait, blocks, self._pipeline)
        except BaseException:
            self._give_back(owned, blocks, sources)
            raise
        if not ok:
            self._give_back(owned, blocks, sources)
            self._counters.refused(len(keys))
            return False
        if waited:
            self._remove_keys(keys, wake=False)  # other puts of these keys done meanwhile
        offloads: list[tuple[Entry, HostBlock]] = []
        compacted: list[Entry] = []
        entries = self._entries
        for u, ((i, j), (own, ready)) in enumerate(zip(spans, owned, strict=True)):
            if j - i == 1:
                key = keys[i]
                entry = Entry(key, tuple(own.shape), own.dtype, sizes[i], State.GPU, own, ready)
                entries[key] = entry
            else:
                entry = entries.add_group(keys[i:j], rows[i:j], own, ready, sum(sizes[i:j]))
            if sources[u]:
                # Its values stay referenced until the packing copy has read them, and a
                # packing that failed drops the group then.
                self._packings.hold(ready, sources[u], entry)
            elif ready is not produced:
                compacted.append(entry)
            if to_gpu:
                self._gpu_order[entry.key] = entry
            else:
                offloads.append((entry, blocks[u]))
        if to_gpu:
            self._ledger.insert(total, len(keys))
            if self._evictor.waiting:
                self._evictor.wake()  # the next waiter may need these entries offloaded
        else:
            self._evictor.offload(offloads, charged_gpu=False)
        # Our compaction copies may fail (or have failed while we waited for room): such
        # an entry is dropped, once it is in the tier's lists and counts like the others.
        for entry in compacted:
            self._when_done(
                [entry.ready], functools.partial(self._life.check_ready, entry, entry.ready)
            )
        self._tiers.request()
        return True

    def _remove_keys(self, keys: list[Hashable], *, wake: bool) -> None:
        """Remove what the index holds under keys (a put replacing them); wake: after each
        removal, let waiting puts use the room it made."""
        entries = self._entries
        if entries.keys().isdisjoint(keys):
            return
        for key in keys:
            old = entries.get(key)
            if old is not None:
                self._life.remove(old)
                if wake:
                    self._evictor.wake()

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
            self._counters.miss()
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
            self._counters.hit_gpu()
            if state is State.GPU:
                self._gpu_order.touch(entry.key)
            assert entry.tensor is not None
            if to_host:
                if state is State.D2H:
                    return await self._reads.read_host(entry, span)
                return await self._reads.download(entry.tensor, entry.ready, span, entry)
            return await self._reads.serve_device(entry.tensor, entry.ready, span, stream)
        self._counters.hit_cpu()
        self._host.order.touch(entry.key)
        if to_host:
            return await self._reads.read_host(entry, span)
        return await self._reads.upload(entry, span, stream, member if rows is None else None)

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
        task = self._inflight.run(key, functools.partial(self._compute, key, fn, stream))
        value, ready = await asyncio.shield(task)
        span = row_range(rows, tuple(value.shape))
        if self._wants_host(device):
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
        self._life.remove(found)
        self._evictor.wake()
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
        found = self._entries.get(key)
        entry = None if found is None else holder(found)
        if entry is None or entry.block is None or self._host.pool is None:
            yield await self.get(key, device="cpu")
            return
        block = entry.block
        self._host.pool.pin(block)
        try:
            if entry.copy_fence is not None:
                self._counters.waited(await self._reads.wait([entry.copy_fence]))
            if isinstance(found, Member):
                view = entry.host_view(*found.span(None), block)
            else:
                view = entry.host_whole(block)
            if self._device.one_pinned_range(view):
                yield view
            else:
                out = await self._reads.host_copy(view)
                del view
                yield out
        finally:
            self._host.pool.unpin(block)

    def stats(self) -> CacheStats:
        """A snapshot of the ledger and counters; also audits it for leaked bytes."""
        self._tiers.flush()
        leaked = self._audit()
        ledger = self._ledger
        quarantined = self._quarantined
        pool = self._host.pool
        return CacheStats(
            gpu_bytes=ledger.used,
            cpu_bytes=pool.used_bytes if pool else 0,
            gpu_capacity_bytes=self._gpu_capacity,
            cpu_capacity_bytes=pool.capacity_bytes if pool else self._host.capacity,
            gpu_entries=ledger.gpu_entries,
            cpu_entries=ledger.cpu_entries,
            pending_copies=self._counters.pending_copies,
            leaked_bytes=leaked["gpu"] + leaked["cpu"],
            quarantined_bytes=quarantined.device_bytes() + quarantined.host_bytes(),
            host_ready=self._host.ready,
            **self._counters.as_dict(),
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
            f"get(device={device!r}): this cache returns tensors on {own!r} (device=None) "
            f"or host copies (device='cpu'); move the result yourself for another device"
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
                f"{' or '.join(CacheSettings.env_names('gpu_cache_mb'))}"
            )
        limit = self._host.limit()
        if not to_gpu and nbytes > limit:
            raise ValueTooLargeError(
                f"value of {nbytes / MiB:.1f} MB exceeds the host tier ({limit / MiB:.1f} MB), "
                f"and the GPU tier is off; raise "
                f"{' or '.join(CacheSettings.env_names('cpu_cache_mb'))}"
            )

    def _check_group_fits(self, total: int, to_gpu: bool) -> None:
        """Features put together must fit their tier together: none of them would go in."""
        capacity = self._gpu_capacity if to_gpu else self._host.capacity
        if total > capacity:
            tier = "GPU" if to_gpu else "host"
            raise ValueTooLargeError(
                f"features of {total / MiB:.1f} MB in all exceed the {tier} tier "
                f"({capacity / MiB:.1f} MB); put them in smaller groups"
            )

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
        with self._counters.counting_oom():
            return self._device.pack(values, stream)

    def _allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, stream: Stream | None = None
    ) -> torch.Tensor:
        """device.empty, counting an out-of-memory failure before it reaches the caller."""
        with self._counters.counting_oom():
            return self._device.empty(shape, dtype, stream)

    def _give_back(
        self,
        owned: list[tuple[torch.Tensor, Fence]],
        blocks: list[HostBlock],
        sources: list[list[torch.Tensor]],
    ) -> None:
        """Undo a put that took its values but will not insert them."""
        for (own, ready), values in zip(owned, sources, strict=True):
            self._device.release(own, after=[ready])
            if values:  # a packing copy may still read them
                self._packings.hold(ready, values, None)
        for block in blocks:
            self._host.free(block)

    def _host_capacity(self, nbytes: int) -> None:
        """The host arena is pinned: report its capacity."""
        self._metrics.set_capacity("cpu", nbytes)

    def _landed(self, charged_gpu: bool) -> None:
        """An offload has landed: hand the room it made on."""
        if charged_gpu:
            self._evictor.wake()
        elif self._host.waiting:  # a put straight to the host tier can evict them now
            self._host.wake()
        self._tiers.request()

    def _waiting_for_room(self) -> bool:
        return bool(self._evictor.waiting) or self._host.waiting

    def _room_freed(self) -> None:
        """GPU room came back: hand it on to waiting puts."""
        self._evictor.wake()
        self._tiers.request()

    # --- reads --------------------------------------------------------------------------

    # --- single flight ------------------------------------------------------------------

    async def _compute(
        self, key: Hashable, fn: ComputeFn, stream: Stream
    ) -> tuple[torch.Tensor, Fence]:
        result = fn()
        value = await result if inspect.isawaitable(result) else result
        if not isinstance(value, torch.Tensor):
            raise InvalidValueError(
                f"get_or_compute's fn must return a torch.Tensor, not {type(value).__name__}"
            )
        ready = self._device.record(stream)
        # The caller's alias below keeps the tensor valid whatever the cache does next.
        await self.put(key, value, stream=stream)
        return value, ready

    # --- bookkeeping --------------------------------------------------------------------

    def _when_done(
        self, fences: Sequence[Fence], callback: Callable[[], None], *, fresh: bool = False
    ) -> None:
        assert self._watcher is not None
        self._watcher.when_done(fences, callback, fresh=fresh)

    def _push_tier_gauges(self) -> None:
        """Tier sizes to the metrics (through self._tiers: once per loop iteration)."""
        ledger = self._ledger
        self._metrics.set_tier("gpu", ledger.used, ledger.gpu_entries)
        pool = self._host.pool
        self._metrics.set_tier("cpu", pool.used_bytes if pool else 0, ledger.cpu_entries)

    def _entry(self, key: Hashable) -> Entry:
        """The entry that holds key's feature (its group's, for a member); KeyError if none."""
        return self._entries.holder(key)

    def _held_entries(self) -> list[Entry]:
        """Every entry the index reaches, once each (a group once for all its members)."""
        return self._entries.held()

    def _audit(self) -> dict[str, int]:
        """Bytes in the ledgers that no entry, copy or pending release owns (should be 0)."""
        pool = self._host.pool
        quarantined = self._quarantined
        leaked = self._ledger.leaked(
            self._entries.held(),
            self._pipeline.in_flight(),
            pool.used_bytes - pool.freeing_bytes if pool else 0,
            (quarantined.device_bytes(), quarantined.host_bytes()),
        )
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
