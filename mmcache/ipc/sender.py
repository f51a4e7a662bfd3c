"""FeatureSender: hands features to other processes through the IPC pool or the host fallback.

send() takes ownership of a device tensor. If the pool can take it, the copy
into a pool slice is queued on the producer's stream and the handle goes out
at once (receivers wait for the slot's ready mark, or the slot's CUDA IPC
event). Otherwise the tensor is copied into a block of the shared host
fallback and the device source is released before send returns — the seed
bug of this transport kept it alive. A recycler reclaims slices that every
consumer released, and those of receivers that died.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from typing import Final

import torch
from prometheus_client import CollectorRegistry

from mmcache.closing import CloseOnce, off_the_loop, run_each
from mmcache.device import Device, Fence, Stream, resolve_device
from mmcache.device.base import DeferredFence, feature_bytes
from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    InvalidValueError,
    MMCacheError,
    SettingsError,
    WrongLoopError,
)
from mmcache.ipc.control import LIVE, MAX_ROWS, ControlBlock
from mmcache.ipc.handle import FeatureBatch, FeatureHandle, SenderEndpoint, device_kind
from mmcache.ipc.leases import Lease, LeaseLedger
from mmcache.ipc.memory import SenderMemory
from mmcache.ipc.placer import SendPlacer
from mmcache.ipc.reclaim import LeaseReclaimer
from mmcache.ipc.recycler import Recycler
from mmcache.ipc.room import SendRoom
from mmcache.ipc.stats import TransportStats
from mmcache.ipc.writer import MAX_BATCH, SliceWriter, Source, part_offsets, release_all
from mmcache.layouts import check_strided
from mmcache.metrics import CacheMetrics, DeferredPush
from mmcache.settings import CacheSettings
from mmcache.waiting import FenceWatcher, wait_fences

__all__ = ["FeatureSender"]

log = logging.getLogger("mmcache.ipc")

_MiB: Final = 1 << 20
DEFAULT_ALIGNMENT: Final = 512
DEFAULT_MAX_SLICES: Final = 1024  # one CUDA IPC event each: a scarce driver resource


class FeatureSender:
    """Owns the IPC pool of one producer and hands its features to `consumers` receivers each."""

    def __init__(
        self,
        settings: CacheSettings | None = None,
        device: str | Device = "cuda",
        *,
        consumers: int = 1,
        name: str = "ipc",
        registry: CollectorRegistry | None = None,
        max_receivers: int | None = None,
        max_slices: int = DEFAULT_MAX_SLICES,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> None:
        if consumers < 1:
            raise SettingsError(f"consumers must be >= 1, not {consumers}")
        lanes = max(8, 2 * consumers) if max_receivers is None else max_receivers
        if lanes < consumers:
            raise SettingsError(f"max_receivers ({lanes}) must be at least consumers ({consumers})")
        if max_slices < 1:
            raise SettingsError(f"max_slices must be >= 1, not {max_slices}")
        # More than a control block holds would fail only at start(), as a version mismatch.
        for what, rows in (("max_slices", max_slices), ("max_receivers", lanes)):
            if rows > MAX_ROWS:
                raise SettingsError(f"{what} must be at most {MAX_ROWS}, not {rows}")
        if alignment < 1 or alignment & (alignment - 1):
            raise SettingsError(f"alignment must be a power of two, not {alignment}")
        self.settings = settings if settings is not None else CacheSettings()
        self.name = name
        self.consumers = consumers
        self._owns_device = not isinstance(device, Device)
        self._device = resolve_device(device)
        self._kind = device_kind(self._device)
        self._n_lanes = lanes
        self._interval = self.settings.ipc_recycle_interval_s
        self._metrics = CacheMetrics(name, registry)
        # Pushed once per loop iteration: every send and every freed slice changes them.
        self._gauges = DeferredPush(self._push_gauges)
        self._memory = SenderMemory(self._device, self._kind, self.settings, alignment)
        self._room = SendRoom(self._memory, self.settings, max_slices)
        self._reclaimer = LeaseReclaimer(self.settings, self._room, self._gauges, self._metrics)
        self._writer = SliceWriter(
            self._device,
            self._memory,
            self._room,
            self._metrics,
            self._gauges,
            lambda: self._closed,
        )
        self._recycler = Recycler(
            name, self._interval, self._room, functools.partial(self._sweep, full=False)
        )
        self._placer = SendPlacer(
            self.settings,
            self._memory,
            self._room,
            self._reclaimer,
            self._metrics,
            functools.partial(self._sweep, full=False),
            self._recycler.wake,
            lambda: self._closed,
        )

        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._watcher: FenceWatcher | None = None
        self._control: ControlBlock | None = None
        self._ledger: LeaseLedger | None = None
        self._endpoint: SenderEndpoint | None = None
        self._closing = CloseOnce(cleans_up_when_cancelled=True)  # see _close
        self._starting: asyncio.Event | None = None  # set once start() has finished
        self._start_failed = False
        self._sends = 0

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the control block, the pool and the host fallback; start the recycler."""
        if self._closed:
            raise CacheClosedError("this FeatureSender was closed; create a new one")
        if self._loop is not None:
            if self._starting is not None:  # another start() under way: return once it has
                await self._starting.wait()
            if self._start_failed or self._closed:
                raise CacheClosedError("this FeatureSender was closed; create a new one")
            return
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._watcher = FenceWatcher(loop)
        self._starting = asyncio.Event()  # a close() meanwhile waits for it
        try:
            await self._start(loop)
        finally:
            self._starting.set()

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            assert self._watcher is not None
            path = self._memory.open(self._watcher.when_done, self._on_space)
            control = ControlBlock.create(path, self._n_lanes, self._room.slot_count)
            self._control = control
            self._ledger = LeaseLedger(control, self.consumers, self.settings.ipc_lease_timeout_s)
            self._room.bind(control, self._ledger)
            if self._memory.pool_bytes:
                await self._memory.make_pool(control.path)
            if self._memory.fallback_bytes:
                await self._memory.make_fallback()
        except BaseException:
            self._closed = self._start_failed = True
            try:
                await self._free(keep_pool=False, copying=())
            except Exception:  # the start's own error is the one to raise
                log.exception(
                    "IPC sender %r: releasing what a failed start() made failed", self.name
                )
            raise
        memory = self._memory
        cuda_pool, pool, fallback = memory.cuda_pool, memory.pool, memory.fallback
        self._endpoint = SenderEndpoint(
            control_path=control.path,
            pid=control.sender_pid,
            device_kind=self._kind,
            device_uuid=cuda_pool.uuid if cuda_pool is not None else "",
            pool_path=memory.pool_path,
            pool_nbytes=pool.tensor.numel() if pool is not None else 0,
            cuda_pool=cuda_pool.ipc_handle if cuda_pool is not None else b"",
            fallback_path=memory.fallback_path,
            fallback_nbytes=fallback.tensor.numel() if fallback is not None else 0,
        )
        control.publish_endpoint(self._endpoint.digest())
        assert self._ledger is not None and self._watcher is not None
        self._writer.bind(control, self._ledger, self._endpoint, self._watcher)
        self._recycler.start(loop)
        self._gauges.bind(loop)
        self._gauges.request()

    async def close(self, timeout: float | None = 10.0) -> None:  # noqa: ASYNC109
        """Stop sending; wait up to timeout s for receivers to release what they hold; free all.

        Memory a receiver still holds after the timeout is kept (and logged), never
        reused or poisoned under it.
        """
        if not self._closing.begun:
            if self._closed:  # a start() that failed closed it, once it has cleaned up
                if self._starting is not None:
                    await self._starting.wait()
                return
            self._closed = True  # before any await: no send starts from here on
        await self._closing.run(functools.partial(self._close, timeout))

    async def _close(self, timeout: float | None) -> None:  # noqa: ASYNC109
        """close()'s work, in a task of its own (mmcache.closing)."""
        if self._starting is not None:
            await self._starting.wait()  # a start() under way first makes what we free
        if self._start_failed:
            return  # its own failure path freed it
        keep_pool = True  # unless the waits below find no receiver and no copy still at it
        try:
            keep_pool = await self._stop_and_wait(timeout)
        finally:
            # Copies into the fallback must land before it is unpinned; the rest of the
            # memory goes now, the pool unless a receiver may still read it.
            await self._free(keep_pool, list(self._writer.host_copies))

    async def _free(self, keep_pool: bool, copying: Sequence[Fence]) -> None:
        """SenderMemory.teardown's releases and the device we made, then our metrics."""
        steps = [self._memory.teardown(self._control, keep_pool, copying)]
        if self._owns_device:
            steps.append(self._device.close)
        try:
            # Off the loop: freeing the pool waits for the whole GPU, and unpinning and
            # unmapping the default 1 GiB fallback held the loop 258 ms on the H200.
            await off_the_loop(functools.partial(run_each, steps))
        finally:
            self._metrics.close()

    async def _stop_and_wait(self, timeout: float | None) -> bool:  # noqa: ASYNC109
        """Refuse waiting sends; wait up to timeout s for receivers to release what they
        hold and for copies to land. Whether the pool must be kept."""
        self._gauges.unbind()
        self._room.waiters.fail_all(
            lambda: CacheClosedError("the IPC sender closed while send waited for room")
        )
        leftover: list[Lease] = []
        if self._loop is not None and self._ledger is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(self._ledger) and (deadline is None or time.monotonic() < deadline):
                self._sweep()
                if len(self._ledger):
                    await asyncio.sleep(min(self._interval, 0.01))
            await self._recycler.stop()
            leftover = self._ledger.drop_all()
            for lease in leftover:
                log.warning(
                    "IPC sender %r closed while %s was not released by every receiver; "
                    "its memory is kept, not reused",
                    self.name,
                    lease.handle.describe(),
                )
            if self._watcher is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._watcher.idle(), timeout)
        copying = list(self._writer.host_copies)
        with contextlib.suppress(CopyFailedError):  # a timeout is one too
            await wait_fences(copying, timeout)
        return bool(leftover) or not all(f.done() for f in copying)

    async def __aenter__(self) -> FeatureSender:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def device(self) -> Device:
        """The device the sender's features live on."""
        return self._device

    @property
    def endpoint(self) -> SenderEndpoint:
        """What a receiver needs to connect before the first handle (plain data: to_bytes())."""
        if self._endpoint is None:
            raise MMCacheError("start() the FeatureSender before asking for its endpoint")
        return self._endpoint

    # --- public API -----------------------------------------------------------------------

    async def send(
        self, tensor: torch.Tensor, *, stream: Stream | None = None, wait: bool = True
    ) -> FeatureHandle:
        """Hand tensor to the consumers, taking ownership of it; return its handle.

        The handle is plain data: handle.to_bytes() is what to ship to the receivers'
        processes (FeatureHandle.from_bytes() reads it there). Sparse, mkldnn and
        nested tensors are refused (InvalidValueError) before anything is reserved.

        The pool is used when it can take the tensor now, or within ipc_pool_wait_s
        when it is full (receivers release slices meanwhile; wait=False does not wait);
        otherwise the host fallback, counted in mmcache_ipc_fallbacks_total{reason}.
        When neither has room, send waits (up to the lease timeout) unless
        wait=False, and then raises TransportFullError; the tensor is released
        either way.
        """
        if stream is None:
            stream = self._device.current_stream()  # read before any await: it is per thread
        taken = [tensor]
        del tensor  # _send empties taken: no frame of ours keeps the tensor alive
        handle = await self._send(taken, stream, wait, batch=False)
        assert isinstance(handle, FeatureHandle)
        return handle

    async def send_many(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        stream: Stream | None = None,
        wait: bool = True,
    ) -> FeatureBatch:
        """Hand several tensors (a request's features) to the consumers in one publication.

        As send(), for all of them at once: one slice holds them back to back, one
        slot and one handle (a FeatureBatch: receive_many / lease_many read it) track
        them, and the receivers release them together. Takes ownership of every
        tensor; they all go through the pool or all through the host fallback.
        """
        if stream is None:
            stream = self._device.current_stream()
        taken = list(tensors)
        del tensors
        if not taken:
            raise InvalidValueError("send_many() needs at least one tensor")
        if len(taken) > MAX_BATCH:
            raise InvalidValueError(
                f"send_many() takes at most {MAX_BATCH} tensors at once, not {len(taken)}"
            )
        batch = await self._send(taken, stream, wait, batch=True)
        assert isinstance(batch, FeatureBatch)
        return batch

    async def _send(
        self, tensors: list[torch.Tensor], stream: Stream, wait: bool, *, batch: bool
    ) -> FeatureHandle | FeatureBatch:
        """Send the tensors (emptied here once owned: the caller's frames keep none)."""
        caller = "send_many()" if batch else "send()"
        for tensor in tensors:
            check_strided(tensor, caller)
        del tensor  # the loop's last: no frame of ours keeps a sent tensor alive
        await self._ready_to_serve()
        sizes = [feature_bytes(self._device, tensor, caller) for tensor in tensors]
        offsets, nbytes = part_offsets(sizes)
        # The tensors' makers: what a release or a copy to the host waits for. Recorded when
        # first needed (a copy into the pool is ordered on stream itself and needs none):
        # later on the same stream, it waits for no less.
        ready = DeferredFence(self._device, stream)
        owns = [Source(self._device.adopt(t, stream), self._release_source) for t in tensors]
        tensors.clear()
        try:
            assert self._control is not None
            assert self._ledger is not None
            lanes = self._control.lanes()
            owed = frozenset((i.lane, i.epoch) for i in lanes if i.state == LIVE)
            needed = self._ledger.needed(len(owed))
            placement, reason = await self._placer.place(nbytes, lanes, wait)
        except BaseException:
            release_all(owns, [ready])
            raise
        # From here on every way out either leases the room or gives it back.
        try:
            if self._closed:  # room granted, then close() began before this send resumed
                raise CacheClosedError("the IPC sender closed while send waited for room")
            pieces = list(zip(owns, offsets, strict=True))
            if placement.where == "pool":
                sent = self._writer.write_pool(
                    pieces, placement, ready, stream, (owed, needed), batch
                )
            else:
                sent = await self._writer.write_host(
                    pieces, placement, ready, stream, (owed, needed), batch
                )
        except BaseException:
            self._room.abort(placement, ())  # nothing once it is a lease
            release_all(owns, placement.after or [ready])
            raise
        if placement.where != "pool":
            self._placer.count_fallback(reason)  # a send that failed took no fallback
        self._sends += 1
        return sent

    def stats(self) -> TransportStats:
        """A snapshot of the pool, the fallback, the leases and the receivers."""
        ledger, control = self._ledger, self._control
        pool, fallback = self._memory.pool, self._memory.fallback
        leases = list(ledger) if ledger is not None else []
        live = 0
        if control is not None and not self._closed:
            live = sum(1 for i in control.lanes() if i.live)
        return TransportStats(
            pool_used_bytes=pool.used_bytes if pool is not None else 0,
            pool_capacity_bytes=pool.capacity_bytes if pool is not None else 0,
            fallback_used_bytes=fallback.used_bytes if fallback is not None else 0,
            fallback_capacity_bytes=fallback.capacity_bytes if fallback is not None else 0,
            sends=self._sends,
            fallbacks=sum(self._placer.fallbacks.values()),
            live_leases=len(leases),
            open_leases=sum(1 for lease in leases if lease.open_by),
            leaked_bytes=self._room.leaked_bytes(),
            receivers=live,
            receivers_lost=ledger.lost_receivers if ledger is not None else 0,
            waiting_sends=len(self._room.waiters),
            fallbacks_by_reason=dict(self._placer.fallbacks),
        )

    def sweep(self) -> None:
        """Run the recycler once now (it also runs every ipc_recycle_interval_s)."""
        if self._ledger is not None and not self._closed:
            self._sweep()

    async def drain(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Wait until every send was released and reclaimed; False if timeout passed first."""
        await self._ready_to_serve()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._sweep()
            assert self._ledger is not None and self._watcher is not None
            busy = (
                len(self._ledger)
                or self._room.waiters
                or self._watcher.outstanding
                or self._room.in_flight()
            )
            if not busy:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(min(self._interval, 0.005))

    async def wait_for_receivers(self, count: int, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Wait until count receivers are registered and alive (TimeoutError otherwise)."""
        await self._ready_to_serve()
        assert self._control is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            lanes = self._control.lanes()
            if sum(1 for i in lanes if i.live) >= count:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"fewer than {count} IPC receivers connected in {timeout} s")
            # Start-up only: registration writes a shared cell that wakes nobody.
            await asyncio.sleep(0.01)

    def _release_source(self, own: torch.Tensor, after: Sequence[Fence]) -> None:
        """Give the sender's alias of a sent tensor back to the device after the fences."""
        self._device.release(own, after)

    # --- recycling ----------------------------------------------------------------------------

    def _sweep(self, *, full: bool = True) -> None:
        """Reclaim what receivers released or left behind; flag late leases; wake waiters
        (full=False: a quick sweep, see LeaseReclaimer.sweep)."""
        ledger = self._ledger
        if ledger is None:
            return
        self._reclaimer.sweep(ledger, full=full)

    def _on_space(self) -> None:
        """A slice went back to an arena (maybe after its fences): room for waiting sends."""
        if not self._closed:
            self._room.waiters.grant()
            self._gauges.request()

    # --- accounting ---------------------------------------------------------------------------

    def _push_gauges(self) -> None:
        pool, ledger = self._memory.pool, self._ledger
        if pool is not None and ledger is not None:
            held_open = ledger.open_bytes(pool)
            self._metrics.set_ipc_pool("used", pool.used_bytes - held_open)
            self._metrics.set_ipc_pool("leased", held_open)
            self._metrics.set_ipc_pool("free", pool.capacity_bytes - pool.used_bytes)
        self._metrics.set_leaked("ipc", self._room.leaked_bytes())

    # --- set-up and tear-down -----------------------------------------------------------------

    async def _ready_to_serve(self) -> None:
        if self._closed:
            raise CacheClosedError("this FeatureSender is closed")
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise WrongLoopError(
                "this FeatureSender belongs to another event loop; call it from the loop "
                "that started it"
            )
        if self._starting is None or not self._starting.is_set():
            await self.start()  # the first send starts it, or waits for a start under way
