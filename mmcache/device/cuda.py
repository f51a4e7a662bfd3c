"""CudaDevice: the Device interface over torch.cuda (copy streams, event fences, a pinned arena)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import itertools
import logging
import math
import mmap
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, final

import torch

from mmcache.device.base import Device, Fence, Stream, batch_order, packed_shape
from mmcache.device.cuda_driver import BatchCopier, CudaDriver, FenceSleeper
from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    DeviceOutOfMemoryError,
    InvalidValueError,
    MMCacheError,
)

__all__ = [
    "DEFAULT_PIN_CHUNK_BYTES",
    "DEFAULT_BATCHED_PACK_MAX_BYTES",
    "DEFAULT_PACK_MAX_BYTES",
    "ArenaMethod",
    "CudaDevice",
    "CudaFence",
    "as_cuda_stream",
]

_log = logging.getLogger(__name__)

#: "register": cuMemHostRegister of an anonymous mapping, chunk by chunk (default).
#: "hostalloc": one cuMemHostAlloc call (one region, no chunk boundaries).
ArenaMethod = Literal["register", "hostalloc"]

_MiB: Final = 1 << 20
# Pinning holds a driver lock that every kernel launch and event record in the process
# waits for: one cuMemHostAlloc of 2 GiB held a launch for 1.1 s on the H200 host. In
# chunks of 8 MiB with a pause between them (a waiter gets the lock only if the pinning
# thread lets go for a moment), launches waited 2.3 ms at most (BENCHMARKS.md,
# "Pinning the host arena while serving").
DEFAULT_PIN_CHUNK_BYTES: Final = 8 * _MiB
_PIN_PAUSE_S: Final = 0.0005  # between chunks pinned in the background
#: Feature dtypes whose copy and cat kernels a new device loads before serving.
_WARM_DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)
DEFAULT_PACK_MAX_BYTES: Final = 1 * _MiB  # copies through torch: one copy_ call per run
# Through the driver's batched copies a range costs about 1.5 µs more and no kernel: only
# many small sources are worth gathering first (BENCHMARKS.md, "Tenth session").
DEFAULT_BATCHED_PACK_MAX_BYTES: Final = 512 * 1024
# A packed run of small copies needs a device staging buffer of its size: keep it modest.
_PACK_RUN_MAX_BYTES: Final = 64 * _MiB
_HUGE_PAGE: Final = 2 * _MiB
_MAX_STREAM_OBJECTS: Final = 4096
_PAGE: Final = mmap.PAGESIZE


# torch.cuda.Event's Python methods only fill in defaults and forward to these; a put
# records a fence and the loop queries fences all the time, so they are called directly.
# (torch defines the class in every build: a placeholder where CUDA is missing.)
_EventBase: Any = torch._C._CudaEventBase


def _event_query(event: torch.cuda.Event) -> bool:
    """event.query(), typed."""
    return bool(_EventBase.query(event))


def _new_event() -> torch.cuda.Event:
    """An untimed event that costs the host nothing to record.

    Not a blocking-sync one: with about 56 of those pending on one stream the next record
    there blocks the host until the oldest completes, and a put records a fence on its
    producer's stream, which may run a long kernel. Threads sleep through a FenceSleeper.
    """
    event: torch.cuda.Event = _EventBase.__new__(torch.cuda.Event)
    return event


def _new_stream(device: torch.device, priority: int) -> torch.cuda.Stream:
    """torch.cuda.Stream(device, priority), typed."""
    return torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]


@final
class CudaFence(Fence):
    """A torch.cuda.Event recorded on a stream: done once the GPU has passed it."""

    __slots__ = ("_done", "_error", "_waiters", "event", "seq", "stream")

    def __init__(
        self, event: torch.cuda.Event, stream: torch.cuda.Stream, waiters: _FenceWaiters, seq: int
    ) -> None:
        self.event = event
        self.stream = stream
        self.seq = seq  # fences of one stream complete in this order
        self._waiters = waiters
        self._done = False
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Return True once the work before the fence has completed (successfully or not)."""
        if self._done:
            return True
        try:
            if not _event_query(self.event):
                return False
        except RuntimeError as exc:  # a sticky CUDA error surfaces at the next query
            self._error = CopyFailedError(f"device work before a fence failed: {exc}")
        self._done = True
        return True

    def exception(self) -> BaseException | None:
        """The sticky CUDA error seen while waiting, if any (copies fail at enqueue instead)."""
        return self._error

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call fn() at once if known done, else from one of the device's waiter threads.

        No query here: callers have just looked (a fresh fence is pending anyway), and
        a fence that completed meanwhile only sends fn through a waiter.
        """
        if self._done:
            fn()
        else:
            self._waiters.submit(self, fn)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (polling at up to 1 ms) or until timeout; return done()."""
        if self.done():
            return True
        if timeout is None:
            self.synchronize()
            return True
        deadline = time.monotonic() + timeout  # inf: until done
        pause = 20e-6
        while not self.done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 1e-3)
        return True

    def synchronize(self, sleeper: FenceSleeper | None = None) -> None:
        """Block the calling thread until done: asleep in the driver through sleeper (the
        GIL released), or without one polling at up to 1 ms (the event would spin a core)."""
        if self._done:
            return
        if sleeper is None:
            self.wait(math.inf)  # done() records a sticky error
            return
        try:
            sleeper.sleep_until(self.event.cuda_event)  # a sticky error surfaces here too
        except (RuntimeError, MMCacheError) as exc:
            self._error = CopyFailedError(f"device work before a fence failed: {exc}")
        self._done = True

    def pending_event(self) -> torch.cuda.Event | None:
        """The event to wait on, or None once the fence is known to be done."""
        return None if self._done else self.event


_fence_seq = itertools.count()
_record_lock = threading.Lock()

_Job = tuple["CudaFence", Callable[[], object], "_FenceWaiters"]


@final
class _FenceWaiter:
    """One thread that sleeps on its fences in the order they came, running each callback."""

    __slots__ = ("_device", "_name", "_queue", "_thread", "mixed", "pending", "tail")

    def __init__(self, device: torch.device, name: str) -> None:
        self._device = device
        self._name = name
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # Changed under the pool's lock: the fence of the last job queued, the jobs queued
        # and not yet run, and whether a job was queued out of stream order (a fallback).
        self.tail: CudaFence | None = None
        self.pending = 0
        self.mixed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: _Job | None) -> None:
        self._queue.put(job)

    def join(self, timeout: float | None) -> bool:
        """Wait for the thread to end; return whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        sleeper: FenceSleeper | None = None
        try:
            # Without this the runtime would make a context current on GPU 0 for this
            # thread; the sleeper's driver calls use the context made current here.
            torch.cuda.set_device(self._device)
            sleeper = CudaDriver.get().sleeper(self._device.index or 0)
        except Exception as exc:  # still correct without it: fences are polled instead
            _log.warning("%s: no fence sleeper (%s); polling fences", self._name, exc)
        try:
            # The thread must outlive any callback: the pool keeps sending it jobs.
            while (job := self._queue.get()) is not None:
                fence, fn, pool = job
                # Drop the job before blocking again: its closure may hold tensors or futures.
                del job
                fence.synchronize(sleeper)
                try:
                    fn()
                except BaseException:
                    _log.exception("%s: a fence callback raised", self._name)
                finally:
                    pool.job_done(self)
                del fence, fn
        finally:
            if sleeper is not None:
                sleeper.close()


@final
class _FenceWaiters:
    """Threads that sleep on fences and run their callbacks, none behind a later fence.

    A thread cannot be woken before the fence it sleeps on, so a callback for an early
    fence queued behind one for a later fence would wait for the later one (a get whose
    offload landed, behind a download queued after it). A job therefore goes to a thread
    whose jobs are all of its fence's stream, the last recorded no later than its own
    (fences of one stream complete in order), else to an idle thread, else to a new one.
    Only with max_threads busy does a job go behind later fences: to a thread waiting on
    its stream, else to the one with the fewest jobs (marked mixed: no job chains onto
    it until it is idle).
    """

    __slots__ = ("_closed", "_device", "_lock", "_max_threads", "_name", "_threads")

    def __init__(self, device: torch.device, name: str, max_threads: int = 8) -> None:
        self._device = device
        self._name = name
        self._max_threads = max_threads
        self._threads: list[_FenceWaiter] = []  # started on demand
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fence: CudaFence, fn: Callable[[], object]) -> None:
        """Run fn() on a waiter thread once fence is done."""
        with self._lock:
            if not self._closed:
                waiter = self._pick(fence)
                waiter.tail = fence
                waiter.pending += 1
                waiter.put((fence, fn, self))
                return
        # Closed: no thread is left to wait, so honour the contract on this thread.
        fence.synchronize()
        fn()

    def job_done(self, waiter: _FenceWaiter) -> None:
        with self._lock:
            waiter.pending -= 1
            if not waiter.pending:
                waiter.tail = None  # an idle thread keeps no fence (nor its event) alive
                waiter.mixed = False

    def close(self, timeout: float | None = None) -> None:
        """Run every queued callback, then stop the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = list(self._threads)
            for waiter in threads:
                waiter.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for waiter in threads:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not waiter.join(left):
                _log.warning("%s: fences still pending after %g s at close", self._name, timeout)
                return

    def _pick(self, fence: CudaFence) -> _FenceWaiter:
        idle = None
        stream = fence.stream.cuda_stream
        for waiter in self._threads:
            tail = waiter.tail
            if tail is None:
                idle = idle or waiter
            elif not waiter.mixed and tail.stream.cuda_stream == stream and tail.seq <= fence.seq:
                return waiter  # it completes after everything queued there
        if idle is not None:
            return idle
        if len(self._threads) < self._max_threads:
            waiter = _FenceWaiter(self._device, f"{self._name}-{len(self._threads)}")
            self._threads.append(waiter)
            return waiter
        # All busy: behind this stream's own later fences if a thread has them (fences of
        # one stream come soon after one another), else behind the shortest queue.
        waiter = min(
            self._threads,
            key=lambda w: (w.tail is None or w.tail.stream.cuda_stream != stream, w.pending),
        )
        waiter.mixed = True
        return waiter


@final
class _Keepalive:
    """Holds a tensor until every fence that still uses it is done."""

    __slots__ = ("_lock", "_remaining", "_tensor")

    def __init__(self, tensor: torch.Tensor, fences: int) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._remaining = fences
        self._lock = threading.Lock()

    def fence_done(self) -> None:
        """Count one fence down; drop the tensor after the last."""
        with self._lock:
            self._remaining -= 1
            if self._remaining > 0:
                return
            tensor, self._tensor = self._tensor, None
        # The caching allocator frees (thread-safely) when the last reference goes.
        del tensor


def _release_registered(
    driver: CudaDriver, ordinal: int, ptrs: tuple[int, ...], mapping: mmap.mmap
) -> None:
    """Unregister an arena's chunks; the mapping itself lives on while tensors view it."""
    for ptr in ptrs:
        try:
            driver.host_unregister(ordinal, ptr)
        except MMCacheError as exc:
            _log.warning("unpinning the host arena failed: %s", exc)
    del mapping


def _free_host(driver: CudaDriver, ordinal: int, ptr: int) -> None:
    """Free a cuMemHostAlloc arena once no tensor views it."""
    try:
        driver.free_host(ordinal, ptr)
    except MMCacheError as exc:
        _log.warning("freeing the pinned host arena failed: %s", exc)


# torch.cuda.stream() builds Stream objects on entry and exit (tens of µs on a busy host,
# once per copy); these are the calls underneath it, used where they exist.
_get_current_stream: Callable[[int], tuple[int, int, int]] | None = getattr(
    torch._C, "_cuda_getCurrentStream", None
)
_set_current_stream: Callable[..., None] | None = getattr(torch._C, "_cuda_setStream", None)
_get_current_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)
_set_current_device: Callable[[int], None] | None = getattr(torch._C, "_cuda_setDevice", None)


@final
class _OnStream:
    """Make stream the current one for a block (and its device current), then restore both."""

    __slots__ = ("_fallback", "_prev_device", "_prev_stream", "_stream")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._fallback: Any = None
        self._prev_stream: tuple[int, int, int] | None = None
        self._prev_device = 0

    def __enter__(self) -> None:
        stream = self._stream
        if (
            _get_current_stream is None
            or _set_current_stream is None
            or _get_current_device is None
            or _set_current_device is None
        ):
            self._fallback = torch.cuda.stream(stream)
            self._fallback.__enter__()
            return
        self._prev_device = _get_current_device()
        self._prev_stream = _get_current_stream(stream.device_index)
        _set_current_stream(
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )

    def __exit__(self, *exc_info: object) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc_info)
            return
        assert self._prev_stream is not None and _set_current_stream is not None
        stream_id, device_index, device_type = self._prev_stream
        _set_current_stream(stream_id=stream_id, device_index=device_index, device_type=device_type)
        if self._prev_device != device_index:
            assert _set_current_device is not None
            _set_current_device(self._prev_device)


def as_cuda_stream(stream: Stream) -> torch.cuda.Stream:
    """The torch.cuda.Stream behind stream (a torch.Stream of CUDA type is converted)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    if isinstance(stream, torch.Stream) and stream.device.type == "cuda":
        return torch.cuda.Stream(  # type: ignore[no-untyped-call]
            stream_id=stream.stream_id,
            device_index=stream.device_index,
            device_type=stream.device_type,
        )
    raise InvalidValueError(f"expected a torch.cuda.Stream, got {type(stream).__name__}")


def _flat_bytes(tensor: torch.Tensor, role: str) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (any dtype, 0-dim included)."""
    if tensor.dtype == torch.uint8 and tensor.dim() == 1 and tensor.is_contiguous():
        return tensor  # already flat bytes (host arena blocks): skip the view ops
    if not tensor.is_contiguous():
        raise InvalidValueError(
            f"copy {role} must be contiguous (shape {tuple(tensor.shape)}, "
            f"strides {tensor.stride()}); compact it with copy_d2d first"
        )
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class CudaDevice(Device):
    """The Device interface over torch.cuda: copy streams, event fences and a pinned host arena."""

    stream_ordered_reads = True

    #: None: the host pool may place blocks anywhere. A "register" arena is pinned in
    #: pin_chunk_bytes chunks, and a copy that crosses a chunk boundary is split here, so
    #: blocks may straddle chunks and exceed their size.
    arena_chunk_bytes = None

    #: Batches of at least this many copies into the arena go through the driver's
    #: batched copies; fewer through torch's copy_.
    driver_min_runs: int = 2

    def __init__(
        self,
        index: int | str | torch.device = 0,
        *,
        arena_method: ArenaMethod = "register",
        background_pinning: bool = True,
        pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
        huge_pages: bool = True,
        pack_max_bytes: int | None = None,
        batch_copies: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise MMCacheError(
                "CUDA is not available (no GPU, or a CPU-only torch build); use device='sim'"
            )
        if arena_method not in ("register", "hostalloc"):
            raise InvalidValueError(
                f"arena_method must be 'register' or 'hostalloc', not {arena_method!r}"
            )
        if pin_chunk_bytes <= 0 or pin_chunk_bytes % _PAGE:
            raise InvalidValueError(
                f"pin_chunk_bytes must be a positive multiple of {_PAGE}, not {pin_chunk_bytes}"
            )
        self._device = _resolve_device(index)
        self.name = str(self._device)
        self.index: int = self._device.index if self._device.index is not None else 0
        self.arena_method: ArenaMethod = arena_method
        self.background_pinning = background_pinning
        self.pin_chunk_bytes = pin_chunk_bytes
        self.huge_pages = huge_pages
        self._driver_instance: CudaDriver | None = None
        # Offloads into the arena go through cuMemcpyBatchAsync where the driver has it.
        self._copier: BatchCopier | None = None
        if batch_copies:
            try:
                self._copier = self._driver().batch_copier(self.index)
            except Exception as exc:  # copies still work through torch
                _log.warning("%s: no batched copies through the driver (%s)", self.name, exc)
        if pack_max_bytes is None:
            pack_max_bytes = (
                DEFAULT_PACK_MAX_BYTES if self._copier is None else DEFAULT_BATCHED_PACK_MAX_BYTES
            )
        self.pack_max_bytes = pack_max_bytes
        with torch.cuda.device(self._device):
            # Priorities only order kernels (the copy engines ignore them): the D2H stream runs
            # the packing kernel and should yield to compute; promotions are on the get path.
            self._d2h = _new_stream(self._device, priority=0)
            self._h2d = _new_stream(self._device, priority=-1)
        self._waiters = _FenceWaiters(self._device, f"mmcache-fences-{self.name}")
        self._arena_claimed = False
        self._arena_ptr = 0
        self._arena_nbytes = 0
        self._arena_split_chunk = 0  # chunk size copies are split at; 0 = one registration
        self._arena_finalizer: weakref.finalize[Any, Any] | None = None
        self._pin_thread: threading.Thread | None = None
        self._stream_objects: dict[tuple[int, int, int], torch.cuda.Stream] = {}
        self._closed = False
        self._warm_up()

    def _warm_up(self) -> None:
        """Pay now, once, what a put or get would otherwise pay while serving.

        CUDA loads kernels on first launch, and torch's allocators set up on first use.
        On the H200, in a fresh process, the first packing kernel (torch.cat) took 22 ms,
        the first record_stream 19 ms, and the first pinned host tensor 6.7 ms, each on
        the thread that called it: the event loop's, at the first put or get. Kernels are
        per dtype (_WARM_DTYPES; others pay their first launch when used). Only an
        optimisation: a failure is logged, and the first calls pay as before.
        """
        try:
            with torch.cuda.device(self._device), torch.no_grad():
                for dtype in _WARM_DTYPES:
                    rows = torch.empty(2, 4, 8, dtype=dtype, device=self._device)
                    rows.record_stream(self._d2h)
                    with _OnStream(self._d2h):
                        # torch.cat has a kernel per dimension count: packs of 1-3 dims.
                        for dims in (1, 2, 3):
                            part = rows.reshape(-1) if dims == 1 else rows.flatten(0, 3 - dims)
                            torch.cat([part, part, part])
                        # A contiguous copy is a plain memcpy; a strided source (as
                        # copy_d2d may get) runs torch's copy kernel.
                        rows[0].transpose(0, 1).contiguous()
                torch.empty(_PAGE, dtype=torch.uint8, pin_memory=True)
                # Only the streams used here: a device-wide wait would also wait for (or
                # break a graph capture of) other threads' work.
                self._d2h.synchronize()
        except RuntimeError as exc:
            _log.warning("%s: warming up failed (%s); first copies may be slow", self.name, exc)

    # --- streams and fences -------------------------------------------------

    def current_stream(self) -> Stream:
        """The calling thread's current stream on this device."""
        if _get_current_stream is None:
            return torch.cuda.current_stream(self._device)
        # torch.cuda.current_stream() builds a new Stream object per call (several µs);
        # streams are few (pools of a fixed size), so their objects are kept.
        key = _get_current_stream(self.index)
        stream = self._stream_objects.get(key)
        if stream is None:
            if len(self._stream_objects) >= _MAX_STREAM_OBJECTS:
                self._stream_objects.clear()
            stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                stream_id=key[0], device_index=key[1], device_type=key[2]
            )
            self._stream_objects[key] = stream
        return stream

    def copy_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The dedicated (D2H, H2D) copy streams."""
        return self._d2h, self._h2d

    def synchronize(self) -> None:
        """Block until all work queued on this GPU has completed (tests and benchmarks)."""
        torch.cuda.synchronize(self._device)

    @property
    def d2h_stream(self) -> torch.cuda.Stream:
        """The dedicated device-to-host copy stream."""
        return self._d2h

    @property
    def h2d_stream(self) -> torch.cuda.Stream:
        """The dedicated host-to-device copy stream."""
        return self._h2d

    def record(self, stream: Stream) -> CudaFence:
        """A fence that completes after all work queued on stream so far."""
        return self._record_on(as_cuda_stream(stream))

    def wait_on(self, stream: Stream, fence: Fence) -> None:
        """Make later work on stream wait for fence (no host synchronisation)."""
        event = _pending_event(fence)
        if event is not None:
            as_cuda_stream(stream).wait_event(event)

    # --- memory -------------------------------------------------------------

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """True if tensor lives in this GPU's memory."""
        return tensor.device == self._device

    def adopt(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        """Return the cache's own alias of a tensor on this GPU."""
        if not self.is_device_tensor(tensor):
            raise InvalidValueError(
                f"expected a tensor on {self.name}, got one on {tensor.device}; "
                f"move it to {self.name} first"
            )
        return tensor.detach()

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, stream: Stream | None = None
    ) -> torch.Tensor:
        """Allocate on this GPU from the pool of stream (default: the H2D copy stream).

        The pool is the stream that first writes the memory: a block the caching allocator
        hands out on stream S may still be read by work queued on S before it was freed.
        """
        alloc_stream = self._h2d if stream is None else as_cuda_stream(stream)
        try:
            with _OnStream(alloc_stream):
                return torch.empty(tuple(shape), dtype=dtype, device=self._device)
        except torch.OutOfMemoryError as exc:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            raise DeviceOutOfMemoryError(
                f"could not allocate {nbytes / _MiB:.1f} MiB on {self.name}; lower "
                "MMCACHE_GPU_CACHE_MB (SGLANG_VLM_CACHE_SIZE_MB) or free GPU memory"
            ) from exc

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Pinned, so a download into it is asynchronous (a pageable one blocks the loop).

        Caller-owned results come from torch's caching host allocator: it rounds sizes up,
        but reuses blocks across gets, and these are not the cache's arena.
        """
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        """record_stream: the allocator keeps tensor's block until stream's queued work is done."""
        tensor.record_stream(as_cuda_stream(stream))

    def release(self, tensor: torch.Tensor, after: Sequence[Fence]) -> None:
        """Drop the cache's alias once every fence in after is done.

        Copies this device queued already called record_stream, so only fences of other
        streams (consumers) keep the tensor referenced, from the waiters' callbacks.
        """
        pending = [fence for fence in after if not fence.done()]
        if not pending:
            return
        keepalive = _Keepalive(tensor, len(pending))
        for fence in pending:
            fence.add_done_callback(keepalive.fence_done)

    def host_arena(self, nbytes: int) -> torch.Tensor:
        """Allocate and pin the host arena, once: a flat uint8 tensor of nbytes."""
        self._claim_arena(nbytes)
        return self._allocate_arena(nbytes)

    def host_arena_async(self, nbytes: int) -> concurrent.futures.Future[torch.Tensor]:
        """Pin the host arena on a background thread (~0.5 ms/MiB): a future of host_arena()."""
        if not self.background_pinning:
            return super().host_arena_async(nbytes)
        self._claim_arena(nbytes)
        future: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()

        def pin() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                arena = self._allocate_arena(nbytes, pause_s=_PIN_PAUSE_S)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(arena)

        thread = threading.Thread(target=pin, name=f"mmcache-pin-{self.name}", daemon=True)
        self._pin_thread = thread
        thread.start()
        return future

    # --- copies -------------------------------------------------------------

    def copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> CudaFence:
        """Queue src (this GPU) -> dst (pinned host) on the D2H stream after the fences."""
        self._check_open()
        src_bytes, dst_bytes = self._copy_operands(src, dst, device_src=True)
        stream = self._d2h
        try:
            with _OnStream(stream):
                self._order_after(stream, after)
                self._copy_bytes(dst_bytes, src_bytes, host=dst_bytes)
                # The caching allocator must not recycle src while the copy engine reads it.
                src.record_stream(stream)
                return self._record_on(stream)
        except RuntimeError as exc:
            raise _enqueue_error("device-to-host", src_bytes.numel(), exc) from exc

    def copy_h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> CudaFence:
        """Queue src (pinned host) -> dst (this GPU) on the H2D stream after the fences."""
        self._check_open()
        dst_bytes, src_bytes = self._copy_operands(dst, src, device_src=False)
        stream = self._h2d
        try:
            with _OnStream(stream):
                self._order_after(stream, after)
                self._copy_bytes(dst_bytes, src_bytes, host=src_bytes)
                dst.record_stream(stream)
                return self._record_on(stream)
        except RuntimeError as exc:
            raise _enqueue_error("host-to-device", src_bytes.numel(), exc) from exc

    def copy_d2d(self, src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> CudaFence:
        """Queue src -> dst (both on this GPU; src may be strided) on stream."""
        self._check_open()
        cuda_stream = as_cuda_stream(stream)
        for tensor, role in ((src, "source"), (dst, "destination")):
            if not self.is_device_tensor(tensor):
                raise InvalidValueError(f"copy {role} is on {tensor.device}, not {self.name}")
        same_layout = src.shape == dst.shape and src.dtype == dst.dtype
        if not same_layout and src.nbytes != dst.nbytes:
            raise InvalidValueError(
                f"copy of {src.nbytes} bytes into a {dst.nbytes}-byte destination"
            )
        try:
            with _OnStream(cuda_stream):
                if same_layout:
                    dst.copy_(src, non_blocking=True)
                else:
                    _flat_bytes(dst, "destination").copy_(
                        _flat_bytes(src, "source"), non_blocking=True
                    )
                src.record_stream(cuda_stream)
                dst.record_stream(cuda_stream)
                return self.record(cuda_stream)
        except RuntimeError as exc:
            raise _enqueue_error("device-to-device", src.nbytes, exc) from exc

    def pack(self, srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, CudaFence]:
        """srcs' rows back to back in a new tensor: one torch.cat kernel on stream.

        The result comes from stream's pool (the stream that writes it). As with
        copy_d2h_batch, the caller keeps the sources referenced until the fence: they may
        come from another stream's pool, and a record_stream each would cost µs a feature.
        """
        self._check_open()
        cuda_stream = as_cuda_stream(stream)
        try:
            # Contiguous whatever the sources' layout (torch.cat keeps channels_last), and
            # outside autograd: the cache must not keep an encoder's graph alive.
            with _OnStream(cuda_stream), torch.no_grad():
                packed = torch.empty(packed_shape(srcs), dtype=srcs[0].dtype, device=self._device)
                torch.cat(list(srcs), out=packed)
                return packed, self.record(cuda_stream)
        except RuntimeError as exc:
            raise _enqueue_error("device-to-device", sum(s.nbytes for s in srcs), exc) from exc

    def copy_d2h_batch(
        self,
        srcs: Sequence[torch.Tensor],
        host: torch.Tensor,
        offsets: Sequence[int],
        after: Sequence[Fence],
        *,
        owned: bool = False,
    ) -> CudaFence:
        """Queue copies of srcs into host's bytes at offsets on the D2H stream, one fence.

        Small sources of one dtype and row shape whose ranges lie back to back in host
        memory (in any order) are gathered into one buffer by one kernel and moved by one
        copy. Several copies into the arena are queued by one driver call where the driver
        has batched copies; one copy goes through torch (an 8 MB feature's offload was no
        faster through the driver), and so does every batch once the driver has refused
        one. The caller keeps the sources alive until the fence is done.

        owned (the cache's own sources, see Device.copy_d2h_batch): a batch of sources
        that need no gather goes to the driver as it is, each range only bounds-checked.
        """
        self._check_open()
        ranges = self._owned_ranges(srcs, host, offsets) if owned else None
        runs = None if ranges is not None else self._packed_runs(batch_order(srcs, host, offsets))
        stream = self._d2h
        try:
            if self._copier is not None and (
                ranges is not None
                or (runs is not None and len(runs) >= self.driver_min_runs and self._in_arena(host))
            ):
                self._order_after(stream, after)
                try:
                    if ranges is not None:
                        self._queue_batch(*ranges, stream)
                    else:
                        assert runs is not None
                        self._copy_runs(runs, host, stream)
                    return self._record_on(stream)
                except CopyFailedError as exc:
                    # With its arguments checked (an owned batch's are checked now, and a
                    # bad one raises here), the driver refuses the call itself (an
                    # unsupported platform), not this batch: torch's copies from now on.
                    # Nothing of a refused call is queued; copying again is harmless.
                    if runs is None:
                        runs = self._packed_runs(batch_order(srcs, host, offsets))
                    _log.warning("%s: %s; copying through torch from now on", self.name, exc)
                    self._copier = None
            assert runs is not None  # owned ranges imply the driver path, and runs if refused
            with _OnStream(stream):
                self._order_after(stream, after)
                for run, start, nbytes in runs:
                    region = host[start : start + nbytes]
                    packed = _gather(run)
                    self._copy_bytes(region, _flat_bytes(packed, "source"), host=region)
                    del packed
                return self._record_on(stream)
        except RuntimeError as exc:
            total = sum(src.nbytes for src in srcs)
            raise _enqueue_error("batched device-to-host", total, exc) from exc

    # --- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Finish queued copies and callbacks, stop the waiters, unpin a registered arena."""
        if self._closed:
            return
        self._closed = True
        if self._pin_thread is not None:
            self._pin_thread.join()
        self._d2h.synchronize()
        self._h2d.synchronize()
        self._waiters.close(timeout=60.0)
        # Unpinning leaves the memory valid (pageable) for views still alive; a cuMemHostAlloc
        # arena cannot be freed under them, so it is freed when its last view goes.
        if self._arena_finalizer is not None and self.arena_method == "register":
            self._arena_finalizer()

    def describe(self) -> dict[str, Any]:
        """GPU model and memory, torch/CUDA/driver versions, arena facts."""
        props = torch.cuda.get_device_properties(self._device)
        facts: dict[str, Any] = {
            "name": self.name,
            "gpu": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "arena_method": self.arena_method,
            "arena_bytes": self._arena_nbytes,
            "pin_chunk_bytes": self.pin_chunk_bytes,
            "huge_pages": self.huge_pages,
            "pack_max_bytes": self.pack_max_bytes,
            "batched_copies": "torch copy_" if self._copier is None else "cuMemcpyBatchAsync",
        }
        if self._driver_instance is not None:
            facts["driver_cuda"] = self._driver_instance.version
        return facts

    # --- internals ------------------------------------------------------------

    def _record_on(self, stream: torch.cuda.Stream) -> CudaFence:
        event = _new_event()
        # The order number is taken with the record: threads recording on one stream
        # between the two would otherwise get numbers out of the stream's order.
        with _record_lock:
            _EventBase.record(event, stream)
            seq = next(_fence_seq)
        return CudaFence(event, stream, self._waiters, seq)

    def _order_after(self, stream: torch.cuda.Stream, after: Sequence[Fence]) -> None:
        if len(after) > 1:
            # A batch's producers are mostly a few streams: waiting on the last fence of
            # each stream orders after all of them, at one wait_event per stream.
            last: dict[int, Fence] = {}
            for deferred in after:
                fence = deferred.resolved()
                if isinstance(fence, CudaFence):
                    key = fence.stream.cuda_stream
                    seen = last.get(key)
                    if not isinstance(seen, CudaFence) or seen.seq < fence.seq:
                        last[key] = fence
                else:
                    last[-1 - len(last)] = fence  # not ours: _pending_event checks it
            after = list(last.values())
        for fence in after:
            event = _pending_event(fence)
            if event is not None:
                stream.wait_event(event)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError(f"{self.name}: the device was closed")

    def _copy_operands(
        self, device_side: torch.Tensor, host_side: torch.Tensor, *, device_src: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate a device/host pair; return (device bytes, host bytes) views."""
        device_role, host_role = (
            ("source", "destination") if device_src else ("destination", "source")
        )
        if not self.is_device_tensor(device_side):
            raise InvalidValueError(
                f"copy {device_role} is on {device_side.device}, not {self.name}"
            )
        if host_side.device.type != "cpu":
            raise InvalidValueError(f"copy {host_role} is on {host_side.device}, not host memory")
        device_bytes = _flat_bytes(device_side, device_role)
        host_bytes = _flat_bytes(host_side, host_role)
        if device_bytes.numel() != host_bytes.numel():
            src_n, dst_n = (
                (device_bytes.numel(), host_bytes.numel())
                if device_src
                else (host_bytes.numel(), device_bytes.numel())
            )
            raise InvalidValueError(f"copy of {src_n} bytes into a {dst_n}-byte destination")
        return device_bytes, host_bytes

    def _copy_bytes(self, dst: torch.Tensor, src: torch.Tensor, *, host: torch.Tensor) -> None:
        """dst.copy_(src) on the current stream, split where host crosses an arena chunk."""
        if dst.numel() == 0:
            return
        pieces = self._chunk_pieces(host.data_ptr(), host.numel())
        if pieces is None:
            dst.copy_(src, non_blocking=True)
            return
        for start, stop in pieces:
            dst[start:stop].copy_(src[start:stop], non_blocking=True)

    def _copy_runs(
        self,
        runs: list[tuple[list[torch.Tensor], int, int]],
        host: torch.Tensor,
        stream: torch.cuda.Stream,
    ) -> None:
        """Queue every run's copy into host (in the arena) by one driver call on stream.

        The stream is made current only for gathers: the driver call names it.
        """
        base = host.data_ptr()
        dsts: list[int] = []
        srcs: list[int] = []
        sizes: list[int] = []
        gathered: list[torch.Tensor] = []  # referenced until the copies reading them are queued
        for run, start, nbytes in runs:
            if not nbytes:
                continue
            if len(run) == 1:
                packed = run[0]
            else:
                with _OnStream(stream):
                    packed = _gather(run)
            gathered.append(packed)
            self._add_pieces(base + start, packed.data_ptr(), nbytes, dsts, srcs, sizes)
        if sizes:
            self._queue_batch(dsts, srcs, sizes, stream)

    def _owned_ranges(
        self, srcs: Sequence[torch.Tensor], host: torch.Tensor, offsets: Sequence[int]
    ) -> tuple[list[int], list[int], list[int]] | None:
        """(host addresses, device addresses, sizes) of a batch of the cache's own sources
        into the arena, for one driver call; None where the checked path applies (no batched
        copies, fewer than driver_min_runs sources, a target outside the arena, or a source
        small enough to be gathered with its neighbours).

        The sources were checked at put (see Device.copy_d2h_batch): re-checking each here
        cost the loop about 1.7 µs a feature on the H200, the sort and run-building as much.
        """
        if (
            self._copier is None
            or len(srcs) < self.driver_min_runs
            or len(srcs) != len(offsets)
            or host.data_ptr() != self._arena_ptr
            or host.numel() != self._arena_nbytes
        ):
            return None
        pack_max = self.pack_max_bytes
        base, limit = self._arena_ptr, self._arena_nbytes
        dsts: list[int] = []
        ptrs: list[int] = []
        sizes: list[int] = []
        for src, offset in zip(srcs, offsets, strict=True):
            nbytes = src.nbytes
            if nbytes <= pack_max:
                return None
            if offset < 0 or offset + nbytes > limit:
                raise InvalidValueError(
                    f"a copy of {nbytes} bytes at offset {offset} falls outside the "
                    f"{limit}-byte host arena"
                )
            self._add_pieces(base + offset, src.data_ptr(), nbytes, dsts, ptrs, sizes)
        return dsts, ptrs, sizes

    def _add_pieces(
        self, at: int, ptr: int, nbytes: int, dsts: list[int], ptrs: list[int], sizes: list[int]
    ) -> None:
        """Add the copy of nbytes from device address ptr to host address at (in the arena)
        to a driver batch's lists, split where it crosses an arena chunk."""
        for a, b in self._chunk_pieces(at, nbytes) or ((0, nbytes),):
            dsts.append(at + a)
            ptrs.append(ptr + a)
            sizes.append(b - a)

    def _queue_batch(
        self, dsts: list[int], srcs: list[int], sizes: list[int], stream: torch.cuda.Stream
    ) -> None:
        """The driver call of _copy_runs (device addresses to host addresses, on stream)."""
        assert self._copier is not None
        self._copier.copy(dsts, srcs, sizes, stream.cuda_stream)

    def _in_arena(self, host: torch.Tensor) -> bool:
        """Whether host is a contiguous range of this device's pinned arena (what batched
        copies, which address bytes, may target)."""
        start = host.data_ptr() - self._arena_ptr
        return (
            self._arena_nbytes > 0
            and 0 <= start
            and start + host.numel() <= self._arena_nbytes
            and host.is_contiguous()
        )

    def one_pinned_range(self, host: torch.Tensor) -> bool:
        """Whether host lies in one registered chunk of the arena (or outside the arena)."""
        return self._chunk_pieces(host.data_ptr(), host.nbytes) is None

    def _chunk_pieces(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        """Byte ranges of the host range at ptr that each lie in one registered chunk, relative
        to ptr; None if it needs no split."""
        chunk = self._arena_split_chunk
        if chunk == 0:
            return None
        start = ptr - self._arena_ptr
        stop = start + nbytes
        if start < 0 or stop > self._arena_nbytes:
            return None
        first, last = start // chunk, (stop - 1) // chunk
        if first == last:
            return None
        edges = [start, *(k * chunk for k in range(first + 1, last + 1)), stop]
        return [(a - start, b - start) for a, b in itertools.pairwise(edges)]

    def _packed_runs(
        self, ordered: list[tuple[int, torch.Tensor]]
    ) -> list[tuple[list[torch.Tensor], int, int]]:
        """(sources, host offset, bytes) per copy, sources checked on the way.

        Back-to-back sources of one dtype and row shape form a run (torch.cat joins them
        along rows); sources over pack_max_bytes go alone.
        """
        pack_max = self.pack_max_bytes
        runs: list[tuple[list[torch.Tensor], int, int]] = []
        run: list[torch.Tensor] = []
        run_start = run_end = 0
        run_kind: tuple[torch.dtype, torch.Size] | None = None
        for offset, src in ordered:
            if not self.is_device_tensor(src):
                raise InvalidValueError(f"copy source is on {src.device}, not {self.name}")
            if not src.is_contiguous() or src.is_conj() or src.is_neg():
                # A conjugate or negative view's bytes are not its values: copying them
                # as bytes would be silently wrong.
                raise InvalidValueError(
                    "batched copies need contiguous sources with no lazy conjugate or "
                    "negation; compact them with copy_d2d first"
                )
            nbytes = src.nbytes
            shape = src.shape
            kind = (src.dtype, shape[1:]) if shape and nbytes <= pack_max else None
            if (
                kind is not None
                and kind == run_kind
                and offset == run_end
                and run_end - run_start + nbytes <= _PACK_RUN_MAX_BYTES
            ):
                run.append(src)
            else:
                if run:
                    runs.append((run, run_start, run_end - run_start))
                run, run_start, run_kind = [src], offset, kind
            run_end = offset + nbytes
        runs.append((run, run_start, run_end - run_start))
        return runs

    def _driver(self) -> CudaDriver:
        if self._driver_instance is None:
            self._driver_instance = CudaDriver.get()
        return self._driver_instance

    def _claim_arena(self, nbytes: int) -> None:
        self._check_open()
        if nbytes < 0:
            raise InvalidValueError(f"host arena size must be >= 0, not {nbytes}")
        if self._arena_claimed:
            raise MMCacheError(
                f"{self.name}: the host arena was already allocated (it is made once)"
            )
        self._arena_claimed = True

    def _allocate_arena(self, nbytes: int, pause_s: float = 0.0) -> torch.Tensor:
        """Pin nbytes of host memory; a "register" arena chunk by chunk, pause_s between
        chunks (so the process's other driver calls get the driver's lock in between)."""
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        driver = self._driver()
        if self.arena_method == "hostalloc":
            ptr = driver.host_alloc(self.index, nbytes)
            buffer = (ctypes.c_uint8 * nbytes).from_address(ptr)
            arena = torch.frombuffer(buffer, dtype=torch.uint8)
            # Freed only when the last view of the buffer goes: never under a live tensor.
            weakref.finalize(buffer, _free_host, driver, self.index, ptr).atexit = False
            self.pin_chunk_bytes = nbytes
            self._arena_ptr, self._arena_nbytes = ptr, nbytes
            return arena
        chunk = self.pin_chunk_bytes
        size = -(-nbytes // _PAGE) * _PAGE
        # Over-map by one huge page so the arena can start on a 2 MiB boundary.
        mapping = mmap.mmap(-1, size + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(mapping, dtype=torch.uint8)
        offset = -whole.data_ptr() % _HUGE_PAGE
        if self.huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            # Pinning is mostly per-page work: 2 MiB pages make it several times cheaper.
            mapping.madvise(mmap.MADV_HUGEPAGE, offset, size)
        if hasattr(mmap, "MADV_DONTFORK"):
            # A forked child (a data loader's worker, say) must not share these pages
            # copy-on-write: the parent's next write would move it off the pages the GPU
            # writes to. cuMemHostAlloc memory is kept out of children by the driver.
            with contextlib.suppress(OSError):
                mapping.madvise(mmap.MADV_DONTFORK, offset, size)
        arena = whole[offset : offset + nbytes]
        ptr = arena.data_ptr()
        registered: list[int] = []
        try:
            # Whole pages: the tail page past nbytes is mapped and registering it is harmless.
            for start in range(0, size, chunk):
                if self._closed:  # close() waits for this thread: stop pinning for nobody
                    raise MMCacheError(f"{self.name} closed while its host arena was pinned")
                driver.host_register(
                    self.index, ptr + start, min(chunk, size - start), "MMCACHE_CPU_CACHE_MB"
                )
                registered.append(ptr + start)
                if pause_s:
                    time.sleep(pause_s)
        except BaseException:
            _release_registered(driver, self.index, tuple(registered), mapping)
            raise
        self._arena_finalizer = weakref.finalize(
            self, _release_registered, driver, self.index, tuple(registered), mapping
        )
        self._arena_finalizer.atexit = False
        self._arena_ptr, self._arena_nbytes = ptr, nbytes
        self._arena_split_chunk = chunk if nbytes > chunk else 0
        return arena


def _gather(run: list[torch.Tensor]) -> torch.Tensor:
    """A run's sources back to back in one tensor (the one source itself if alone).

    The gather buffer comes from the current (D2H) stream's pool: later work on this stream
    reuses it only after the copy queued next has read it.
    """
    return run[0] if len(run) == 1 else torch.cat(run)


def _pending_event(fence: Fence) -> torch.cuda.Event | None:
    """The CUDA event a stream must wait on for fence, or None if it is done."""
    fence = fence.resolved()
    if isinstance(fence, CudaFence):
        return fence.pending_event()
    if fence.done():
        return None
    raise InvalidValueError(
        f"cannot order CUDA work after a pending {type(fence).__name__}; "
        "use fences made by the same CudaDevice"
    )


def _enqueue_error(direction: str, nbytes: int, exc: RuntimeError) -> MMCacheError:
    """The mmcache error for a copy that CUDA refused at enqueue."""
    if isinstance(exc, torch.OutOfMemoryError):
        return DeviceOutOfMemoryError(
            f"no GPU memory to queue a {direction} copy of {nbytes} bytes; lower "
            "MMCACHE_GPU_CACHE_MB (SGLANG_VLM_CACHE_SIZE_MB) or free GPU memory"
        )
    return CopyFailedError(f"queuing a {direction} copy of {nbytes} bytes failed: {exc}")


def _resolve_device(index: int | str | torch.device) -> torch.device:
    """A torch.device with an explicit index, checked against the visible GPUs."""
    device = torch.device("cuda", index) if isinstance(index, int) else torch.device(index)
    if device.type != "cuda":
        raise InvalidValueError(f"CudaDevice needs a CUDA device, not {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if not 0 <= (device.index or 0) < count:
        raise InvalidValueError(f"{device} does not exist: {count} GPU(s) are visible")
    return device
