"""The Device interface: streams, fences, device memory and asynchronous copies."""

from __future__ import annotations

import abc
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, final

import torch

from mmcache.errors import InvalidValueError

__all__ = [
    "AllFences",
    "ArenaProgress",
    "DeferredFence",
    "Device",
    "Fence",
    "Stream",
    "Views",
    "batch_order",
    "check_flat_destination",
    "destination_pairs",
    "feature_bytes",
    "host_memory_bytes",
    "storage_use_count",
]


class Stream(Protocol):
    """An ordered queue of device work (a CUDA stream, or a simulated one)."""


class Fence(abc.ABC):
    """Marks a point in a stream: done once all work queued before it has completed."""

    __slots__ = ()

    @abc.abstractmethod
    def done(self) -> bool:
        """Return True once the work before the fence has completed (successfully or not)."""

    @abc.abstractmethod
    def exception(self) -> BaseException | None:
        """The error of the work before the fence, once done; None on success."""

    @abc.abstractmethod
    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call fn() once the fence is done, from any thread (at once if known to be done).

        A device that waits for fences in threads should not hold fn behind a fence that
        completes after this one (CudaDevice: not while one of its 8 waiter threads is
        free or already waits on this fence's stream in order).
        """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until done or timeout; return done(). Never on the loop."""

    def resolved(self) -> Fence:
        """The recorded fence this stands for: itself, but for a DeferredFence."""
        return self


#: on_pinned(arena, ready): the host arena's first ready bytes are pinned (any thread).
ArenaProgress = Callable[[torch.Tensor, int], None]

#: views(offset, shape, dtype): the bytes of a flat buffer from offset as a typed tensor.
Views = Callable[[int, tuple[int, ...], torch.dtype], torch.Tensor]


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, which the host tier cannot exceed; None when
    the system does not say."""
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows), or no such name
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def storage_use_count(tensor: torch.Tensor) -> int:
    """Number of tensor objects that share tensor's storage (names do not count)."""
    # The temporary storage object made by untyped_storage() holds one count itself.
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)) - 1


class Device(abc.ABC):
    """Where features live, and the only way the cache touches their bytes.

    Every operation that reads or writes device memory or the host arena is
    queued here and returns a Fence; memory handed to release() is reused
    only after the fences it is given.
    """

    #: "cuda:0", "sim", ...
    name: str

    #: What the device is: "sim" (the simulator) or "cuda"; callers that must treat memory
    #: differently by device (the IPC pool) read this rather than the device's type.
    kind: str

    #: True when a consumer stream can be ordered after a fence without host
    #: synchronisation (CUDA). False when consumers read on the host thread
    #: (the simulator): then the cache awaits the fence before handing out data.
    stream_ordered_reads: bool

    #: True when copy_h2d and copy_d2d themselves keep their destination's (and copy_d2d
    #: its source's) memory from reuse until the copy is done (CUDA: record_stream on the
    #: copy's stream), so dropping an alias at once is safe; False when release() must be
    #: given the copy's fence (see after_copy).
    copies_keep_destinations: bool = False

    # --- streams and fences -------------------------------------------------

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The calling thread's current stream (read at call entry by put/get)."""

    @abc.abstractmethod
    def record(self, stream: Stream) -> Fence:
        """A fence that completes after all work queued on stream so far."""

    @abc.abstractmethod
    def wait_on(self, stream: Stream, fence: Fence) -> None:
        """Make later work on stream wait for fence (no host synchronisation)."""

    def completed_fence(self) -> Fence:
        """A fence that is already done."""
        return _DONE

    # --- memory -------------------------------------------------------------

    @abc.abstractmethod
    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """True if tensor lives in this device's memory."""

    @abc.abstractmethod
    def adopt(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        """Take ownership of a device tensor: return the cache's own alias of it."""

    @abc.abstractmethod
    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, stream: Stream | None = None
    ) -> torch.Tensor:
        """Allocate an uninitialised device tensor owned by the cache, for use on stream."""

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor a caller will own, fit to receive an asynchronous copy."""
        return torch.empty(tuple(shape), dtype=dtype)

    def one_pinned_range(self, host: torch.Tensor) -> bool:
        """Whether a host tensor of the arena lies in one pinned range, so that one device
        copy may read or write it whole (the driver refuses a copy over two registrations)."""
        return True

    def after_copy(self, fence: Fence) -> tuple[Fence, ...]:
        """The fences a release() of a tensor this device's copy (fence) reads or writes
        must wait for: none where the copy keeps its memory until done."""
        return () if self.copies_keep_destinations else (fence,)

    @abc.abstractmethod
    def release(self, tensor: torch.Tensor, after: Sequence[Fence]) -> None:
        """Give back the cache's alias of device memory once every fence in after is done."""

    @abc.abstractmethod
    def host_arena(self, nbytes: int) -> torch.Tensor:
        """Allocate the host arena once (pinned on CUDA): a flat uint8 tensor."""

    #: When the arena is made of separately pinned chunks, a block must not
    #: straddle two of them (one copy cannot span two registrations).
    arena_chunk_bytes: int | None = None

    def host_arena_async(
        self, nbytes: int, on_pinned: ArenaProgress | None = None
    ) -> Future[torch.Tensor]:
        """Allocate the host arena in the background (pinning is slow); default: at once.

        A device that pins the arena piece by piece calls on_pinned(arena, ready), from its
        pinning thread, each time the arena's first ready bytes are pinned, so that they
        can be used before the rest; the future's result is the whole arena.
        """
        future: Future[torch.Tensor] = Future()
        try:
            future.set_result(self.host_arena(nbytes))
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)
        return future

    def use_on(self, tensor: torch.Tensor, stream: Stream) -> None:  # noqa: B027 - optional hook
        """Tell the allocator that stream uses tensor (CUDA record_stream); default: nothing."""

    #: Said after the device's name in errors, where its tensors report another device.
    tensor_note: str = ""

    #: True if poison_host overwrites freed host blocks (the simulator), so that callers
    #: skip building a view for nothing on devices that do not.
    poisons_host: bool = False

    def poison_host(self, view: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Overwrite a freed host block (the simulator poisons it; CUDA does nothing)."""

    def hand_out_host(self, arena: torch.Tensor, start: int, stop: int) -> None:  # noqa: B027
        """Bytes start..stop of a host arena are about to be handed out (with poisons_host).

        The simulator poisons arena pages here, on first use, rather than all at once when
        the arena is made: a production-sized arena then costs memory only as it is used.
        """

    # --- copies (queued on the device's copy streams) -------------------------

    @abc.abstractmethod
    def copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
        """Queue src (device) -> dst (host, same byte size) after the fences; return its fence."""

    @abc.abstractmethod
    def copy_h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
        """Queue src (host) -> dst (device, same byte size) after the fences; return its fence."""

    def copy_h2d_new(
        self, src: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, after: Sequence[Fence]
    ) -> tuple[torch.Tensor, Fence]:
        """A new device tensor of shape and dtype filled from src (host, same byte size)
        after the fences: empty() then copy_h2d(), as one step a device may make cheaper."""
        dst = self.empty(shape, dtype)
        try:
            return dst, self.copy_h2d(src, dst, after)
        except BaseException:
            self.release(dst, after=())  # nothing was queued: nothing reads it
            raise

    def upload_on(
        self,
        src: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, Fence | None]:
        """A new device tensor of shape and dtype filled from src (host) for a reader on
        stream, after the fences; copied on stream itself where the device can.

        Returns the tensor and the fence readers must still order after, or None where the
        copy is queued on stream, stream order alone covers it and the tensor is the
        caller's (nothing to release). Either way the copy reads src until work queued on
        stream so far is done: a fence recorded on stream later covers that read. This
        default copies on the H2D stream (copy_h2d_new) and returns its fence.
        """
        return self.copy_h2d_new(src, shape, dtype, after)

    def upload_packed_on(
        self,
        srcs: Sequence[torch.Tensor],
        offsets: Sequence[int],
        nbytes: int,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, Fence | None]:
        """upload_on for several host sources (flat bytes) packed into one new flat uint8
        device buffer of nbytes, each at its offset: one allocation, one ordering.

        Returns the buffer and the fence of its copies, or None as upload_on does. This
        default copies on the H2D stream (copy_h2d_many) and returns its fence.
        """
        buffer = self.empty((nbytes,), torch.uint8)
        dsts = [buffer[o : o + src.numel()] for src, o in zip(srcs, offsets, strict=True)]
        try:
            return buffer, self.copy_h2d_many(srcs, dsts, after)
        except BaseException:
            del dsts
            self.release(buffer, after=())  # nothing was queued: nothing reads it
            raise

    def copy_h2d_many(
        self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], after: Sequence[Fence]
    ) -> Fence:
        """Queue srcs[i] (host) -> dsts[i] (device, same byte size) after the fences, behind
        one fence that fails if any copy fails: the host hits of one batch read."""
        fences = [self.copy_h2d(src, dst, after) for src, dst in zip(srcs, dsts, strict=True)]
        return fences[0] if len(fences) == 1 else AllFences(fences)

    def copy_d2h_batch(
        self,
        srcs: Sequence[torch.Tensor],
        host: torch.Tensor,
        offsets: Sequence[int],
        after: Sequence[Fence],
        *,
        owned: bool = False,
    ) -> Fence:
        """Queue copies of srcs (device, contiguous) into host's bytes at offsets, after
        the fences, behind one fence that fails if any copy fails.

        host is a flat uint8 host tensor (the arena); the byte ranges must not overlap.
        Unlike copy_d2h, the caller keeps every source alive until the fence is done: a
        batch is many small features, and per-source allocator bookkeeping adds up.
        Batches complete in the order queued (one copy stream): the cache handles
        landings oldest first and has only the oldest one watched.

        owned: the sources are the cache's own aliases (whole, contiguous tensors of this
        device with no lazy conjugate or negation, checked at put) and the ranges are its
        host pool's blocks, which never overlap; a device may then skip checking each
        source and the ranges' overlap again (not their bounds).
        """
        fences = [
            self.copy_d2h(src, host[offset : offset + src.nbytes], after)
            for offset, src in batch_order(srcs, host, offsets)
        ]
        return fences[0] if len(fences) == 1 else AllFences(fences)

    @abc.abstractmethod
    def copy_d2d(self, src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> Fence:
        """Queue src -> dst on stream (compaction of views at put); return its fence."""

    def copy_d2d_many(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        stream: Stream,
        *,
        dsts_held: bool = False,
    ) -> Fence:
        """Queue each src -> dst of pairs on stream; one fence, failed if any copy fails.

        The copies may run in any order among themselves: no pair may read or write bytes
        that another pair writes.

        dsts_held: the caller keeps every destination valid until the fence is done (memory
        outside the device's allocator, such as the IPC pool), so a device may skip keeping
        them for the copies.
        """
        fences = [self.copy_d2d(src, dst, stream) for src, dst in pairs]
        return fences[0] if len(fences) == 1 else AllFences(fences)

    def copy_d2d_into(
        self,
        srcs: Sequence[torch.Tensor],
        dst: torch.Tensor,
        offsets: Sequence[int],
        stream: Stream,
        views: Views | None = None,
    ) -> Fence:
        """Queue each of srcs (this device, any layout) into the bytes of dst (a flat uint8
        tensor of this device, kept valid by the caller until the fence is done, as the IPC
        pool) at offsets, on stream; one fence. The ranges written may not overlap each
        other or the sources (the copies may run in any order). views(offset, shape,
        dtype) makes a typed destination where a copy needs one (default: a slice of dst
        viewed as it)."""
        check_flat_destination(srcs, dst, offsets)
        pairs = destination_pairs(srcs, dst, offsets, views)
        return self.copy_d2d_many(pairs, stream, dsts_held=True)

    def copy_d2d_new(self, src: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, Fence]:
        """A new device tensor of src's shape and dtype, allocated for stream and filled from
        src (this device, contiguous) on stream: empty() then copy_d2d(), as one step a
        device may make cheaper. The caller keeps src valid until the fence is done."""
        dst = self.empty(src.shape, src.dtype, stream)
        try:
            return dst, self.copy_d2d(src, dst, stream)
        except BaseException:
            self.release(dst, after=())  # nothing was queued: nothing reads it
            raise

    def pack(self, srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, Fence]:
        """A new device tensor holding srcs' rows back to back, filled on stream.

        srcs share dtype and the shape after their first dimension (views welcome). The
        copies are ordered after earlier work on stream; the caller keeps the sources
        referenced until the fence (the copies', failed if any of them fails) is done.
        """
        packed = self.empty(packed_shape(srcs), srcs[0].dtype, stream)
        fences = []
        start = 0
        for src in srcs:
            stop = start + src.shape[0]
            fences.append(self.copy_d2d(src, packed[start:stop], stream))
            start = stop
        return packed, fences[0] if len(fences) == 1 else AllFences(fences)

    # --- lifecycle ------------------------------------------------------------

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background threads; queued work is completed first."""

    @property
    def memory_bytes(self) -> int | None:
        """The device's whole memory in bytes, which its GPU tier cannot exceed; None when
        unknown (then no budget is checked against it)."""
        return None

    def describe(self) -> dict[str, Any]:
        """A few facts about the device for logs and benchmark tables."""
        return {"name": self.name}


class AllFences(Fence):
    """Done when every fence is done; carries the first error among them."""

    __slots__ = ("_fences", "_first_pending")

    def __init__(self, fences: Sequence[Fence]) -> None:
        self._fences = list(fences)
        self._first_pending = 0  # fences before this one are done (they stay done)

    def done(self) -> bool:
        # Resume where the last call stopped: polling a batch of n fences is O(n) in all,
        # not O(n) a call.
        fences = self._fences
        i = self._first_pending
        while i < len(fences) and fences[i].done():
            i += 1
        self._first_pending = i
        return i == len(fences)

    def exception(self) -> BaseException | None:
        for f in self._fences:
            exc = f.exception()
            if exc is not None:
                return exc
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        left = [len(self._fences)]
        if not left[0]:
            fn()
            return
        lock = threading.Lock()

        def one_done() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn()

        for f in self._fences:
            f.add_done_callback(one_done)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in self._fences:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not f.wait(left):
                return False
        return True


@final
class DeferredFence(Fence):
    """A fence on a stream that is recorded when first needed rather than when made.

    Recorded later than it was made, it completes after all the work its stream had queued
    then and perhaps after some queued since: whoever orders after it never waits too
    little, at worst a little longer. Devices order work after resolved().
    """

    __slots__ = ("_device", "_fence", "_stream")

    def __init__(self, device: Device, stream: Stream) -> None:
        self._device = device
        self._stream = stream
        self._fence: Fence | None = None

    @property
    def recorded(self) -> bool:
        """Whether the fence has been recorded on its stream."""
        return self._fence is not None

    def resolved(self) -> Fence:
        """Record the fence now if not yet recorded; return it."""
        fence = self._fence
        if fence is None:
            # Two threads may both record here: either fence covers the work, one stays.
            fence = self._fence = self._device.record(self._stream)
        return fence

    def done(self) -> bool:
        return self.resolved().done()

    def exception(self) -> BaseException | None:
        fence = self._fence
        return None if fence is None else fence.exception()  # not recorded: not failed yet

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self.resolved().add_done_callback(fn)

    def wait(self, timeout: float | None = None) -> bool:
        return self.resolved().wait(timeout)


class _CompletedFence(Fence):
    __slots__ = ()

    def done(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        return True


_DONE = _CompletedFence()


def packed_shape(srcs: Sequence[torch.Tensor]) -> tuple[int, ...]:
    """The shape of srcs' rows back to back (they share the shape after dimension 0)."""
    return (sum(src.shape[0] for src in srcs), *srcs[0].shape[1:])


def feature_bytes(device: Device, value: object, caller: str) -> int:
    """Bytes of value if it is a tensor in device's memory; InvalidValueError otherwise."""
    if not isinstance(value, torch.Tensor):
        raise InvalidValueError(f"{caller} takes a torch.Tensor, not {type(value).__name__}")
    if not device.is_device_tensor(value):
        raise InvalidValueError(
            f"{caller} needs a tensor on {device.name}, got one on {value.device} "
            f"(move it with .to({device.name!r}) first)"
        )
    nbytes: int = value.nbytes
    return nbytes


def batch_order(
    srcs: Sequence[torch.Tensor], host: torch.Tensor, offsets: Sequence[int]
) -> list[tuple[int, torch.Tensor]]:
    """copy_d2h_batch's (offset, source) pairs in host order, its arguments checked."""
    if not srcs:
        raise InvalidValueError("copy_d2h_batch needs at least one source")
    if len(srcs) != len(offsets):
        raise InvalidValueError(f"{len(srcs)} sources but {len(offsets)} offsets")
    if host.device.type != "cpu" or host.dtype != torch.uint8 or host.dim() != 1:
        raise InvalidValueError(
            f"copy_d2h_batch writes into a flat uint8 host tensor, not a {host.dtype} "
            f"tensor of shape {tuple(host.shape)} on {host.device}"
        )
    # Offloads allocate blocks front to back, so this is mostly sorted already (linear).
    ordered = sorted(zip(offsets, srcs, strict=True), key=_offset_of)
    limit = host.numel()
    end = 0
    for offset, src in ordered:
        nbytes = src.nbytes
        if offset < 0 or offset + nbytes > limit:
            raise InvalidValueError(
                f"a copy of {nbytes} bytes at offset {offset} falls outside the "
                f"{limit}-byte host tensor"
            )
        if offset < end:
            raise InvalidValueError(f"copy destinations overlap at offset {offset}")
        end = offset + nbytes
    return ordered


def check_flat_destination(
    srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int]
) -> None:
    """copy_d2d_into's arguments: a flat uint8 destination, each source's bytes inside it."""
    if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise InvalidValueError(
            f"copy_d2d_into writes into a flat uint8 tensor, not a {dst.dtype} tensor of "
            f"shape {tuple(dst.shape)}"
        )
    if len(srcs) != len(offsets):
        raise InvalidValueError(f"{len(srcs)} sources but {len(offsets)} offsets")
    limit = dst.numel()
    for src, offset in zip(srcs, offsets, strict=True):
        if offset < 0 or offset + src.nbytes > limit:
            raise InvalidValueError(
                f"a copy of {src.nbytes} bytes at offset {offset} falls outside the "
                f"{limit}-byte destination"
            )


def destination_pairs(
    srcs: Sequence[torch.Tensor], dst: torch.Tensor, offsets: Sequence[int], views: Views | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """copy_d2d_into's copies as (source, typed destination) pairs, for copy_d2d_many: each
    destination made by views (default: a slice of dst viewed as the source's dtype)."""
    make = views if views is not None else functools.partial(typed_view, dst)
    return [
        (src, make(offset, tuple(src.shape), src.dtype))
        for src, offset in zip(srcs, offsets, strict=True)
    ]


def typed_view(
    flat: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """flat's bytes from offset (a multiple of dtype's size) as a tensor of shape and dtype."""
    nbytes = math.prod(shape) * dtype.itemsize
    return flat[offset : offset + nbytes].view(dtype).view(shape)


def _offset_of(pair: tuple[int, torch.Tensor]) -> int:
    return pair[0]
