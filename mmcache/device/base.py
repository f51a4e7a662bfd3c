"""The Device interface: streams, fences, device memory and asynchronous copies."""

from __future__ import annotations

import abc
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Final, Protocol, final, overload

import torch

from mmcache.device.plan import Copied, CopyPlan, NewCopyPlan
from mmcache.errors import InvalidValueError

__all__ = [
    "DONE",
    "AllFences",
    "Copied",
    "CopyPlan",
    "ArenaProgress",
    "DeferredFence",
    "Device",
    "Fence",
    "PIN_PACE",
    "NewCopyPlan",
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

    def ok(self) -> bool:
        """Done without error: what a read asks first (one call where done() and
        exception() would be two)."""
        return self.done() and self.exception() is None


#: on_pinned(arena, ready) -> hurry: the host arena's first ready bytes are pinned (called
#: from the pinning thread). True asks for the next chunk at once (the pinned room left is
#: short, or someone waits for the whole arena); False lets the pinning go at PIN_PACE.
ArenaProgress = Callable[[torch.Tensor, int], bool]

#: A pinning thread in no hurry waits PIN_PACE times as long as its last chunk took to pin
#: before the next: pinning holds a driver lock that every kernel launch of the process
#: waits for, so an engine serving while the arena pins keeps that lock 3/4 of the time.
PIN_PACE: Final = 3.0

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

    #: True when submitted copies themselves keep their destinations' (and "d2d" copies
    #: their sources') memory from reuse until done (CUDA: record_stream on the copy's
    #: stream; allocation on it for a NewCopyPlan), so dropping an alias at once is safe;
    #: False when release() must be given the copy's fence: release(t, after=() if
    #: device.copies_keep_destinations else (fence,)).
    copies_keep_destinations: bool = False

    #: The CUDA device ordinal, on which CUDA IPC memory is opened and host memory
    #: pinned; None where the device is no CUDA GPU (the simulator).
    cuda_index: int | None = None

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

    # --- memory -------------------------------------------------------------

    @abc.abstractmethod
    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """True if tensor lives in this device's memory."""

    @abc.abstractmethod
    def adopt(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        """Take ownership of a device tensor: return the cache's own alias of it."""

    def empty(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: Stream | None = None,
        *,
        host: bool = False,
    ) -> torch.Tensor:
        """Allocate an uninitialised device tensor owned by the cache, for use on stream;
        with host, a host tensor the caller will own, fit to receive an asynchronous copy."""
        if host:
            return torch.empty(tuple(shape), dtype=dtype)
        return self._empty(shape, dtype, stream)

    def one_pinned_range(self, host: torch.Tensor) -> bool:
        """Whether a host tensor of the arena lies in one pinned range, so that one device
        copy may read or write it whole (the driver refuses a copy over two registrations)."""
        return True

    @abc.abstractmethod
    def release(self, tensor: torch.Tensor, after: Sequence[Fence]) -> None:
        """Give back the cache's alias of device memory once every fence in after is done.

        Where copies_keep_destinations is False, after must hold the fence of any copy
        still reading or writing it (True: a copy keeps its own operands until done)."""

    #: When the arena is made of separately pinned chunks, a block must not
    #: straddle two of them (one copy cannot span two registrations).
    arena_chunk_bytes: int | None = None

    def host_arena(
        self, nbytes: int, on_pinned: ArenaProgress | None = None
    ) -> Future[torch.Tensor]:
        """Allocate the host arena once (pinned on CUDA), a flat uint8 tensor, in the
        background where pinning is slow; this default makes it at once.

        A device that pins the arena piece by piece calls on_pinned(arena, ready), from its
        pinning thread, each time the arena's first ready bytes are pinned, so that they
        can be used before the rest; the future's result is the whole arena.
        """
        future: Future[torch.Tensor] = Future()
        try:
            future.set_result(self._host_arena(nbytes))
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)
        return future

    def use_on(self, tensor: torch.Tensor, stream: Stream) -> None:  # noqa: B027 - optional hook
        """Tell the allocator that stream uses tensor (CUDA record_stream); default: nothing."""

    def use_all_on(self, tensors: Iterable[torch.Tensor], stream: Stream) -> None:
        """use_on of each of tensors (the outputs of one batch read)."""
        for tensor in tensors:
            self.use_on(tensor, stream)

    #: Said after the device's name in errors, where its tensors report another device.
    tensor_note: str = ""

    #: True if poison_host overwrites host bytes (the simulator), so that callers skip
    #: building a view for nothing on devices that do not.
    poisons_host: bool = False

    def poison_host(  # noqa: B027 - optional hook
        self, host: torch.Tensor, start: int = 0, stop: int | None = None, *, unused: bool = False
    ) -> None:
        """Overwrite bytes start..stop (default: all) of a host tensor, freed or fresh, so
        that an early reader sees poison, never plausible data (the simulator; CUDA does
        nothing).

        unused: host is a host arena whose bytes start..stop are about to be handed out;
        only the pages no block used before are poisoned (the simulator poisons an arena
        on first use rather than all at once when made: a production-sized arena then
        costs memory only as it is used).
        """

    # --- copies (queued on the device's copy streams) -------------------------

    @overload
    def submit(self, plan: CopyPlan) -> Fence: ...

    @overload
    def submit(self, plan: NewCopyPlan) -> Copied: ...

    def submit(self, plan: CopyPlan | NewCopyPlan) -> Fence | Copied:
        """Queue the copies plan describes, routed by its direction (see CopyPlan and
        NewCopyPlan): a CopyPlan's fence, or a NewCopyPlan's new tensor and fence."""
        direction = plan.direction
        srcs = plan.srcs
        if type(plan) is CopyPlan:
            into = plan.into
            if direction == "d2h" and plan.stream is None:
                if into is not None:
                    return self._copy_d2h_batch(
                        srcs, into, plan.offsets, plan.after, owned=plan.owned
                    )
                if len(srcs) == 1:
                    return self._copy_d2h(srcs[0], plan.dsts[0], plan.after)
                return _all(
                    [
                        self._copy_d2h(src, dst, plan.after)
                        for src, dst in zip(srcs, plan.dsts, strict=True)
                    ]
                )
            if direction == "h2d" and plan.stream is None:
                dsts = plan.dsts if into is None else _slices(srcs, into, plan.offsets)
                if len(srcs) == 1:
                    return self._copy_h2d(srcs[0], dsts[0], plan.after)
                return self._copy_h2d_many(srcs, dsts, plan.after)
            if direction == "d2d" and plan.stream is not None:
                stream = plan.stream
                for fence in plan.after:
                    self.wait_on(stream, fence)
                if into is not None:
                    return self._copy_d2d_into(srcs, into, plan.offsets, stream, plan.views)
                if len(srcs) == 1 and not plan.dsts_held:
                    return self._copy_d2d(srcs[0], plan.dsts[0], stream)
                pairs = list(zip(srcs, plan.dsts, strict=True))
                return self._copy_d2d_many(pairs, stream, dsts_held=plan.dsts_held)
            raise _bad_plan(plan)
        if type(plan) is not NewCopyPlan:
            raise InvalidValueError(f"submit takes a CopyPlan or NewCopyPlan, not {plan!r}")
        stream = plan.stream
        if direction == "h2d":
            if plan.offsets:
                if plan.shape is None or len(plan.shape) != 1:
                    raise InvalidValueError("a packed NewCopyPlan needs shape (nbytes,)")
                nbytes = plan.shape[0]
                if stream is not None:
                    return self._upload_packed_on(srcs, plan.offsets, nbytes, stream, plan.after)
                return self._copy_h2d_packed(srcs, plan.offsets, nbytes, plan.after)
            src = _one(srcs)
            shape = src.shape if plan.shape is None else plan.shape
            dtype = src.dtype if plan.dtype is None else plan.dtype
            if stream is not None:
                return self._upload_on(src, shape, dtype, stream, plan.after)
            return self._copy_h2d_new(src, shape, dtype, plan.after)
        if direction == "d2h" and stream is None:
            src = _one(srcs)
            dst = self.empty(tuple(src.shape), src.dtype, host=True)
            return dst, self._copy_d2h(src, dst, plan.after)
        if direction == "d2d" and stream is not None:
            for fence in plan.after:
                self.wait_on(stream, fence)
            if plan.rows:
                return self._pack(srcs, stream)
            return self._copy_d2d_new(_one(srcs), stream)
        raise _bad_plan(plan)

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

    # --- what a device implements: memory and copies behind the verbs above -----------

    @abc.abstractmethod
    def _empty(
        self, shape: Sequence[int], dtype: torch.dtype, stream: Stream | None
    ) -> torch.Tensor:
        """empty() of device memory: allocate for use on stream (None: the device's choice)."""

    @abc.abstractmethod
    def _host_arena(self, nbytes: int) -> torch.Tensor:
        """Allocate the host arena at once: a flat uint8 tensor of nbytes."""

    @abc.abstractmethod
    def _copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
        """Queue src (device) -> dst (host, same byte size) after the fences; return its fence."""

    @abc.abstractmethod
    def _copy_h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
        """Queue src (host) -> dst (device, same byte size) after the fences; return its fence."""

    @abc.abstractmethod
    def _copy_d2d(self, src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> Fence:
        """Queue src -> dst on stream (compaction of views at put); return its fence."""

    def _copy_h2d_new(
        self, src: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, after: Sequence[Fence]
    ) -> tuple[torch.Tensor, Fence]:
        """A new device tensor of shape and dtype filled from src (host, same byte size)
        after the fences: empty() then a copy, as one step a device may make cheaper."""
        dst = self._empty(shape, dtype, None)
        try:
            return dst, self._copy_h2d(src, dst, after)
        except BaseException:
            self.release(dst, after=())  # nothing was queued: nothing reads it
            raise

    def _upload_on(
        self,
        src: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, Fence | None]:
        """NewCopyPlan "h2d" with a stream (see there). This default copies on the H2D
        stream (_copy_h2d_new) and returns its fence."""
        return self._copy_h2d_new(src, shape, dtype, after)

    def _upload_packed_on(
        self,
        srcs: Sequence[torch.Tensor],
        offsets: Sequence[int],
        nbytes: int,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, Fence | None]:
        """_upload_on for several host sources (flat bytes) packed into one new flat uint8
        device buffer of nbytes, each at its offset. This default copies on the H2D stream
        (_copy_h2d_packed) and returns its fence."""
        return self._copy_h2d_packed(srcs, offsets, nbytes, after)

    def _copy_h2d_packed(
        self,
        srcs: Sequence[torch.Tensor],
        offsets: Sequence[int],
        nbytes: int,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, Fence]:
        """Several host sources (flat bytes) into one new flat uint8 device buffer of
        nbytes, each at its offset, on the H2D stream (_copy_h2d_many)."""
        buffer = self._empty((nbytes,), torch.uint8, None)
        dsts = [buffer[o : o + src.numel()] for src, o in zip(srcs, offsets, strict=True)]
        try:
            return buffer, self._copy_h2d_many(srcs, dsts, after)
        except BaseException:
            del dsts
            self.release(buffer, after=())  # nothing was queued: nothing reads it
            raise

    def _copy_h2d_many(
        self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], after: Sequence[Fence]
    ) -> Fence:
        """Queue srcs[i] (host) -> dsts[i] (device, same byte size) after the fences, behind
        one fence that fails if any copy fails: the host hits of one batch read."""
        return _all([self._copy_h2d(src, dst, after) for src, dst in zip(srcs, dsts, strict=True)])

    def _copy_d2h_batch(
        self,
        srcs: Sequence[torch.Tensor],
        host: torch.Tensor,
        offsets: Sequence[int],
        after: Sequence[Fence],
        *,
        owned: bool = False,
    ) -> Fence:
        """CopyPlan "d2h" into host (a flat uint8 host tensor, the arena) at offsets, behind
        one fence that fails if any copy fails (see CopyPlan). Batches complete in the order
        queued (one copy stream): the cache handles landings oldest first and has only the
        oldest one watched."""
        return _all(
            [
                self._copy_d2h(src, host[offset : offset + src.nbytes], after)
                for offset, src in batch_order(srcs, host, offsets)
            ]
        )

    def _copy_d2d_many(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        stream: Stream,
        *,
        dsts_held: bool = False,
    ) -> Fence:
        """Queue each src -> dst of pairs on stream; one fence, failed if any copy fails
        (dsts_held: see CopyPlan)."""
        return _all([self._copy_d2d(src, dst, stream) for src, dst in pairs])

    def _copy_d2d_into(
        self,
        srcs: Sequence[torch.Tensor],
        dst: torch.Tensor,
        offsets: Sequence[int],
        stream: Stream,
        views: Views | None = None,
    ) -> Fence:
        """CopyPlan "d2d" into dst (a flat uint8 tensor of this device, kept valid by the
        caller until the fence is done, as the IPC pool) at offsets, on stream; one fence."""
        check_flat_destination(srcs, dst, offsets)
        pairs = destination_pairs(srcs, dst, offsets, views)
        return self._copy_d2d_many(pairs, stream, dsts_held=True)

    def _copy_d2d_new(self, src: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, Fence]:
        """A new device tensor of src's shape and dtype, allocated for stream and filled from
        src (this device, contiguous) on stream: empty then a copy, as one step a device
        may make cheaper. The caller keeps src valid until the fence is done."""
        dst = self._empty(src.shape, src.dtype, stream)
        try:
            return dst, self._copy_d2d(src, dst, stream)
        except BaseException:
            self.release(dst, after=())  # nothing was queued: nothing reads it
            raise

    def _pack(self, srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, Fence]:
        """A new device tensor holding srcs' rows back to back, filled on stream (see
        NewCopyPlan "d2d" with rows)."""
        packed = self._empty(packed_shape(srcs), srcs[0].dtype, stream)
        fences = []
        start = 0
        for src in srcs:
            stop = start + src.shape[0]
            fences.append(self._copy_d2d(src, packed[start:stop], stream))
            start = stop
        return packed, _all(fences)


def _all(fences: list[Fence]) -> Fence:
    """One fence for the copies: the one, or all of them."""
    return fences[0] if len(fences) == 1 else AllFences(fences)


def _one(srcs: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(srcs) != 1:
        raise InvalidValueError(f"this NewCopyPlan copies one source, not {len(srcs)}")
    return srcs[0]


def _slices(
    srcs: Sequence[torch.Tensor], into: torch.Tensor, offsets: Sequence[int]
) -> list[torch.Tensor]:
    """Each source's destination: into's bytes at its offset."""
    return [into[o : o + src.nbytes] for src, o in zip(srcs, offsets, strict=True)]


def _bad_plan(plan: CopyPlan | NewCopyPlan) -> InvalidValueError:
    if plan.direction not in ("h2d", "d2h", "d2d"):
        return InvalidValueError(f"copy direction must be h2d, d2h or d2d, not {plan.direction!r}")
    if plan.direction == "d2d":
        return InvalidValueError("a d2d copy needs the stream it runs on")
    return InvalidValueError(
        f"{plan.direction} copies run on the device's copy stream: no stream for them"
    )


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

    def ok(self) -> bool:
        return self.resolved().ok()

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

    def ok(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        return True


#: A fence that is already done.
DONE: Fence = _CompletedFence()


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
    """A "d2h" CopyPlan into a host tensor as (offset, source) pairs in host order, its
    arguments checked."""
    if not srcs:
        raise InvalidValueError("a d2h copy into a host tensor needs at least one source")
    if len(srcs) != len(offsets):
        raise InvalidValueError(f"{len(srcs)} sources but {len(offsets)} offsets")
    if host.device.type != "cpu" or host.dtype != torch.uint8 or host.dim() != 1:
        raise InvalidValueError(
            f"a d2h copy writes into a flat uint8 host tensor, not a {host.dtype} "
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
    """A "d2d" CopyPlan into a flat tensor: a flat uint8 destination, each source's bytes
    inside it."""
    if dst.dtype != torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise InvalidValueError(
            f"a d2d copy into a tensor writes into a flat uint8 tensor, not a {dst.dtype} "
            f"tensor of shape {tuple(dst.shape)}"
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
    """A "d2d" CopyPlan into a flat tensor as (source, typed destination) pairs: each
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
