"""SliceWriter: copies sends into their room and publishes each slice's record and lease."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from mmcache.device import Device, Fence, Stream
from mmcache.errors import CacheClosedError, CopyFailedError
from mmcache.ipc.control import ControlBlock
from mmcache.ipc.handle import FeatureHandle, SenderEndpoint, dtype_name
from mmcache.ipc.leases import Lease, LeaseLedger
from mmcache.ipc.memory import SenderMemory
from mmcache.ipc.room import Placement, SendRoom
from mmcache.metrics import CacheMetrics, DeferredPush
from mmcache.waiting import FenceWatcher, wait_fences

__all__ = ["Owed", "SliceWriter", "Source"]

#: The receivers registered at send, and how many releases the send is owed.
Owed = tuple[frozenset[tuple[int, int]], int]


class Source:
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


class SliceWriter:
    """Writes each send into the room granted to it and publishes it: the slot's record,
    the ready mark, and the lease that holds the slice for the receivers.

    It owns the send numbers and the copies into the fallback not yet landed.
    """

    def __init__(
        self,
        device: Device,
        memory: SenderMemory,
        room: SendRoom,
        metrics: CacheMetrics,
        gauges: DeferredPush,
        closed: Callable[[], bool],
    ) -> None:
        self._device = device
        self._memory = memory
        self._room = room
        self._metrics = metrics
        self._gauges = gauges
        self._closed = closed  # whether the sender closed
        self._seq = 0
        self.host_copies: set[Fence] = set()  # copies into the fallback not yet landed
        self._control: ControlBlock | None = None
        self._ledger: LeaseLedger | None = None
        self._endpoint: SenderEndpoint | None = None
        self._watcher: FenceWatcher | None = None

    def bind(
        self,
        control: ControlBlock,
        ledger: LeaseLedger,
        endpoint: SenderEndpoint,
        watcher: FenceWatcher,
    ) -> None:
        """The started sender's control block, leases, endpoint and fence watcher."""
        self._control, self._ledger = control, ledger
        self._endpoint, self._watcher = endpoint, watcher

    def write_pool(
        self,
        own: Source,
        placement: Placement,
        ready: Fence,
        stream: Stream,
        owed: Owed,
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
            handle = self.publish(placement, shape, dtype, event)
        except BaseException:
            self._room.abort(placement, ())
            own.release(placement.after or [ready])
            raise
        seq = handle.seq
        written.add_done_callback(functools.partial(self._mark_ready, placement.slot, seq, written))
        own.release([written])
        return self.lease(placement, handle, written, owed)

    async def write_host(
        self,
        own: Source,
        placement: Placement,
        ready: Fence,
        stream: Stream,
        owed: Owed,
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
            self._room.abort(placement, ())
            own.release(after)
            raise
        self.host_copies.add(copied)  # close() waits for it before freeing the fallback
        try:
            await wait_fences([copied])
            if self._closed():  # no receiver can take a handle of a closed sender
                raise CacheClosedError("the IPC sender closed while send copied to the host")
        except BaseException as exc:
            if isinstance(exc, CopyFailedError):
                self._metrics.fault("copy_failed")
            self._room.abort(placement, ())
            own.release([copied])
            raise
        finally:
            # Forgotten once landed, also when this send was cancelled while it copied.
            assert self._watcher is not None
            self._watcher.when_done([copied], functools.partial(self.host_copies.discard, copied))
        # The device memory goes back before the handle exists: the seed bug kept it.
        own.release([copied])
        handle = self.publish(placement, shape, dtype, b"")
        self._control.mark_ready(placement.slot, handle.seq, True)
        return self.lease(placement, handle, copied, owed)

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

    def publish(
        self, placement: Placement, shape: tuple[int, ...], dtype: torch.dtype, event: bytes
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

    def lease(
        self, placement: Placement, handle: FeatureHandle, written: Fence, owed: Owed
    ) -> FeatureHandle:
        """Hold placement for handle's receivers (the send's room becomes a lease)."""
        assert self._ledger is not None
        self._ledger.add(Lease(handle, placement.arena, placement.block, written, *owed))
        self._room.settle(placement)
        self._gauges.request()
        return handle

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
