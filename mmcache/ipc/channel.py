"""SenderChannel: one sender as a receiver sees it (its control block, our lane, its memory).

A receive or lease opens its handle's slot here (checks it against the slice the sender
published, leases it), waits for the sender's copy into it, reads the sender's memory
mapped once, and releases the slot; close() leaves the sender and unmaps its memory.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Final

import torch

from mmcache.closing import run_each
from mmcache.device import Device, Fence, Stream
from mmcache.device.cuda import as_cuda_stream
from mmcache.errors import CopyFailedError
from mmcache.ipc.control import WHERE_CODES, ControlBlock
from mmcache.ipc.cuda_ipc import PeerPool, pin_off_the_loop
from mmcache.ipc.errors import (
    HandleExpiredError,
    InvalidHandleError,
    NoPeerAccessError,
    SenderGoneError,
)
from mmcache.ipc.handle import FeatureBatch, FeatureHandle, SenderEndpoint
from mmcache.ipc.pool import ArenaViews
from mmcache.ipc.shm import SharedSegment

__all__ = ["Sent", "SenderChannel"]

log = logging.getLogger("mmcache.ipc")

# The ready mark is a shared cell the sender's fence callback writes from another process:
# nothing can wake this loop when it changes without a channel per receiver. Handles
# usually arrive after their copy finished (no wait at all); otherwise short sleeps,
# doubling from 50 us to 2 ms, bound the delay without spinning a core. CUDA receivers
# of pool slices wait on the slot's IPC event on their stream instead.
_POLL_MIN_S: Final = 50e-6
_POLL_MAX_S: Final = 2e-3
_SENDER_CHECK_S: Final = 0.1
#: One send as a receiver reads it: a feature, or the features of one send_many.
Sent = FeatureHandle | FeatureBatch


class SenderChannel:
    """One sender as a receiver sees it: its control block, our lane, its memory mapped once."""

    def __init__(
        self,
        endpoint: SenderEndpoint,
        control: ControlBlock,
        lane: int,
        epoch: int,
        when_kept_read: Callable[[SenderChannel], None],
    ) -> None:
        self.endpoint = endpoint
        self.control = control
        self.lane = lane
        self.epoch = epoch
        self.sim_pool: ArenaViews | None = None
        self.fallback: ArenaViews | None = None
        self.peer_pool: PeerPool | None = None
        self.peer_views: ArenaViews | None = None  # the peer pool's memory
        self._segments: list[SharedSegment] = []
        self._unpin: Callable[[], None] | None = None
        self._mapping_fallback: asyncio.Future[None] | None = None
        # What still reads the sender's memory: receives, leases and the fallback's mapping
        # under way (counted on the loop's thread), copies queued out of it (any thread,
        # under lock). close() waits for them, or keeps the channel.
        self.readers = 0
        self.pending: set[Fence] = set()
        self.lock = threading.Lock()
        self.kept = False  # close() timed out on it: closed once nothing reads it
        self._when_kept_read = when_kept_read  # a read of a kept channel ended

    def start_reading(self) -> None:
        self.readers += 1

    def stop_reading(self) -> None:
        self.readers -= 1
        if self.kept:
            self._when_kept_read(self)

    def busy(self) -> bool:
        """Whether anything still reads the sender's memory: a copy counts until its slice
        is released (a fence done, its report not yet run, still owes the release)."""
        with self.lock:
            copies = bool(self.pending)
        return self.readers > 0 or copies

    def release(self, handle: Sent) -> None:
        """Tell the sender we are done with handle's bytes (any thread)."""
        self.control.release(handle.slot, self.lane, handle.seq)

    def sim_pool_views(self) -> ArenaViews:
        if self.sim_pool is None:
            e = self.endpoint
            self.sim_pool = ArenaViews(self._map(e.pool_path, "pool", e.pool_nbytes))
        return self.sim_pool

    def cuda_pool_views(self, device: Device) -> ArenaViews:
        if self.peer_views is None:
            self.peer_views = ArenaViews(self.cuda_pool(device).tensor)
        return self.peer_views

    async def fallback_views(self, device: Device) -> ArenaViews:
        if self.fallback is None:
            # Mapped and pinned once, also for receives that ask meanwhile; counted as a
            # reader until pinned, wherever the receive that started it went.
            if self._mapping_fallback is None:
                self.start_reading()
                self._mapping_fallback = asyncio.ensure_future(self._map_fallback(device))
            await asyncio.shield(self._mapping_fallback)
        assert self.fallback is not None
        return self.fallback

    async def _map_fallback(self, device: Device) -> None:
        try:
            e = self.endpoint
            tensor = self._map(e.fallback_path, "fallback", e.fallback_nbytes)
            index = device.cuda_index
            if index is not None:
                # Pinned in this process too, the copy to the GPU is asynchronous and fast.
                try:
                    self._unpin = await pin_off_the_loop(index, tensor, read_only=True)
                except Exception as exc:
                    reason = str(exc)
                    log.warning("cannot pin the IPC host fallback (%s); copies are slower", reason)
            self.fallback = ArenaViews(tensor)
        finally:
            self._mapping_fallback = None
            self.stop_reading()

    def cuda_pool(self, device: Device) -> PeerPool:
        if self.peer_pool is None:
            index = device.cuda_index
            if index is None:
                raise NoPeerAccessError(
                    f"a receiver on {device.name} cannot read a CUDA IPC pool; the sender "
                    "falls back to host memory for receivers that registered before its send "
                    "(call FeatureReceiver.connect(sender.endpoint) first)"
                )
            e = self.endpoint
            self.peer_pool = PeerPool(e.control_path, e.pid, e.cuda_pool, e.pool_nbytes, index)
        return self.peer_pool

    def open(self, handle: Sent) -> None:
        """Check handle against the slice its sender published, lease its slot, then check
        the slot still holds this send."""
        control, slot = self.control, handle.slot
        if slot >= control.n_slots:
            raise InvalidHandleError(
                f"{handle.describe()} names slot {slot}; its sender has {control.n_slots}"
            )
        # Read between two reads of the seq: the sender rewrites a slot's record only
        # after it cleared the seq (ControlBlock.arm).
        before = control.slot_seq(slot)
        published = control.published(slot)
        if before != handle.seq or control.slot_seq(slot) != handle.seq:
            raise HandleExpiredError(
                f"{handle.describe()} is not held by its sender: it was received twice by this "
                "receiver, or arrived after the sender reclaimed it or closed, or its seq was "
                "altered"
            )
        claimed = (WHERE_CODES[handle.where], handle.offset, handle.nbytes, handle.slice_digest())
        if published != claimed:
            raise InvalidHandleError(
                f"{handle.describe()} does not match the slice its sender published for that "
                "send (where, offset, size, dtype, shape or event differ); the handle was "
                "altered. Nothing was read"
            )
        if control.leased(slot, self.lane) == handle.seq:
            # Read once per receiver: our release of the first read lets the sender reuse
            # the slice while a second one would still be reading it.
            raise HandleExpiredError(
                f"{handle.describe()} was already received or leased by this receiver; "
                "each receiver reads a handle once (keep the tensor received)"
            )
        control.lease(slot, self.lane, handle.seq)
        if control.slot_seq(slot) != handle.seq:
            raise HandleExpiredError(
                f"{handle.describe()} is no longer held by its sender: it was received twice "
                "by this receiver, or arrived after the sender reclaimed it (it credits a "
                "receiver that died with what it owed), or the sender closed"
            )

    async def wait_ready(
        self, handle: Sent, stream: Stream, device: Device, check_open: Callable[[], None]
    ) -> None:
        """Order stream (of device) after the sender's copy (CUDA IPC event), or wait for its
        ready mark; check_open raises if the receiver closed meanwhile."""
        if handle.where == "pool" and handle.cuda_event and device.kind == "cuda":
            event = self.cuda_pool(device).event(handle.cuda_event)
            if event is not None:
                as_cuda_stream(stream).wait_event(event)
                return
        control, slot, seq = self.control, handle.slot, handle.seq
        delay = 0.0
        next_check = time.monotonic() + _SENDER_CHECK_S
        while True:
            mark = control.ready(slot)
            if mark == seq:
                return
            if mark == -seq:
                raise CopyFailedError(f"the sender's copy into {handle.describe()} failed")
            if control.slot_seq(slot) != seq:
                raise HandleExpiredError(f"{handle.describe()} was reclaimed before it was ready")
            now = time.monotonic()
            if now >= next_check:
                if not control.sender_alive():
                    raise SenderGoneError(
                        f"the sender of {handle.describe()} closed or exited before it was ready"
                    )
                next_check = now + _SENDER_CHECK_S
            await asyncio.sleep(delay)
            check_open()
            delay = min(_POLL_MAX_S, max(_POLL_MIN_S, delay * 2))

    def close(self) -> None:
        """Leave the sender (it reclaims what we still owed) and unmap its memory."""
        peer_pool, self.peer_pool = self.peer_pool, None
        unpin, self._unpin = self._unpin, None
        self.sim_pool = self.fallback = self.peer_views = None
        steps: list[Callable[[], object]] = [
            functools.partial(self.control.leave, self.lane, self.epoch)
        ]
        if peer_pool is not None:
            steps.append(peer_pool.close)
        if unpin is not None:
            steps.append(unpin)
        steps += [segment.close for segment in self._segments]
        steps.append(functools.partial(self.control.close, unlink=False))
        run_each(steps)

    def _map(self, path: str, tag: str, nbytes: int) -> torch.Tensor:
        """The first nbytes of the sender's segment tag ("pool", "fallback"), read-only."""
        if not path:
            raise InvalidHandleError(f"the sender of this handle has no {tag} segment")
        try:
            segment = SharedSegment.attach(path, tag)
        except FileNotFoundError:
            raise SenderGoneError(
                f"the sender's {tag} segment ({path}) is gone: the sender closed or exited"
            ) from None
        if segment.nbytes < nbytes:
            segment.close()
            raise InvalidHandleError(
                f"the sender's {tag} segment ({path}) is smaller than the sender published"
            )
        self._segments.append(segment)
        return segment.tensor()[:nbytes]
