"""FeatureReceiver: opens handles, waits for their data, copies it out, releases the slice.

A receiver registers once per sender (a lane in the sender's control block,
with its pid, so the sender can tell when it has died) and maps the sender's
memory once, read-only. Each receive checks the handle against what its
sender published (the endpoint's digest, and the slot's seq and slice), leases
the slot, waits for the sender's ready signal, copies the bytes to the
receiver's device and releases the slot once that copy has read them. A handle
that does not match raises InvalidHandleError before anything is leased or
read; the receiver stays usable.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from typing import Final, final

import torch

from mmcache.closing import CloseOnce, off_the_loop, run_each
from mmcache.device import Device, Fence, Stream, resolve_device
from mmcache.device.cuda import as_cuda_stream
from mmcache.device.plan import NewCopyPlan
from mmcache.errors import CacheClosedError, InvalidValueError
from mmcache.ipc.channel import SenderChannel, Sent
from mmcache.ipc.control import ControlBlock
from mmcache.ipc.cuda_ipc import ordinal_of
from mmcache.ipc.errors import (
    HandleExpiredError,
    InvalidHandleError,
    NoPeerAccessError,
    UnknownSenderError,
)
from mmcache.ipc.handle import (
    FeatureBatch,
    FeatureHandle,
    Part,
    SenderEndpoint,
    device_kind,
    dtype_from_name,
)
from mmcache.ipc.pool import ArenaViews
from mmcache.ipc.reaper import FenceReaper
from mmcache.layouts import rows_back_to_back
from mmcache.waiting import wait_fences

__all__ = ["FeatureReceiver"]

log = logging.getLogger("mmcache.ipc")

_CLOSE_POLL_S: Final = 0.005  # close() looks this often for receives and leases to finish
_KNOWN_ENDPOINTS: Final = 64
#: The receives and leases the current context is inside (tasks started there inherit
#: them): a close() awaited inside a lease must not wait for that lease.
_OPEN_READS: ContextVar[frozenset[object]] = ContextVar(
    "mmcache_ipc_open_reads", default=frozenset()
)


class FeatureReceiver:
    """Receives features sent by FeatureSenders in other processes (or this one) onto its device."""

    def __init__(self, device: str | Device = "cuda") -> None:
        self._owns_device = not isinstance(device, Device)
        self._device = resolve_device(device)
        self._kind = device_kind(self._device)
        self._channels: dict[str, SenderChannel] = {}
        self._closed = False
        self._closing = CloseOnce(cleans_up_when_cancelled=True)  # see _close
        self._reads: set[object] = set()  # receives and leases under way
        self._closers: list[frozenset[object]] = []  # the reads each close() caller is inside
        # Channels close on threads, kept ones once nothing reads them: a device we made
        # closes after the last (guarded by the lock, with each channel's kept mark).
        self._kept_lock = threading.Lock()
        self._unclosed = 0
        self.received = 0
        self._releases = FenceReaper()  # slices released once their reads are done
        #: id -> (endpoint, its channel) for endpoint objects already matched (kept alive here).
        self._known_endpoints: dict[int, tuple[SenderEndpoint, SenderChannel]] = {}

    @property
    def device(self) -> Device:
        """The device received features are copied to."""
        return self._device

    async def connect(self, endpoint: SenderEndpoint) -> None:
        """Register with a sender ahead of its first handle (so it knows our device and pid)."""
        self._check_open()
        self._channel(endpoint)

    async def receive(self, handle: FeatureHandle, *, stream: Stream | None = None) -> torch.Tensor:
        """The feature of handle as a new tensor on this receiver's device; releases the slice.

        On CUDA the tensor is ordered on stream (the current one if None) after the
        copy; the slice is released once the copy has run. On the simulator it is
        returned once the copy has run. A handle that does not match what its sender
        published raises InvalidHandleError (HandleExpiredError for one already
        recycled) before anything is read.
        """
        if stream is None:
            stream = self._device.current_stream()  # read before any await: it is per thread
        (out,) = await self._receive(handle, FeatureHandle, stream)
        return out

    async def receive_many(
        self, batch: FeatureBatch, *, stream: Stream | None = None
    ) -> list[torch.Tensor]:
        """The features of a send_many, in the order sent, as new tensors on this device.

        As receive(), for the whole batch at once: one copy of its slice (the tensors
        are views of one new buffer), one ordering, one release.
        """
        if stream is None:
            stream = self._device.current_stream()
        return await self._receive(batch, FeatureBatch, stream)

    async def _receive(
        self, sent: Sent, kind: type[FeatureHandle] | type[FeatureBatch], stream: Stream
    ) -> list[torch.Tensor]:
        self._check_open()
        self._releases.reap(full=False)  # slices read by now go back before we take another
        channel = self._verified_channel(sent, kind)
        channel.open(sent)
        with _Read(self._reads, channel, in_context=False):
            try:
                await channel.wait_ready(sent, stream, self._device, self._check_open)
                arena = await self._arena(channel, sent)
                if isinstance(sent, FeatureHandle):  # copied as the feature itself
                    src = arena.view(sent.offset, sent.shape, dtype_from_name(sent.dtype))
                else:  # one copy of the whole slice, split below
                    src = arena.flat[sent.offset : sent.offset + sent.nbytes]
                dst, fence = self._copy_out(src, stream)
                del src
            except BaseException:
                channel.release(sent)  # nothing of ours reads the slice
                raise
            after = () if self._device.copies_keep_destinations else (fence,)  # our alias's
            try:
                # The caller's tensors: aliases of dst, never dst itself (released below).
                if isinstance(sent, FeatureHandle):
                    out = [dst.detach()]
                else:
                    out = _features(ArenaViews(dst.detach()), 0, sent.parts)
            except BaseException:
                self._device.release(dst, after)
                self._release_after(channel, sent, fence, verify=False)
                raise
            self._device.release(dst, after)
            del dst
            if self._device.stream_ordered_reads:
                self._release_after(channel, sent, fence, verify=True)
                self.received += len(out)
                return out
            try:
                await wait_fences([fence])
            except BaseException:
                self._release_after(channel, sent, fence, verify=False)
                raise
            intact = channel.control.slot_seq(sent.slot) == sent.seq
            channel.release(sent)
            if not intact:
                raise HandleExpiredError(
                    f"{sent.describe()} was reclaimed by its sender while it was being "
                    "read; the data read is not trustworthy (see the sender's log for why it "
                    "reclaimed it)"
                )
            self.received += len(out)
            return out

    @contextlib.asynccontextmanager
    async def lease(
        self, handle: FeatureHandle, *, stream: Stream | None = None
    ) -> AsyncIterator[torch.Tensor]:
        """Zero-copy: the feature's bytes where they are, held for us until the block exits.

        A pool slice on CUDA is a tensor of this receiver's device (ordered on
        stream); a host fallback block (and the simulator's pool) is a host tensor
        over read-only memory: writing to it faults. Do not keep it past the block:
        the slice is reused once the work queued on stream meanwhile is done.
        """
        if stream is None:
            stream = self._device.current_stream()
        read, views = await self._lease_begin(handle, FeatureHandle, stream)
        try:
            yield views[0]
        finally:
            del views
            self._lease_end(read, handle, stream)

    @contextlib.asynccontextmanager
    async def lease_many(
        self, batch: FeatureBatch, *, stream: Stream | None = None
    ) -> AsyncIterator[list[torch.Tensor]]:
        """Zero-copy: the features of a send_many where they are, as lease() gives one."""
        if stream is None:
            stream = self._device.current_stream()
        read, views = await self._lease_begin(batch, FeatureBatch, stream)
        try:
            yield views
        finally:
            del views
            self._lease_end(read, batch, stream)

    async def _lease_begin(
        self, sent: Sent, kind: type[FeatureHandle] | type[FeatureBatch], stream: Stream
    ) -> tuple[_Read, list[torch.Tensor]]:
        """A lease's start: its read entered (_lease_end exits it) and its views."""
        self._check_open()
        self._releases.reap(full=False)  # slices read by now go back before we take another
        channel = self._verified_channel(sent, kind)
        channel.open(sent)
        # Tagged in the context: a close() awaited inside the lease does not wait for it.
        read = _Read(self._reads, channel, in_context=True)
        read.__enter__()
        try:
            await channel.wait_ready(sent, stream, self._device, self._check_open)
            views = _features(await self._arena(channel, sent), sent.offset, sent.parts)
        except BaseException:
            try:
                channel.release(sent)
            finally:
                read.__exit__()
            raise
        return read, views

    def _lease_end(self, read: _Read, sent: Sent, stream: Stream) -> None:
        """A lease's end: its slice released after the work queued on stream meanwhile."""
        try:
            self._release_after(read.channel, sent, self._device.record(stream), verify=True)
        finally:
            read.__exit__()

    async def close(self, timeout: float | None = 10.0) -> None:  # noqa: ASYNC109
        """Wait (up to timeout s in all) for receives and leases under way and for copies
        still reading senders' memory, then leave every sender and unmap its memory.

        A sender whose memory is still read after the timeout (an open lease, a copy that
        never ends) is neither left nor unmapped until that read ends: the reader keeps
        valid memory, and the sender keeps the slices leased; a device this receiver made
        closes after the last such sender. A close() awaited inside a lease (also through
        tasks started there) does not wait for that lease. Every call returns once the
        whole close has, but for those kept senders (mmcache.closing).
        """
        if not self._closing.begun:
            self._closed = True  # before any await: no receive starts from here on
        inside = _OPEN_READS.get() & self._reads
        self._closers.append(inside)
        try:
            await self._closing.run(functools.partial(self._close, timeout))
        finally:
            self._closers.remove(inside)

    async def _close(self, timeout: float | None) -> None:  # noqa: ASYNC109
        deadline = None if timeout is None else time.monotonic() + timeout
        channels = list(self._channels.values())
        self._channels.clear()
        self._known_endpoints.clear()
        with self._kept_lock:
            self._unclosed = len(channels)
        # A receive under way may still start a copy out of a sender's memory, a lease's
        # caller still reads it, and a queued copy's slice is released once it is reported
        # done: they finish first (a receive still waiting for its data stops, closed),
        # except the reads close()'s callers are inside (they would wait for themselves).
        try:
            while self._still_read(channels):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                await asyncio.sleep(_CLOSE_POLL_S)
                self._releases.reap()
        except BaseException:  # cancelled as the loop shuts down: each goes once unread
            for channel in channels:
                with self._kept_lock:
                    channel.kept = True
                self._close_kept(channel)
            raise
        steps: list[Callable[[], object]] = []
        for channel in channels:
            with self._kept_lock:  # a copy reported meanwhile finds the mark set, or not
                channel.kept = channel.busy()
            if channel.kept:
                log.warning(
                    "FeatureReceiver closed while the memory of the IPC sender (pid %d) was "
                    "still read; it stays mapped and leased until that read ends",
                    channel.endpoint.pid,
                )
            else:
                steps.append(functools.partial(self._release, channel))
        if not channels and self._owns_device:
            steps.append(self._device.close)
        if steps:
            # Off the loop: unmapping a sender's pool waits for the whole GPU, and
            # unpinning a large fallback holds the thread for a while.
            await off_the_loop(functools.partial(run_each, steps))

    def _still_read(self, channels: list[SenderChannel]) -> bool:
        excused = frozenset[object]().union(*self._closers) & self._reads
        if sum(channel.readers for channel in channels) > len(excused):
            return True
        return any(channel.busy() for channel in channels if not channel.readers)

    def _release(self, channel: SenderChannel) -> None:
        """Leave channel's sender and unmap its memory; after the last channel, close the
        device we made (any thread)."""
        try:
            channel.close()
        finally:
            with self._kept_lock:
                self._unclosed -= 1
                last = not self._unclosed
            if last and self._owns_device:
                self._device.close()

    def _close_kept(self, channel: SenderChannel) -> None:
        """A channel close() kept: release it on a thread once nothing reads it (any thread;
        needs no event loop, which may have ended by then)."""
        with self._kept_lock:
            if not channel.kept or channel.busy():
                return
            channel.kept = False
        threading.Thread(target=self._release_kept, args=(channel,), name="mmcache-close").start()

    def _release_kept(self, channel: SenderChannel) -> None:
        try:
            self._release(channel)
        except Exception:  # nobody awaits this release
            log.exception("FeatureReceiver: closing a channel after its last read failed")

    async def __aenter__(self) -> FeatureReceiver:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("this FeatureReceiver is closed")

    def _verified_channel(
        self, sent: Sent, kind: type[FeatureHandle] | type[FeatureBatch]
    ) -> SenderChannel:
        """The channel to the sender of sent, once sent is well formed and its endpoint
        is the one the sender published (InvalidHandleError otherwise)."""
        if not isinstance(sent, kind):
            what = "FeatureHandle" if kind is FeatureHandle else "FeatureBatch"
            hint = " (receive_many / lease_many take one)" if isinstance(sent, FeatureBatch) else ""
            raise InvalidHandleError(f"expected a {what}, got {type(sent).__name__}{hint}")
        # An endpoint object already matched to its channel (handles parsed from bytes
        # share one per sender) is not checked field by field again.
        known = self._known_endpoints.get(id(sent.sender))
        if known is not None and known[0] is sent.sender:
            sent.check(endpoint_checked=True)
            return known[1]
        sent.check()
        channel = self._channel(sent.sender)
        if len(self._known_endpoints) >= _KNOWN_ENDPOINTS:
            self._known_endpoints.clear()
        self._known_endpoints[id(sent.sender)] = (sent.sender, channel)
        return channel

    def _channel(self, endpoint: SenderEndpoint) -> SenderChannel:
        if not isinstance(endpoint, SenderEndpoint):
            raise InvalidValueError(f"expected a SenderEndpoint, got {type(endpoint).__name__}")
        endpoint.check()
        channel = self._channels.get(endpoint.control_path)
        if channel is not None:
            if channel.endpoint != endpoint:
                raise InvalidHandleError(
                    f"this endpoint of sender pid {endpoint.pid} differs from the one its "
                    "control block publishes; the handle was altered"
                )
            return channel
        self._leave_gone_senders()
        try:
            control = ControlBlock.attach(endpoint.control_path)
        except FileNotFoundError:
            raise UnknownSenderError(
                f"the IPC sender (pid {endpoint.pid}) is gone: its control block "
                f"{endpoint.control_path} does not exist (it closed or exited, or the "
                "handle was altered)"
            ) from None
        try:
            if control.endpoint_digest != endpoint.digest() or control.sender_pid != endpoint.pid:
                raise InvalidHandleError(
                    f"this endpoint of sender pid {endpoint.pid} differs from the one its "
                    f"control block {endpoint.control_path} publishes; the handle was altered"
                )
            lane, epoch = control.register(os.getpid(), self._peer_ok(endpoint))
        except BaseException:
            control.close(unlink=False)
            raise
        channel = SenderChannel(endpoint, control, lane, epoch, self._close_kept)
        self._channels[endpoint.control_path] = channel
        return channel

    def _leave_gone_senders(self) -> None:
        """Leave the senders that closed or exited and whose memory nothing reads any more:
        a receiver whose senders are replaced would keep each old one's memory mapped."""
        for path, channel in list(self._channels.items()):
            if channel.control.sender_alive() or channel.busy():
                continue
            del self._channels[path]
            self._known_endpoints = {
                key: known
                for key, known in self._known_endpoints.items()
                if known[1] is not channel
            }
            # On a thread: unmapping a pool waits for the whole GPU, unpinning takes a while.
            threading.Thread(target=self._leave_gone, args=(channel,), name="mmcache-close").start()

    @staticmethod
    def _leave_gone(channel: SenderChannel) -> None:
        try:
            channel.close()
        except Exception:  # nobody awaits this release
            log.exception("FeatureReceiver: leaving an IPC sender that is gone failed")

    def _peer_ok(self, endpoint: SenderEndpoint) -> bool:
        """Whether this receiver can read the sender's pool where it is."""
        if endpoint.device_kind == "sim" or not endpoint.cuda_pool:
            return True  # shared host memory: every device can read it
        index = self._device.cuda_index
        if index is None:
            return False
        sender = ordinal_of(endpoint.device_uuid)
        if sender is None:
            return False
        return sender == index or bool(torch.cuda.can_device_access_peer(index, sender))

    async def _arena(self, channel: SenderChannel, handle: Sent) -> ArenaViews:
        """The sender's memory that holds handle's bytes, once they are checked to lie in it."""
        if handle.where == "host":
            arena = await channel.fallback_views(self._device)
        elif handle.sender.device_kind == "sim":
            arena = channel.sim_pool_views()
        else:
            arena = channel.cuda_pool_views(self._device)
        if handle.offset + handle.nbytes > arena.flat.numel():
            # The published record says otherwise: never read past it.
            raise InvalidHandleError(f"{handle.describe()} reaches past its sender's memory")
        return arena

    def _copy_out(self, src: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, Fence]:
        """Queue src -> a new tensor on this device, usable on stream; return it and its fence.

        src is the sender's memory, which stays mapped (and the slice leased) until the
        fence is done: the copies need not keep it for the allocator.
        """
        device = self._device
        if device.is_device_tensor(src):
            dst, fence = device.submit(NewCopyPlan("d2d", (src,), stream=stream))
            assert fence is not None  # a d2d copy always has one
            return dst, fence
        if src.device.type == "cpu":
            dst, fence = device.submit(NewCopyPlan("h2d", (src,)))
            assert fence is not None  # one on the H2D stream always has one
            device.wait_on(stream, fence)
            device.use_on(dst, stream)
            return dst, fence
        if src.device.type == "cuda":
            # A sender in this process on another GPU: torch copies between its own devices.
            dst = device.empty(src.shape, src.dtype, stream)
            with torch.cuda.stream(as_cuda_stream(stream)):
                dst.copy_(src, non_blocking=True)
            return dst, device.record(stream)
        raise NoPeerAccessError(f"a receiver on {device.name} cannot read memory on {src.device}")

    def _release_after(
        self, channel: SenderChannel, handle: Sent, fence: Fence, *, verify: bool
    ) -> None:
        """Release handle's slice once fence (the last read of it) is done (FenceReaper:
        found by this loop, or by device threads once the loop stops looking)."""
        if fence.done():
            self._released(channel, handle, fence, verify)
            return
        with channel.lock:
            channel.pending.add(fence)
        self._releases.add(fence, functools.partial(self._released, channel, handle, fence, verify))

    def _released(self, channel: SenderChannel, handle: Sent, fence: Fence, verify: bool) -> None:
        """fence is done: release handle's slice (any thread)."""
        if verify and channel.control.slot_seq(handle.slot) != handle.seq:
            log.error(
                "%s was reclaimed by its sender while it was read: the tensor received "
                "may hold other data",
                handle.describe(),
            )
        channel.release(handle)
        with channel.lock:  # after the release: a close() must not leave before it
            channel.pending.discard(fence)
        # Not `if channel.kept`: unlocked, that read could miss a mark close() is
        # setting just now; _close_kept looks under the lock.
        self._close_kept(channel)


def _features(arena: ArenaViews, offset: int, parts: Sequence[Part]) -> list[torch.Tensor]:
    """Each part of a slice at offset in arena as a tensor of its shape and dtype."""
    rows = (
        rows_back_to_back(parts, dtype_from_name(parts[0][2]).itemsize) if len(parts) > 1 else None
    )
    if rows is not None:
        # A request's features alike (rows of one dtype and row shape, no gap between):
        # one view of them all, split by rows in one call instead of a view per part.
        at, shape, dtype = parts[0]
        whole = arena.view(offset + at, (sum(rows), *shape[1:]), dtype_from_name(dtype))
        return list(torch.split(whole, rows))
    return [arena.view(offset + at, shape, dtype_from_name(dtype)) for at, shape, dtype in parts]


@final
class _Read:
    """A receive or lease under way on a channel, as a context manager: close() waits for
    it (in_context: not a close() awaited in the context it was entered in)."""

    __slots__ = ("_in_context", "_reads", "channel")

    def __init__(self, reads: set[object], channel: SenderChannel, *, in_context: bool) -> None:
        self._reads = reads
        self.channel = channel
        self._in_context = in_context

    def __enter__(self) -> None:
        self.channel.start_reading()
        self._reads.add(self)
        if self._in_context:
            _OPEN_READS.set(_OPEN_READS.get() | {self})

    def __exit__(self, *exc_info: object) -> None:
        if self._in_context:
            # Not reset to a token: a lease may end in another context than it began in.
            _OPEN_READS.set(_OPEN_READS.get() - {self})
        self._reads.discard(self)
        self.channel.stop_reading()
