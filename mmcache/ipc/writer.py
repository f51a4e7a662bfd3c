"""SliceWriter: copies sends into their room and publishes each slice's record and lease."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Final

import torch

from mmcache.device import CopyPlan, Device, Fence, Stream
from mmcache.errors import CacheClosedError, CopyFailedError
from mmcache.ipc.control import ControlBlock
from mmcache.ipc.handle import FeatureBatch, FeatureHandle, Part, SenderEndpoint, dtype_name
from mmcache.ipc.leases import Lease, LeaseLedger
from mmcache.ipc.memory import SenderMemory
from mmcache.ipc.reaper import FenceReaper
from mmcache.ipc.room import Placement, SendRoom
from mmcache.metrics import CacheMetrics, DeferredPush
from mmcache.waiting import FenceWatcher, wait_fences

__all__ = ["MAX_BATCH", "Owed", "SliceWriter", "Source", "part_offsets", "release_all"]

#: The receivers registered at send, and how many releases the send is owed.
Owed = tuple[frozenset[tuple[int, int]], int]
#: Features of one send_many at most (each is a part of one published record).
MAX_BATCH: Final = 1024
#: Where each feature of a batch starts in its slice: a multiple of this (every dtype's
#: alignment, and a whole number of the GPU's memory transactions).
PART_ALIGNMENT: Final = 256


def part_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Each feature's offset in a slice holding features of sizes back to back, aligned;
    and the slice's bytes."""
    offsets, end = [], 0
    for size in sizes:
        at = -(-end // PART_ALIGNMENT) * PART_ALIGNMENT
        offsets.append(at)
        end = at + size
    return offsets, end


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


def _held_tensors(owns: Sequence[Source]) -> list[torch.Tensor]:
    """The tensor each source still holds (none of them released yet)."""
    tensors = []
    for own in owns:
        assert own.tensor is not None
        tensors.append(own.tensor)
    return tensors


def release_all(owns: Sequence[Source], after: Sequence[Fence]) -> None:
    """Give every source back after the fences."""
    for own in owns:
        own.release(after)


#: A sent tensor and where it starts in its slice.
Piece = tuple[Source, int]


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
        self._marks = FenceReaper()  # ready marks of pool slices, once their copies are done
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
        pieces: Sequence[Piece],
        placement: Placement,
        ready: Fence,
        stream: Stream,
        owed: Owed,
        batch: bool,
    ) -> FeatureHandle | FeatureBatch:
        """Queue each piece -> its part of a pool slice on the producer's stream; the handle
        goes out at once."""
        owns = [own for own, _ in pieces]
        try:
            parts = self._parts(pieces)
            arena, start = placement.arena, placement.block.offset
            srcs = _held_tensors(owns)
            # On the producer's stream: ordered after the work that made the tensors. The
            # slice is the pool's, kept until the copy is done (placement.after).
            offsets = [start + at for _, at in pieces]
            written = self._device.submit(
                CopyPlan(
                    "d2d",
                    srcs,
                    into=arena.tensor,
                    offsets=offsets,
                    stream=stream,
                    views=arena.views.view,
                )
            )
            del srcs
            placement.after.append(written)
            event = self._record_event(placement.slot, stream)
            handle = self.publish(placement, parts, event, batch)
        except BaseException:
            self._room.abort(placement, ())
            release_all(owns, placement.after or [ready])
            raise
        mark = functools.partial(self._mark_ready, placement.slot, handle.seq, written)
        if event:  # receivers order on the event: the mark is for those that cannot open it
            self._marks.add(written, mark)
        else:  # receivers poll the mark: published as soon as a device thread sees the copy
            written.add_done_callback(mark)
        release_all(owns, () if self._device.copies_keep_destinations else (written,))
        return self.lease(placement, handle, written, owed)

    async def write_host(
        self,
        pieces: Sequence[Piece],
        placement: Placement,
        ready: Fence,
        stream: Stream,
        owed: Owed,
        batch: bool,
    ) -> FeatureHandle | FeatureBatch:
        """Copy the pieces into a shared host block, release them, and only then hand out
        the handle."""
        assert self._control is not None
        owns = [own for own, _ in pieces]
        after: list[Fence] = [ready]  # the copies wait for the tensors' makers
        try:
            parts = self._parts(pieces)
            placement.arena.commit(placement.block)
            for own, _ in pieces:
                assert own.tensor is not None
                if not own.tensor.is_contiguous():
                    # A device-to-host copy needs one dense range: pack the view on the device.
                    packed = self._device.empty(own.tensor.shape, own.tensor.dtype, stream)
                    try:
                        compacted = self._device.submit(
                            CopyPlan("d2d", (own.tensor,), (packed,), stream=stream)
                        )
                    except BaseException:
                        # No source owns it yet: nothing else would give it back.
                        self._device.release(packed, ())
                        raise
                    own.replace(packed, [compacted])
                    after = [compacted]  # the last on stream: after the tensors' makers too
            srcs = _held_tensors(owns)
            offsets = [at for _, at in pieces]
            copied = self._device.submit(
                CopyPlan("d2h", srcs, into=placement.block.view, offsets=offsets, after=after)
            )
            placement.after.append(copied)
        except BaseException:
            self._room.abort(placement, ())
            release_all(owns, after)
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
            release_all(owns, [copied])
            raise
        finally:
            # Forgotten once landed, also when this send was cancelled while it copied.
            assert self._watcher is not None
            self._watcher.when_done([copied], functools.partial(self.host_copies.discard, copied))
        # The device memory goes back before the handle exists: the seed bug kept it.
        release_all(owns, [copied])
        handle = self.publish(placement, parts, b"", batch)
        self._control.mark_ready(placement.slot, handle.seq, True)
        return self.lease(placement, handle, copied, owed)

    @staticmethod
    def _parts(pieces: Sequence[Piece]) -> tuple[Part, ...]:
        """What the handle says of each piece: its offset in the slice, shape and dtype."""
        parts = []
        for own, at in pieces:
            assert own.tensor is not None
            parts.append((at, tuple(own.tensor.shape), dtype_name(own.tensor.dtype)))
        return tuple(parts)

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
        self, placement: Placement, parts: tuple[Part, ...], event: bytes, batch: bool
    ) -> FeatureHandle | FeatureBatch:
        """The handle of a new send into placement, its slice published in the slot."""
        assert self._endpoint is not None and self._control is not None
        seq = self._next_seq()
        handle: FeatureHandle | FeatureBatch
        if batch:
            handle = FeatureBatch(
                self._endpoint, seq, placement.slot, placement.where, placement.block.offset,
                parts, event,
            )  # fmt: skip
        else:
            ((_, shape, dtype),) = parts
            handle = FeatureHandle(
                self._endpoint, seq, placement.slot, placement.where, placement.block.offset,
                shape, dtype, event,
            )  # fmt: skip
        placement.seq = seq  # set first: a failure in arm() still invalidates the slot
        self._control.arm(
            placement.slot,
            seq,
            placement.where,
            handle.offset,
            handle.nbytes,
            handle.slice_digest(),
        )
        return handle

    def lease(
        self,
        placement: Placement,
        handle: FeatureHandle | FeatureBatch,
        written: Fence,
        owed: Owed,
    ) -> FeatureHandle | FeatureBatch:
        """Hold placement for handle's receivers (the send's room becomes a lease)."""
        assert self._ledger is not None
        self._ledger.add(Lease(handle, placement.arena, placement.block, written, *owed))
        self._room.settle(placement)
        self._gauges.request()
        return handle

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq
