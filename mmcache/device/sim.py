"""SimDevice: an adversarial CPU simulator of a GPU's copy engines and caching allocator.

"Device tensors" are ordinary CPU tensors. Copies run on a worker thread in
stream order and read their source when they run, not when queued. Memory the
cache releases is poisoned (0xFF: NaN for floats) as soon as no tensor outside
the cache and the simulator references it and every fence it was released
after is done, so a cache that forgets a fence reads poison in tests.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mmcache.device.base import (
    DONE,
    AllFences,
    ArenaProgress,
    Device,
    Fence,
    Stream,
    host_memory_bytes,
    storage_use_count,
)
from mmcache.device.sim_arena import ARENA_PAGE, POISON_BYTE, SimArenas
from mmcache.errors import CopyFailedError, DeviceOutOfMemoryError, InvalidValueError

__all__ = ["ARENA_PAGE", "POISON_BYTE", "SimDevice", "SimFence", "SimStream"]

FaultKind = Literal["copy_fails", "alloc_fails", "fence_never_completes"]

#: A worker thread with nothing queued for this long ends (the next op starts another).
_WORKER_IDLE_EXIT_S = 1.0


class SimFence(Fence):
    """A fence completed by the simulator's worker thread."""

    __slots__ = ("_callbacks", "_done", "_event", "_exc", "_lock", "_settled")

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._done = False
        self._settled = False  # done and every callback has run
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []
        self._event: threading.Event | None = None

    def done(self) -> bool:
        return self._done

    def exception(self) -> BaseException | None:
        return self._exc

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn()

    def wait(self, timeout: float | None = None) -> bool:
        with self._lock:
            if self._settled:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def _complete(self, exc: BaseException | None = None) -> None:
        with self._lock:
            self._exc = exc
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()
        # Waiters wake after the callbacks: synchronize() then sees releases already done.
        with self._lock:
            self._settled = True
            event = self._event
        if event is not None:
            event.set()


class SimStream:
    """A simulated stream: operations run one after another, in the order queued."""

    __slots__ = ("name", "ops")

    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: deque[_Op] = deque()

    def __repr__(self) -> str:
        return f"SimStream({self.name!r}, queued={len(self.ops)})"


@dataclass(slots=True, eq=False)
class _Op:
    """One queued piece of simulated device work."""

    stream: SimStream
    fence: SimFence
    deps: list[Fence]
    held: bool
    run: Callable[[], object] | None = None
    nbytes: int = 0
    holds: list[tuple[_Allocation, torch.Tensor]] = field(default_factory=list)
    fail: BaseException | None = None
    stuck: bool = False


@dataclass(slots=True, eq=False)
class _Allocation:
    """Simulated device memory: one storage adopted or allocated through the device."""

    alias: torch.Tensor
    nbytes: int
    owners: int = 1
    op_tensors: list[torch.Tensor] = field(default_factory=list)
    released: list[torch.Tensor] = field(default_factory=list)
    pending_fences: int = 0


class SimDevice(Device):
    """A CPU simulator of a CUDA device, adversarial about fences and memory reuse."""

    kind = "sim"
    stream_ordered_reads = False
    poisons_host = True
    tensor_note = " (the simulator's device memory: CPU tensors, whose .device says cpu)"

    def __init__(
        self,
        bandwidth_gbps: float = 0.0,
        latency_s: float = 0.0,
        *,
        pin_chunk_bytes: int = 8 << 20,
        pin_chunk_s: float = 0.0,
        memory_bytes: int | None = None,
    ) -> None:
        """memory_bytes: the simulated device's whole memory (default: this machine's, where
        its tensors live), which a cache's GPU tier cannot exceed; nothing else limits it."""
        if bandwidth_gbps < 0 or latency_s < 0:
            raise ValueError("bandwidth_gbps and latency_s must be >= 0 (0 means instant)")
        if memory_bytes is not None and memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be > 0 (None: this machine's), not {memory_bytes}")
        self.name = "sim"
        self.bandwidth_gbps = bandwidth_gbps
        self.latency_s = latency_s
        self._memory_bytes = memory_bytes if memory_bytes is not None else host_memory_bytes()
        self._lock = threading.Lock()  # guards fences
        self._cond = threading.Condition()  # guards streams, allocations, holds
        self._streams: list[SimStream] = []
        self._local = threading.local()
        self.default_stream = self.stream("default")
        self.d2h_stream = self.stream("d2h")
        self.h2d_stream = self.stream("h2d")
        self._allocs: dict[int, _Allocation] = {}
        self._arenas = SimArenas(self.name, pin_chunk_bytes, pin_chunk_s)
        self._allocated_bytes = 0
        self._released_outside: set[int] = set()
        self._hold_depth = 0
        self._held_ops: list[_Op] = []
        self._faults: dict[FaultKind, int] = {}
        self._worker: threading.Thread | None = None
        self._closed = False
        self.copies_run = 0
        self._completing = 0  # finished operations whose fence callbacks are still running

    # --- streams and fences -------------------------------------------------

    def stream(self, name: str = "side") -> SimStream:
        """Create a new simulated stream."""
        s = SimStream(name)
        with self._cond:
            self._streams.append(s)
        return s

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream) -> Iterator[SimStream]:
        """Make stream the calling thread's current stream inside the block."""
        previous = self.current_stream()
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def current_stream(self) -> SimStream:
        stream: SimStream = getattr(self._local, "stream", self.default_stream)
        return stream

    def record(self, stream: Stream) -> Fence:
        s = self._as_sim_stream(stream)
        with self._cond:
            if not s.ops:
                return DONE
            return self._enqueue(s, [], None).fence

    def wait_on(self, stream: Stream, fence: Fence) -> None:
        if fence.done():
            return
        with self._cond:
            self._enqueue(self._as_sim_stream(stream), [fence], None)

    def launch(self, stream: SimStream, kernel: Callable[[], object]) -> Fence:
        """Queue a host function as a "kernel" on stream (a producer that writes later)."""
        with self._cond:
            return self._enqueue(stream, [], kernel).fence

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Keep every operation queued inside the block from running until the block exits."""
        with self._cond:
            self._hold_depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._hold_depth -= 1
                if self._hold_depth == 0:
                    for op in self._held_ops:
                        op.held = False
                    self._held_ops.clear()
                    self._cond.notify_all()

    def inject(self, kind: FaultKind, count: int = 1) -> None:
        """Make the next count operations of a kind fail (copies, allocations) or hang (fences)."""
        with self._cond:
            self._faults[kind] = self._faults.get(kind, 0) + count

    def unstick(self) -> None:
        """Let operations injected with fence_never_completes run after all (a late fence)."""
        with self._cond:
            for s in self._streams:
                for op in s.ops:
                    op.stuck = False
            self._cond.notify_all()

    def synchronize(self) -> None:
        """Block until every queued operation has run (held ones make this wait)."""
        with self._cond:
            fences = [op.fence for s in self._streams for op in s.ops]
        for f in fences:
            f.wait()
        self._wait_completions()

    def _wait_completions(self) -> None:
        """Wait until no finished operation is still running its fence's callbacks."""
        with self._cond:
            self._cond.wait_for(lambda: self._completing == 0, timeout=5.0)

    # --- memory -------------------------------------------------------------

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def adopt(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        if not self.is_device_tensor(tensor):
            raise InvalidValueError(
                f"SimDevice holds CPU tensors (its simulated device memory); got one on "
                f"{tensor.device}"
            )
        alias = tensor.detach()
        key = alias.untyped_storage().data_ptr()
        with self._cond:
            alloc = self._allocs.get(key)
            if alloc is not None:
                alloc.owners += 1
            else:
                nbytes = alias.untyped_storage().nbytes()
                self._allocs[key] = _Allocation(alias.detach(), nbytes)
                self._allocated_bytes += nbytes
        return alias

    def _empty(
        self, shape: Sequence[int], dtype: torch.dtype, stream: Stream | None
    ) -> torch.Tensor:
        with self._cond:
            if self._take_fault("alloc_fails"):
                raise DeviceOutOfMemoryError(
                    f"simulated device out of memory allocating {tuple(shape)} {dtype}"
                )
        tensor = torch.empty(tuple(shape), dtype=dtype)
        _poison(tensor)  # fresh device memory holds garbage, never zeros
        return self.adopt(tensor, self.default_stream)

    def release(self, tensor: torch.Tensor, after: Sequence[Fence]) -> None:
        key = tensor.untyped_storage().data_ptr()
        pending = [f for f in after if not f.done()]
        with self._cond:
            # The caching allocator frees a block when its last tensor dies; we cannot see
            # that moment, so memory released earlier is re-checked at every release.
            self._sweep_released()
            alloc = self._allocs.get(key)
            if alloc is None:
                raise RuntimeError("release() of memory the simulated device does not own")
            alloc.released.append(tensor)
            alloc.owners -= 1
            if alloc.owners > 0:
                return
            alloc.pending_fences = len(pending)
            if not pending:
                self._try_recycle(key, alloc)
                return
        for f in pending:
            f.add_done_callback(functools.partial(self._fence_done_for, key))

    @property
    def allocated_bytes(self) -> int:
        """Simulated device memory live: adopted or allocated and not yet recycled."""
        # A release waiting on a fence recycles from that fence's callbacks: let them run.
        self._wait_completions()
        with self._cond:
            self._sweep_released()
            return self._allocated_bytes

    def _sweep_released(self) -> None:
        """Recycle released memory whose outside holders have let go; caller holds _cond."""
        for key in list(self._released_outside):
            alloc = self._allocs.get(key)
            if alloc is None:
                self._released_outside.discard(key)
            else:
                self._try_recycle(key, alloc)

    def _host_arena(self, nbytes: int) -> torch.Tensor:
        return self._arenas.host_arena(nbytes)

    def host_arena(
        self, nbytes: int, on_pinned: ArenaProgress | None = None
    ) -> Future[torch.Tensor]:
        """At once; with pin_chunk_s > 0, chunk by chunk on a thread, as CUDA pins it."""
        if self._arenas.pin_chunk_s == 0 or nbytes == 0:
            return super().host_arena(nbytes, on_pinned)
        return self._arenas.pin_async(nbytes, on_pinned)

    @property
    def pinned_bytes(self) -> int:
        """Bytes of this device's host arenas pinned now (0 once closed)."""
        return self._arenas.pinned_bytes

    def poison_host(
        self, host: torch.Tensor, start: int = 0, stop: int | None = None, *, unused: bool = False
    ) -> None:
        if unused:
            self._arenas.hand_out(host, start, host.numel() if stop is None else stop)
        elif start == 0 and stop is None:
            host.fill_(POISON_BYTE)
        else:
            host[start:stop].fill_(POISON_BYTE)

    # --- copies ---------------------------------------------------------------

    def copy_on(
        self, stream: SimStream, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]
    ) -> Fence:
        """Queue src -> dst (same byte size, either side) on stream after the fences: every
        copy of the simulator, whichever stream it is queued on."""
        if src.nbytes != dst.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes} bytes")

        def run() -> None:
            # Reads the source now, when the copy runs: a released source reads poison.
            if src.shape == dst.shape and src.dtype == dst.dtype:
                with torch.no_grad():  # element-wise: a strided source (a view compacted)
                    dst.copy_(src)
            else:
                _bytes_of(dst).copy_(_bytes_of(src))

        with self._cond:
            # A failed dependency fails the copy too, even when it finished long ago.
            deps = [f for f in after if not f.done() or f.exception() is not None]
            op = self._enqueue(stream, deps, run, src.nbytes)
            for t in (src, dst):
                alloc = self._allocs.get(t.untyped_storage().data_ptr())
                if alloc is not None:
                    alloc.op_tensors.append(t)
                    op.holds.append((alloc, t))
            if self._take_fault("copy_fails"):
                op.fail = CopyFailedError(f"simulated copy failure ({src.nbytes} bytes)")
            if self._take_fault("fence_never_completes"):
                op.stuck = True
        return op.fence

    def _copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
        return self.copy_on(self.d2h_stream, src, dst, after)

    def _copy_h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> Fence:
        return self.copy_on(self.h2d_stream, src, dst, after)

    def _copy_d2d(self, src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> Fence:
        return self.copy_on(self._as_sim_stream(stream), src, dst, ())

    def _upload_on(
        self,
        src: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, Fence | None]:
        """Queued on the reader's stream; reads here are not stream-ordered, so its fence."""
        sim_stream = self._as_sim_stream(stream)
        dst = self._empty(shape, dtype, None)
        try:
            return dst, self.copy_on(sim_stream, src, dst, after)
        except BaseException:
            self.release(dst, after=())  # nothing was queued: nothing reads it
            raise

    def _upload_packed_on(
        self,
        srcs: Sequence[torch.Tensor],
        offsets: Sequence[int],
        nbytes: int,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, Fence | None]:
        """Queued on the reader's stream, behind one fence for all (reads wait for it)."""
        sim_stream = self._as_sim_stream(stream)
        buffer = self._empty((nbytes,), torch.uint8, None)
        fences: list[Fence] = []
        try:
            for src, offset in zip(srcs, offsets, strict=True):
                dst = buffer[offset : offset + src.numel()]
                fences.append(self.copy_on(sim_stream, src, dst, after))
        except BaseException:
            self.release(buffer, after=fences)  # after the copies queued before the failure
            raise
        return buffer, fences[0] if len(fences) == 1 else AllFences(fences)

    def close(self) -> None:
        self._arenas.close()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=5)

    @property
    def closed(self) -> bool:
        """Whether close() has run (a receiver closes its own device after its last lease)."""
        return self._closed

    @property
    def memory_bytes(self) -> int | None:
        return self._memory_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "bandwidth_gbps": self.bandwidth_gbps,
            "latency_s": self.latency_s,
            "memory_bytes": self._memory_bytes,
        }

    # --- internals --------------------------------------------------------------

    def _as_sim_stream(self, stream: Stream) -> SimStream:
        if not isinstance(stream, SimStream):
            raise InvalidValueError(f"SimDevice needs a SimStream, got {type(stream).__name__}")
        return stream

    def _take_fault(self, kind: FaultKind) -> bool:
        left = self._faults.get(kind, 0)
        if left <= 0:
            return False
        self._faults[kind] = left - 1
        return True

    def _enqueue(
        self,
        stream: SimStream,
        deps: list[Fence],
        run: Callable[[], object] | None,
        nbytes: int = 0,
    ) -> _Op:
        """Queue an operation; the caller holds self._cond."""
        if self._closed:
            raise RuntimeError("SimDevice is closed")
        op = _Op(stream, SimFence(self._lock), deps, held=self._hold_depth > 0, run=run)
        op.nbytes = nbytes
        if op.held:
            self._held_ops.append(op)
        stream.ops.append(op)
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="mmcache-sim", daemon=True)
            self._worker.start()
        self._cond.notify_all()
        return op

    def _runnable(self) -> _Op | None:
        for s in self._streams:
            if s.ops:
                op = s.ops[0]
                if not op.held and not op.stuck and all(d.done() for d in op.deps):
                    return op
        return None

    def _work(self) -> None:
        while True:
            with self._cond:
                op = self._runnable()
                idle_since: float | None = None
                while op is None:
                    if self._closed:
                        return
                    if any(s.ops for s in self._streams):
                        idle_since = None
                    elif idle_since is None:
                        idle_since = time.monotonic()
                    elif time.monotonic() - idle_since >= _WORKER_IDLE_EXIT_S:
                        # Nothing queued: end, so that a device dropped without close()
                        # keeps no thread (nor itself, through it); the next op starts one.
                        self._worker = None
                        return
                    # A dependency completing on another device wakes us via timeout.
                    self._cond.wait(timeout=0.05)
                    op = self._runnable()
            exc = op.fail
            if exc is None:
                for dep in op.deps:
                    exc = dep.exception()
                    if exc is not None:
                        break
            if exc is None and op.run is not None:
                delay = self.latency_s
                if self.bandwidth_gbps > 0:
                    delay += op.nbytes / (self.bandwidth_gbps * 1e9)
                if delay > 0:
                    time.sleep(delay)
                try:
                    op.run()
                except Exception as e:  # a failing kernel fails its fence, not the worker
                    exc = e
            with self._cond:
                op.stream.ops.popleft()
                self._drop_operands(op)
                if op.nbytes:
                    self.copies_run += 1
                self._completing += 1
                self._cond.notify_all()
            try:
                op.fence._complete(exc)
            finally:
                with self._cond:
                    self._completing -= 1
                    self._cond.notify_all()
            del op  # this frame lives on: it must not keep the last operands alive

    @staticmethod
    def _drop_operands(op: _Op) -> None:
        """Forget a finished operation's tensors (queued work keeps nothing alive afterwards)."""
        for alloc, t in op.holds:
            # by identity: == on tensors compares elements
            idx = next(i for i, x in enumerate(alloc.op_tensors) if x is t)
            del alloc.op_tensors[idx]
        op.holds.clear()
        op.run = None

    def _fence_done_for(self, key: int) -> None:
        with self._cond:
            alloc = self._allocs.get(key)
            if alloc is None:
                return
            alloc.pending_fences -= 1
            if alloc.pending_fences <= 0:
                self._try_recycle(key, alloc)

    def _try_recycle(self, key: int, alloc: _Allocation) -> None:
        """Poison and forget released memory no outside tensor references; caller holds _cond."""
        if alloc.owners > 0 or alloc.pending_fences > 0:
            return
        # Tensor objects the cache and the simulator hold; anything beyond is outside.
        internal = len({id(t) for t in (alloc.alias, *alloc.released, *alloc.op_tensors)})
        if storage_use_count(alloc.alias) > internal:
            self._released_outside.add(key)  # a caller still holds it: recycled once dropped
            return
        self._released_outside.discard(key)
        _poison(alloc.alias)
        del self._allocs[key]
        self._allocated_bytes -= alloc.nbytes


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8)


def _poison(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    torch.empty(0, dtype=torch.uint8).set_(storage).fill_(POISON_BYTE)
