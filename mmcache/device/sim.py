"""SimDevice: an adversarial CPU simulator of a GPU's copy engines and caching allocator.

"Device tensors" are ordinary CPU tensors. Copies run on a worker thread in
stream order and read their source when they run, not when queued (the copy
engine: sim_engine). Memory the cache releases is poisoned (0xFF: NaN for floats)
as soon as no tensor outside the cache and the simulator references it and every
fence it was released after is done, so a cache that forgets a fence reads poison
in tests.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from mmcache.device.base import (
    AllFences,
    ArenaProgress,
    Device,
    Fence,
    Stream,
    host_memory_bytes,
    storage_use_count,
)
from mmcache.device.sim_arena import ARENA_PAGE, POISON_BYTE, SimArenas
from mmcache.device.sim_engine import FaultKind, Operand, SimCopyEngine, SimStream
from mmcache.errors import DeviceOutOfMemoryError, InvalidValueError

__all__ = ["ARENA_PAGE", "POISON_BYTE", "SimDevice"]


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
        self._memory_bytes = memory_bytes if memory_bytes is not None else host_memory_bytes()
        self._engine = engine = SimCopyEngine(bandwidth_gbps, latency_s)
        self._cond = engine.cond  # guards allocations too: queued copies hold their operands
        self._local = threading.local()
        self.default_stream = self.stream("default")
        self.d2h_stream = self.stream("d2h")
        self.h2d_stream = self.stream("h2d")
        self._allocs: dict[int, _Allocation] = {}
        self._arenas = SimArenas(self.name, pin_chunk_bytes, pin_chunk_s)
        self._allocated_bytes = 0
        self._released_outside: set[int] = set()

    @property
    def bandwidth_gbps(self) -> float:
        """The simulated copies' bandwidth in GB/s (0: copies take no time)."""
        return self._engine.bandwidth_gbps

    @property
    def latency_s(self) -> float:
        """Seconds each copy takes before its bytes (0: none)."""
        return self._engine.latency_s

    @property
    def copies_run(self) -> int:
        """Copies the worker has run so far."""
        return self._engine.copies_run

    # --- streams and fences: the copy engine's -------------------------------

    def stream(self, name: str = "side") -> SimStream:
        """Create a new simulated stream."""
        return self._engine.stream(name)

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
        return self._engine.record(self._as_sim_stream(stream))

    def wait_on(self, stream: Stream, fence: Fence) -> None:
        self._engine.wait_on(self._as_sim_stream(stream), fence)

    def launch(self, stream: SimStream, kernel: Callable[[], object]) -> Fence:
        """Queue a host function as a "kernel" on stream (a producer that writes later)."""
        return self._engine.launch(stream, kernel)

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """Keep every operation queued inside the block from running until the block exits."""
        return self._engine.hold()

    def inject(self, kind: FaultKind, count: int = 1) -> None:
        """Make the next count operations of a kind fail (copies, allocations) or hang (fences)."""
        self._engine.inject(kind, count)

    def withdraw_faults(self) -> int:
        """Withdraw the faults injected and not fired yet; how many there were."""
        return self._engine.withdraw_faults()

    def unstick(self) -> None:
        """Let operations injected with fence_never_completes run after all (a late fence)."""
        self._engine.unstick()

    def synchronize(self) -> None:
        """Block until every queued operation has run (held ones make this wait)."""
        self._engine.synchronize()

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
        if self._engine.take_fault("alloc_fails"):
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
        self._engine.wait_completions()
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
            # Its allocations keep the operands referenced until it has run: memory
            # released meanwhile is not recycled under it.
            operands: list[Operand] = []
            for t in (src, dst):
                alloc = self._allocs.get(t.untyped_storage().data_ptr())
                if alloc is not None:
                    operands.append((alloc.op_tensors, t))
            return self._engine.copy(stream, run, src.nbytes, after, operands)

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
        self._engine.close()

    @property
    def closed(self) -> bool:
        """Whether close() has run (a receiver closes its own device after its last lease)."""
        return self._engine.closed

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
