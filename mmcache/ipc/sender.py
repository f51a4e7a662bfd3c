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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

import torch
from prometheus_client import CollectorRegistry

from mmcache.closing import CloseOnce, off_the_loop, run_each
from mmcache.core.budget import FifoBudget
from mmcache.device import Device, Fence, SimDevice, Stream, resolve_device
from mmcache.device.base import feature_bytes
from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    InvalidValueError,
    MMCacheError,
    SettingsError,
    ValueTooLargeError,
    WrongLoopError,
)
from mmcache.host_pool import HostBlock
from mmcache.ipc.control import LIVE, ControlBlock, LaneInfo
from mmcache.ipc.errors import NoPeerAccessError, TransportFullError
from mmcache.ipc.handle import FeatureHandle, SenderEndpoint, dtype_name
from mmcache.ipc.leases import Lease, LeaseLedger
from mmcache.ipc.memory import SenderMemory
from mmcache.ipc.pool import SliceArena, SlotAllocator
from mmcache.ipc.stats import TransportStats
from mmcache.layouts import check_strided
from mmcache.metrics import CacheMetrics, DeferredPush
from mmcache.settings import CacheSettings
from mmcache.waiting import FenceWatcher, wait_fences

__all__ = ["FeatureSender"]

log = logging.getLogger("mmcache.ipc")

_MiB: Final = 1 << 20
DEFAULT_ALIGNMENT: Final = 512
DEFAULT_MAX_SLICES: Final = 1024  # one CUDA IPC event each: a scarce driver resource
# Receivers release slices by writing shared cells, which wake nobody: while sends wait
# for room the recycler reads them this often instead of every ipc_recycle_interval_s.
_BACKPRESSURE_POLL_S: Final = 0.002
# A send that finds no room sweeps first, at most this often (a sweep reads every lease).
_MIN_SWEEP_GAP_S: Final = 0.001

Where = Literal["pool", "host"]
#: The receivers registered at send, and how many releases the send is owed.
_Owed = tuple[frozenset[tuple[int, int]], int]


@dataclass(slots=True, eq=False)
class _Placement:
    """Room granted to one send: a slice of an arena and a control-block slot.

    owner is the task of the send it was granted to: room still granted once
    that task has ended is leaked. after holds the copies queued into the slice
    (it is reused only after them), seq the send the slot was armed for (0: not
    yet), settled whether it became a lease or was given back.
    """

    where: Where
    arena: SliceArena
    block: HostBlock
    slot: int
    owner: asyncio.Task[object] | None
    after: list[Fence] = field(default_factory=list)
    seq: int = 0
    settled: bool = False


class _Source:
    """The sender's alias of a sent tensor, given back to the device exactly once."""

    __slots__ = ("_give_back", "tensor")

    def __init__(
        self, tensor: torch.Tensor, give_back: Callable[[torch.Tensor, Sequence[Fence]], None]
    ) -> None:
        self._give_back = give_back
        self.tensor: torch.Tensor | None = tensor

    def release(self, after: Sequence[Fence]) -> None:
        """Give the alias back after the fences (again: nothing)."""
        tensor, self.tensor = self.tensor, None
        if tensor is not None:
            self._give_back(tensor, after)

    def replace(self, tensor: torch.Tensor, after: Sequence[Fence]) -> None:
        """Release the alias held after the fences, and hold tensor instead."""
        self.release(after)
        self.tensor = tensor


def _device_kind(device: Device) -> Literal["sim", "cuda"]:
    if isinstance(device, SimDevice):
        return "sim"
    from mmcache.device.cuda import CudaDevice  # lazily: the module is only useful with a GPU

    if isinstance(device, CudaDevice):
        return "cuda"
    raise InvalidValueError(
        f"the IPC transport runs on a SimDevice or a CudaDevice, not {type(device).__name__}"
    )


# What a send waits for: its bytes, whether the pool may take them, the task sending.
_Want = tuple[int, bool, "asyncio.Task[object] | None"]


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
        if alignment < 1 or alignment & (alignment - 1):
            raise SettingsError(f"alignment must be a power of two, not {alignment}")
        self.settings = settings if settings is not None else CacheSettings()
        self.name = name
        self.consumers = consumers
        self._owns_device = not isinstance(device, Device)
        self._device = resolve_device(device)
        self._kind = _device_kind(self._device)
        self._n_lanes = lanes
        self._memory = SenderMemory(self._device, self._kind, self.settings, alignment)
        self._interval = self.settings.ipc_recycle_interval_s
        self._metrics = CacheMetrics(name, registry)
        # Pushed once per loop iteration: every send and every freed slice changes them.
        self._gauges = DeferredPush(self._push_gauges)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._watcher: FenceWatcher | None = None
        self._control: ControlBlock | None = None
        self._ledger: LeaseLedger | None = None
        self._endpoint: SenderEndpoint | None = None
        self._slots = SlotAllocator(max_slices)
        # Sends waiting for room, granted a placement in arrival order (the cache's FIFO
        # budget): what a send that gave up was granted goes back through _abort.
        self._waiters: FifoBudget[_Want, _Placement] = FifoBudget(
            self._place_wanted, lambda placement: self._abort(placement, ())
        )
        self._poke: asyncio.Event | None = None
        self._recycler: asyncio.Task[None] | None = None
        self._last_sweep = 0.0
        self._seq = 0
        self._inflight = {"pool": 0, "host": 0}  # bytes placed for sends still copying
        self._granted: set[_Placement] = set()  # room granted, not yet a lease or given back
        self._host_copies: set[Fence] = set()  # copies into the fallback not yet landed
        self._closing = CloseOnce(cleans_up_when_cancelled=True)  # see _close
        self._starting: asyncio.Event | None = None  # set once start() has finished
        self._start_failed = False
        self._sends = 0
        self._fallbacks: dict[str, int] = {}

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
        self._poke = asyncio.Event()
        self._starting = asyncio.Event()  # a close() meanwhile waits for it
        try:
            await self._start(loop)
        finally:
            self._starting.set()

    async def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            assert self._watcher is not None
            path = self._memory.open(self._watcher.when_done, self._on_space)
            control = ControlBlock.create(path, self._n_lanes, self._slots.capacity)
            self._control = control
            self._ledger = LeaseLedger(control, self.consumers, self.settings.ipc_lease_timeout_s)
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
        self._recycler = loop.create_task(self._recycle_forever(), name=f"mmcache-ipc-{self.name}")
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
            await self._free(keep_pool, list(self._host_copies))

    async def _free(self, keep_pool: bool, copying: Sequence[Fence]) -> None:
        """_teardown's releases and the device we made, then our metrics."""
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
        self._waiters.fail_all(
            lambda: CacheClosedError("the IPC sender closed while send waited for room")
        )
        leftover: list[Lease] = []
        if self._loop is not None and self._ledger is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(self._ledger) and (deadline is None or time.monotonic() < deadline):
                self._sweep()
                if len(self._ledger):
                    await asyncio.sleep(min(self._interval, 0.01))
            if self._recycler is not None:
                self._recycler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._recycler
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
        copying = list(self._host_copies)
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

        The pool is used when it can take the tensor now; otherwise the host
        fallback, counted in mmcache_ipc_fallbacks_total{reason}. When neither has
        room, send waits (up to the lease timeout) unless wait=False, and then
        raises TransportFullError; the tensor is released either way.
        """
        if stream is None:
            stream = self._device.current_stream()  # read before any await: it is per thread
        check_strided(tensor, "send()")
        await self._ready_to_serve()
        nbytes = feature_bytes(self._device, tensor, "send()")
        ready = self._device.record(stream)
        own = _Source(self._device.adopt(tensor, stream), self._release_source)
        del tensor
        try:
            assert self._control is not None
            assert self._ledger is not None
            lanes = self._control.lanes()
            owed = frozenset((i.lane, i.epoch) for i in lanes if i.state == LIVE)
            needed = self._ledger.needed(len(owed))
            placement, reason = await self._place(nbytes, lanes, wait)
        except BaseException:
            own.release([ready])
            raise
        # From here on every way out either leases the room or gives it back.
        try:
            if self._closed:  # room granted, then close() began before this send resumed
                raise CacheClosedError("the IPC sender closed while send waited for room")
            if placement.where == "pool":
                handle = self._write_pool(own, placement, ready, stream, (owed, needed))
            else:
                self._count_fallback(reason)
                handle = await self._write_host(own, placement, ready, stream, (owed, needed))
        except BaseException:
            self._abort(placement, ())  # nothing once it is a lease
            own.release(placement.after or [ready])
            raise
        self._sends += 1
        return handle

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
            fallbacks=sum(self._fallbacks.values()),
            live_leases=len(leases),
            open_leases=sum(1 for lease in leases if lease.open_by),
            leaked_bytes=self._leaked_bytes(),
            receivers=live,
            receivers_lost=ledger.lost_receivers if ledger is not None else 0,
            waiting_sends=len(self._waiters),
            fallbacks_by_reason=dict(self._fallbacks),
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
                or self._waiters
                or self._watcher.outstanding
                or any(self._inflight.values())
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

    # --- placement ------------------------------------------------------------------------

    async def _place(
        self, nbytes: int, lanes: Sequence[LaneInfo], wait: bool
    ) -> tuple[_Placement, str]:
        """Room for nbytes, and why it is not in the pool if it is not."""
        refusal = self._pool_refusal(nbytes, lanes)
        pool_ok = refusal is None
        self._check_fits(nbytes, refusal)
        reason = refusal or "pool_full"
        if not self._waiters:
            owner = asyncio.current_task()
            placement = self._try_place(nbytes, pool_ok, owner)
            if placement is None and time.monotonic() - self._last_sweep >= _MIN_SWEEP_GAP_S:
                self._sweep()
                placement = self._try_place(nbytes, pool_ok, owner)
            if placement is not None:
                return placement, reason
        if not wait:
            raise TransportFullError(self._full_message(nbytes, None))
        return await self._wait_for_room(nbytes, pool_ok), reason

    def _pool_refusal(self, nbytes: int, lanes: Sequence[LaneInfo]) -> str | None:
        """Why nbytes may not go through the pool at all (None: it may)."""
        if self._memory.pool is None:
            return "disabled"
        if nbytes > self._memory.pool.max_slice_bytes:
            return "too_large"
        if any(not i.peer_ok for i in lanes if i.state == LIVE):
            return "no_peer"
        return None

    def _check_fits(self, nbytes: int, refusal: str | None) -> None:
        """Refuse at once what could never be placed, saying which setting to change."""
        pool, fallback = self._memory.pool, self._memory.fallback
        if refusal is None:  # _pool_refusal found the pool able to take it
            return
        if fallback is not None and nbytes <= fallback.max_slice_bytes:
            return
        env = self.settings.env_name
        if refusal == "no_peer":
            raise NoPeerAccessError(
                "a registered receiver cannot read this GPU's IPC pool and the host fallback "
                f"cannot take {nbytes / _MiB:.1f} MiB; raise {env('ipc_fallback_mb')}"
            )
        pool_mb = pool.capacity_bytes / _MiB if pool is not None else 0.0
        fallback_mb = fallback.capacity_bytes / _MiB if fallback is not None else 0.0
        off = "" if self.settings.use_cuda_ipc else f"; off: {env('use_cuda_ipc')}=0"
        raise ValueTooLargeError(
            f"a feature of {nbytes / _MiB:.1f} MiB fits neither the IPC pool "
            f"({pool_mb:.1f} MiB, {env('ipc_pool_mb')}{off}) nor the host fallback "
            f"({fallback_mb:.1f} MiB, {env('ipc_fallback_mb')}); raise one of them"
        )

    def _try_place(
        self, nbytes: int, pool_ok: bool, owner: asyncio.Task[object] | None
    ) -> _Placement | None:
        """Room for nbytes now, for the send running as task owner: a pool slice if
        allowed, else a fallback block; None if full."""
        slot = self._slots.take()
        if slot is None:
            return None
        choices: tuple[tuple[Where, SliceArena | None], ...] = (
            ("pool", self._memory.pool if pool_ok else None),
            ("host", self._memory.fallback),
        )
        for where, arena in choices:
            if arena is None:
                continue
            block = arena.allocate(nbytes)
            if block is not None:
                self._inflight[where] += block.nbytes
                placement = _Placement(where, arena, block, slot, owner)
                self._granted.add(placement)
                return placement
        self._slots.give(slot)
        return None

    async def _wait_for_room(self, nbytes: int, pool_ok: bool) -> _Placement:
        assert self._loop is not None and self._poke is not None
        waiter = self._waiters.join((nbytes, pool_ok, asyncio.current_task()))
        self._poke.set()  # the recycler sweeps often while sends wait
        timeout = self.settings.ipc_lease_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await self._waiters.wait(waiter)  # gives back a grant come too late
        except TimeoutError:
            raise TransportFullError(self._full_message(nbytes, timeout)) from None

    def _place_wanted(self, want: _Want) -> _Placement | None:
        """Room for a waiting send now (its FifoBudget's take), or None."""
        return self._try_place(*want)

    def _abort(self, placement: _Placement, after: Sequence[Fence]) -> None:
        """Give back room a send will not use, after the fences and the copies queued
        into it; nothing if it was given back already or became a lease."""
        if placement.settled:
            return
        self._settle(placement)
        if placement.seq and self._control is not None:
            self._control.invalidate(placement.slot, placement.seq)
        placement.arena.free(placement.block, [*placement.after, *after])
        self._slots.give(placement.slot)

    def _settle(self, placement: _Placement) -> None:
        """Room granted to a send stops being in flight: a lease holds it, or it went back."""
        placement.settled = True
        self._granted.discard(placement)
        self._inflight[placement.where] -= placement.block.nbytes

    def _full_message(self, nbytes: int, waited: float | None) -> str:
        env = self.settings.env_name
        held = len(self._ledger) if self._ledger is not None else 0
        used = sum(
            a.used_bytes for a in (self._memory.pool, self._memory.fallback) if a is not None
        )
        how = "now" if waited is None else f"within {waited:.1f} s ({env('ipc_lease_timeout_s')})"
        return (
            f"no room for a {nbytes / _MiB:.2f} MiB feature in the IPC pool or the host "
            f"fallback {how}: {used / _MiB:.1f} MiB are held by {held} sends that receivers "
            f"have not released. Check that the receivers run and receive every handle, or "
            f"raise {env('ipc_fallback_mb')} / {env('ipc_pool_mb')}"
        )

    # --- writing ----------------------------------------------------------------------------

    def _write_pool(
        self,
        own: _Source,
        placement: _Placement,
        ready: Fence,
        stream: Stream,
        owed: _Owed,
    ) -> FeatureHandle:
        """Queue own -> pool slice on the producer's stream; the handle goes out at once."""
        assert own.tensor is not None
        shape, dtype = tuple(own.tensor.shape), own.tensor.dtype
        try:
            dst = placement.arena.view(placement.block, shape, dtype)
            # On the producer's stream: ordered after the work that made the tensor.
            written = self._device.copy_d2d(own.tensor, dst, stream)
            del dst
            placement.after.append(written)
            event = self._record_event(placement.slot, stream)
            handle = self._publish(placement, shape, dtype, event)
        except BaseException:
            self._abort(placement, ())
            own.release(placement.after or [ready])
            raise
        seq = handle.seq
        written.add_done_callback(functools.partial(self._mark_ready, placement.slot, seq, written))
        own.release([written])
        return self._lease(placement, handle, written, owed)

    async def _write_host(
        self,
        own: _Source,
        placement: _Placement,
        ready: Fence,
        stream: Stream,
        owed: _Owed,
    ) -> FeatureHandle:
        """Copy own into a shared host block, release it, and only then hand out the handle."""
        assert self._control is not None and own.tensor is not None
        shape, dtype = tuple(own.tensor.shape), own.tensor.dtype
        after: list[Fence] = [ready]
        try:
            placement.arena.commit(placement.block)
            if not own.tensor.is_contiguous():
                # A device-to-host copy needs one dense range: pack the view on the device.
                packed = self._device.empty(shape, dtype, stream)
                compacted = self._device.copy_d2d(own.tensor, packed, stream)
                own.replace(packed, [compacted])
                after = [compacted]
            dst = placement.arena.view(placement.block, shape, dtype)
            copied = self._device.copy_d2h(own.tensor, dst, after)
            del dst
            placement.after.append(copied)
        except BaseException:
            self._abort(placement, ())
            own.release(after)
            raise
        self._host_copies.add(copied)  # close() waits for it before freeing the fallback
        try:
            await wait_fences([copied])
            if self._closed:  # no receiver can take a handle of a closed sender
                raise CacheClosedError("the IPC sender closed while send copied to the host")
        except BaseException as exc:
            if isinstance(exc, CopyFailedError):
                self._metrics.fault("copy_failed")
            self._abort(placement, ())
            own.release([copied])
            raise
        finally:
            # Forgotten once landed, also when this send was cancelled while it copied.
            assert self._watcher is not None
            self._watcher.when_done([copied], functools.partial(self._host_copies.discard, copied))
        # The device memory goes back before the handle exists: the seed bug kept it.
        own.release([copied])
        handle = self._publish(placement, shape, dtype, b"")
        self._control.mark_ready(placement.slot, handle.seq, True)
        return self._lease(placement, handle, copied, owed)

    def _release_source(self, own: torch.Tensor, after: Sequence[Fence]) -> None:
        """Give the sender's alias of a sent tensor back to the device after the fences."""
        self._device.release(own, after)

    def _record_event(self, slot: int, stream: Stream) -> bytes:
        """Record the slot's CUDA IPC event after the copy (b"" on the simulator)."""
        cuda_pool = self._memory.cuda_pool
        if cuda_pool is None:
            return b""
        return cuda_pool.record_ready(slot, stream)

    def _mark_ready(self, slot: int, seq: int, written: Fence) -> None:
        """Fence callback (any thread): publish that a pool slice is written, or that it failed."""
        if self._control is not None:
            self._control.mark_ready(slot, seq, written.exception() is None)

    def _publish(
        self, placement: _Placement, shape: tuple[int, ...], dtype: torch.dtype, event: bytes
    ) -> FeatureHandle:
        """The handle of a new send into placement, its slice published in the slot."""
        assert self._endpoint is not None and self._control is not None
        handle = FeatureHandle(
            sender=self._endpoint,
            seq=self._next_seq(),
            slot=placement.slot,
            where=placement.where,
            offset=placement.block.offset,
            shape=shape,
            dtype=dtype_name(dtype),
            cuda_event=event,
        )
        placement.seq = handle.seq  # set first: a failure in arm() still invalidates the slot
        self._control.arm(
            placement.slot,
            handle.seq,
            placement.where,
            handle.offset,
            handle.nbytes,
            handle.slice_digest(),
        )
        return handle

    def _lease(
        self, placement: _Placement, handle: FeatureHandle, written: Fence, owed: _Owed
    ) -> FeatureHandle:
        """Hold placement for handle's receivers (the send's room becomes a lease)."""
        assert self._ledger is not None
        self._ledger.add(Lease(handle, placement.arena, placement.block, written, *owed))
        self._settle(placement)
        self._gauges.request()
        return handle

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _count_fallback(self, reason: str) -> None:
        self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
        self._metrics.ipc_fallback(reason)

    # --- recycling ----------------------------------------------------------------------------

    async def _recycle_forever(self) -> None:
        assert self._poke is not None
        while True:
            delay = min(self._interval, _BACKPRESSURE_POLL_S) if self._waiters else self._interval
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poke.wait(), delay)
            self._poke.clear()
            try:
                self._sweep()
            except Exception:
                log.exception("IPC sender %r: a recycler sweep failed", self.name)

    def _sweep(self) -> None:
        """Reclaim what receivers released or left behind; flag late leases; wake waiters."""
        ledger = self._ledger
        if ledger is None:
            return
        result = ledger.sweep()
        self._last_sweep = time.monotonic()
        timeout_env = self.settings.env_name("ipc_lease_timeout_s")
        for lease in result.recycled:
            if lease.timed_out:
                log.info(
                    "%s was released late, %.1f s after it was sent; its slice is reused",
                    lease.handle.describe(),
                    time.monotonic() - lease.sent_at,
                )
            # After the sender's own copy into it too: a receiver that died may not have waited.
            lease.arena.free(lease.block, [lease.written])
            self._slots.give(lease.handle.slot)
        for lease in result.timed_out:
            owing = ", ".join(f"pid {i.pid}" for i in ledger.owing(lease)) or "none registered"
            log.warning(
                "%s was not released within %.1f s (%s): counted in "
                'mmcache_leaked_bytes{tier="ipc"} until it is released or its receivers '
                "exit; receivers that have not released it: %s",
                lease.handle.describe(),
                ledger.timeout_s,
                timeout_env,
                owing,
            )
        for info, credited in result.lost:
            closed = info.state != LIVE
            log.log(
                logging.INFO if closed and not credited else logging.WARNING,
                "IPC receiver pid %d (lane %d) %s; %d sends it held or was owed are released "
                "on its behalf",
                info.pid,
                info.lane,
                "closed" if closed else "exited",
                credited,
            )
        self._waiters.grant()
        self._gauges.flush()  # a sweep's outcome shows at once (tests and operators read it)

    def _on_space(self) -> None:
        """A slice went back to an arena (maybe after its fences): room for waiting sends."""
        if not self._closed:
            self._waiters.grant()
            self._gauges.request()

    # --- accounting ---------------------------------------------------------------------------

    def _leaked_bytes(self) -> int:
        """Late leases, room still granted to sends that have ended, plus arena bytes that
        no lease, send in progress or pending free owns."""
        ledger = self._ledger
        if ledger is None:
            return 0
        leaked = ledger.leaked_bytes()
        leaked += sum(
            placement.block.nbytes
            for placement in self._granted
            if placement.owner is None or placement.owner.done()
        )
        leases = list(ledger)
        for where, arena in (("pool", self._memory.pool), ("host", self._memory.fallback)):
            if arena is None:
                continue
            owned = sum(lease.nbytes for lease in leases if lease.arena is arena)
            owned += self._inflight[where] + arena.freeing_bytes
            leaked += arena.used_bytes - owned
        return leaked

    def _push_gauges(self) -> None:
        pool, ledger = self._memory.pool, self._ledger
        if pool is not None and ledger is not None:
            held_open = ledger.open_bytes(pool)
            self._metrics.set_ipc_pool("used", pool.used_bytes - held_open)
            self._metrics.set_ipc_pool("leased", held_open)
            self._metrics.set_ipc_pool("free", pool.capacity_bytes - pool.used_bytes)
        self._metrics.set_leaked("ipc", self._leaked_bytes())

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
