"""CudaDevice: the Device interface over torch.cuda (copy streams, event fences, a pinned arena).

The parts, one per module: cuda_streams (current streams), cuda_fence (events as fences),
cuda_waiters (threads running fence callbacks), cuda_memory (device tensors),
cuda_arena (the pinned host arena), cuda_copies (single copies) and cuda_batch (batched
offloads). CudaDevice builds them and forwards the Device interface to them.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Final, final

import torch

from mmcache.device.base import ArenaProgress, Device, Fence, Stream, Views
from mmcache.device.cuda_arena import DEFAULT_PIN_CHUNK_BYTES, PAGE, ArenaMethod, PinnedArena
from mmcache.device.cuda_batch import (
    DEFAULT_BATCHED_PACK_MAX_BYTES,
    DEFAULT_PACK_MAX_BYTES,
    BatchedCopies,
)
from mmcache.device.cuda_copies import CudaCopies
from mmcache.device.cuda_driver import BatchCopier, CudaDriver
from mmcache.device.cuda_fence import CudaFence, pending_event
from mmcache.device.cuda_memory import DeviceMemory, record_use
from mmcache.device.cuda_streams import CurrentStreams, OnStream, as_cuda_stream, new_stream
from mmcache.device.cuda_waiters import FenceWaiters
from mmcache.errors import InvalidValueError, MMCacheError

__all__ = [
    "DEFAULT_BATCHED_PACK_MAX_BYTES",
    "DEFAULT_PACK_MAX_BYTES",
    "DEFAULT_PIN_CHUNK_BYTES",
    "ArenaMethod",
    "CudaDevice",
    "CudaFence",
    "as_cuda_stream",
]

_log = logging.getLogger(__name__)

#: Feature dtypes whose copy and cat kernels a new device loads before serving.
_WARM_DTYPES: Final = (torch.bfloat16, torch.float16, torch.float32)


@final
class _LazyDriver:
    """The driver binding, loaded at first use: a device that neither pins an arena nor
    batches copies never loads it.

    Not a bound method of the device: the arena keeps this, and a reference back to the
    device would keep both alive, and a registered arena pinned, until the cyclic
    collector runs rather than when the device's last reference goes.
    """

    __slots__ = ("instance",)

    def __init__(self) -> None:
        self.instance: CudaDriver | None = None

    def __call__(self) -> CudaDriver:
        if self.instance is None:
            self.instance = CudaDriver.get()
        return self.instance


class CudaDevice(Device):
    """The Device interface over torch.cuda: copy streams, event fences and a pinned host arena."""

    kind = "cuda"
    stream_ordered_reads = True
    copies_keep_destinations = True

    #: None: the host pool may place blocks anywhere. A "register" arena is pinned in
    #: pin_chunk_bytes chunks, and a copy that crosses a chunk boundary is split here, so
    #: blocks may straddle chunks and exceed their size.
    arena_chunk_bytes = None

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
        if pin_chunk_bytes <= 0 or pin_chunk_bytes % PAGE:
            raise InvalidValueError(
                f"pin_chunk_bytes must be a positive multiple of {PAGE}, not {pin_chunk_bytes}"
            )
        self._device = _resolve_device(index)
        self.name = str(self._device)
        self.index: int = self._device.index if self._device.index is not None else 0
        self.cuda_index = self.index
        self._driver = _LazyDriver()
        copier: BatchCopier | None = None
        d2d_copier: BatchCopier | None = None
        h2d_copier: BatchCopier | None = None
        if batch_copies:
            try:
                copier = self._driver().batch_copier(self.index, "d2h")
                d2d_copier = self._driver().batch_copier(self.index, "d2d")
                h2d_copier = self._driver().batch_copier(self.index, "h2d")
            except Exception as exc:  # copies still work through torch
                _log.warning("%s: no batched copies through the driver (%s)", self.name, str(exc))
        with torch.cuda.device(self._device):
            # Priorities only order kernels (the copy engines ignore them): the D2H stream runs
            # the packing kernel and should yield to compute; promotions are on the get path.
            d2h = new_stream(self._device, priority=0)
            h2d = new_stream(self._device, priority=-1)
        self._waiters = FenceWaiters(self._device, f"mmcache-fences-{self.name}")
        self._arena = PinnedArena(
            self.name,
            self.index,
            self._driver,
            method=arena_method,
            background_pinning=background_pinning,
            pin_chunk_bytes=pin_chunk_bytes,
            huge_pages=huge_pages,
        )
        self._memory = DeviceMemory(self._device, self.name, h2d)
        self._copies = CudaCopies(
            self._device,
            self.name,
            self._memory,
            self._arena,
            self._waiters,
            d2h,
            h2d,
            d2d_copier,
            h2d_copier,
        )
        self._batches = BatchedCopies(
            self.name, self._memory, self._arena, self._copies, copier, pack_max_bytes
        )
        self._streams = CurrentStreams(self._device, self.index)
        self._closed = False
        self._warm_up()

    def _warm_up(self) -> None:
        """Pay now, once, what a put or get would otherwise pay while serving.

        CUDA loads kernels on first launch, and torch's allocators set up on first use:
        in a fresh process the first packing kernel (torch.cat), the first record_stream
        and the first pinned host tensor each take long enough to stall the thread that
        calls them, the event loop's at the first put or get. Kernels are per dtype
        (_WARM_DTYPES; others pay their first launch when used). Only an optimisation: a
        failure is logged, and the first calls pay as before.
        """
        d2h = self._copies.d2h
        try:
            with torch.cuda.device(self._device), torch.no_grad():
                for dtype in _WARM_DTYPES:
                    rows = torch.empty(2, 4, 8, dtype=dtype, device=self._device)
                    rows.record_stream(d2h)
                    with OnStream(d2h):
                        # torch.cat has a kernel per dimension count: packs of 1-3 dims.
                        for dims in (1, 2, 3):
                            part = rows.reshape(-1) if dims == 1 else rows.flatten(0, 3 - dims)
                            torch.cat([part, part, part])
                        # A contiguous copy is a plain memcpy; a strided source (as
                        # a d2d CopyPlan may get) runs torch's copy kernel.
                        rows[0].transpose(0, 1).contiguous()
                torch.empty(PAGE, dtype=torch.uint8, pin_memory=True)
                # Only the streams used here: a device-wide wait would also wait for (or
                # break a graph capture of) other threads' work.
                d2h.synchronize()
        except RuntimeError as exc:
            reason = str(exc)  # not exc: a record keeping its traceback keeps its frames' tensors
            _log.warning("%s: warming up failed (%s); first copies may be slow", self.name, reason)

    # --- settings, read back ----------------------------------------------------

    @property
    def arena_method(self) -> ArenaMethod:
        """How the host arena is pinned ("register" or "hostalloc")."""
        return self._arena.method

    @property
    def background_pinning(self) -> bool:
        """Whether host_arena pins on a background thread."""
        return self._arena.background_pinning

    @property
    def pin_chunk_bytes(self) -> int:
        """The size of the chunks a "register" arena is pinned in (a hostalloc arena: its size)."""
        return self._arena.pin_chunk_bytes

    @property
    def huge_pages(self) -> bool:
        """Whether a "register" arena asks for 2 MiB pages."""
        return self._arena.huge_pages

    @property
    def pack_max_bytes(self) -> int:
        """Sources of a batch up to this size are gathered with their neighbours."""
        return self._batches.pack_max_bytes

    @property
    def driver_min_runs(self) -> int:
        """Batches of at least this many copies into the arena go through the driver's
        batched copies; fewer through torch's copy_."""
        return self._batches.driver_min_runs

    # --- streams and fences -------------------------------------------------

    def current_stream(self) -> Stream:
        """The calling thread's current stream on this device."""
        return self._streams.current()

    def copy_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The dedicated (D2H, H2D) copy streams."""
        return self._copies.d2h, self._copies.h2d

    def synchronize(self) -> None:
        """Block until all work queued on this GPU has completed (tests and benchmarks)."""
        torch.cuda.synchronize(self._device)

    @property
    def d2h_stream(self) -> torch.cuda.Stream:
        """The dedicated device-to-host copy stream."""
        return self._copies.d2h

    @property
    def h2d_stream(self) -> torch.cuda.Stream:
        """The dedicated host-to-device copy stream."""
        return self._copies.h2d

    def record(self, stream: Stream) -> CudaFence:
        """A fence that completes after all work queued on stream so far."""
        return self._copies.record(stream)

    def wait_on(self, stream: Stream, fence: Fence) -> None:
        """Make later work on stream wait for fence (no host synchronisation)."""
        event = pending_event(fence)
        if event is not None:
            as_cuda_stream(stream).wait_event(event)

    # --- memory -------------------------------------------------------------

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """True if tensor lives in this GPU's memory."""
        return self._memory.is_device_tensor(tensor)

    def adopt(self, tensor: torch.Tensor, stream: Stream) -> torch.Tensor:
        """Return the cache's own alias of a tensor on this GPU."""
        return self._memory.adopt(tensor)

    def empty(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: Stream | None = None,
        *,
        host: bool = False,
    ) -> torch.Tensor:
        """Allocate on this GPU from the pool of stream (default: the H2D copy stream); a
        host tensor is pinned, so a download into it is asynchronous (a pageable one blocks
        the loop)."""
        if host:
            return self._memory.host_empty(shape, dtype)
        return self._memory.empty(shape, dtype, stream)

    def _empty(
        self, shape: Sequence[int], dtype: torch.dtype, stream: Stream | None
    ) -> torch.Tensor:
        return self._memory.empty(shape, dtype, stream)

    def use_on(self, tensor: torch.Tensor, stream: Stream) -> None:
        """record_stream: the allocator keeps tensor's block until stream's queued work is done."""
        record_use(tensor, as_cuda_stream(stream))  # a read's: no frame in between

    def use_all_on(self, tensors: Iterable[torch.Tensor], stream: Stream) -> None:
        """use_on of each of tensors, the stream resolved once (a batch's outputs)."""
        on = as_cuda_stream(stream)
        for tensor in tensors:
            record_use(tensor, on)

    def release(self, tensor: torch.Tensor, after: Sequence[Fence]) -> None:
        """Drop the cache's alias once every fence in after is done."""
        self._memory.release(tensor, after)

    def _host_arena(self, nbytes: int) -> torch.Tensor:
        """Allocate and pin the host arena, once: a flat uint8 tensor of nbytes."""
        return self._arena.host_arena(nbytes)

    def host_arena(
        self, nbytes: int, on_pinned: ArenaProgress | None = None
    ) -> concurrent.futures.Future[torch.Tensor]:
        """Pin the host arena on a background thread (pinning is slow), unless
        background_pinning is off; a "register" arena reports each chunk pinned to
        on_pinned."""
        if not self._arena.background_pinning:
            return super().host_arena(nbytes, on_pinned)
        return self._arena.host_arena_async(nbytes, on_pinned)

    def one_pinned_range(self, host: torch.Tensor) -> bool:
        """Whether host lies in one registered chunk of the arena (or outside the arena)."""
        return self._arena.chunk_pieces(host.data_ptr(), host.nbytes) is None

    # --- copies -------------------------------------------------------------

    def _copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> CudaFence:
        """Queue src (this GPU) -> dst (pinned host) on the D2H stream after the fences."""
        return self._copies.copy_d2h(src, dst, after)

    def _copy_h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> CudaFence:
        """Queue src (pinned host) -> dst (this GPU) on the H2D stream after the fences."""
        return self._copies.copy_h2d(src, dst, after)

    def _copy_h2d_new(
        self, src: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, after: Sequence[Fence]
    ) -> tuple[torch.Tensor, CudaFence]:
        """A new tensor filled from src: allocated and copied in one switch to the H2D stream."""
        return self._copies.copy_h2d_new(src, shape, dtype, after)

    def _upload_on(
        self,
        src: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, None]:
        """Allocated and copied on the reader's stream: ordered before its later work,
        with no event, stream switch or record_stream of ours."""
        return self._copies.upload_on(src, shape, dtype, stream, after), None

    def _upload_packed_on(
        self,
        srcs: Sequence[torch.Tensor],
        offsets: Sequence[int],
        nbytes: int,
        stream: Stream,
        after: Sequence[Fence],
    ) -> tuple[torch.Tensor, None]:
        """One buffer allocated and filled on the reader's stream, as _upload_on does."""
        return self._copies.upload_packed_on(srcs, offsets, nbytes, stream, after), None

    def _copy_h2d_many(
        self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], after: Sequence[Fence]
    ) -> CudaFence:
        """Several host-to-device pairs: one ordering on the H2D stream, one fence for all."""
        return self._copies.copy_h2d_many(srcs, dsts, after)

    def _copy_d2d(self, src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> CudaFence:
        """Queue src -> dst (both on this GPU; src may be strided) on stream."""
        return self._copies.copy_d2d(src, dst, stream)

    def _copy_d2d_many(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        stream: Stream,
        *,
        dsts_held: bool = False,
    ) -> CudaFence:
        """Queue each src -> dst of pairs on stream behind one fence (dsts_held: no
        record_stream for the destinations, which the caller keeps)."""
        return self._copies.copy_d2d_many(pairs, stream, dsts_held=dsts_held)

    def _copy_d2d_into(
        self,
        srcs: Sequence[torch.Tensor],
        dst: torch.Tensor,
        offsets: Sequence[int],
        stream: Stream,
        views: Views | None = None,
    ) -> CudaFence:
        """Queue srcs into dst's bytes at offsets on stream: a request's alike features by one
        gather kernel, other dense sources by one driver batch where it has them."""
        return self._copies.copy_d2d_into(srcs, dst, offsets, stream, views)

    def _copy_d2d_new(self, src: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, CudaFence]:
        """A new tensor filled from src: allocated and copied in one switch to stream."""
        return self._copies.copy_d2d_new(src, stream)

    def _pack(self, srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, CudaFence]:
        """srcs' rows back to back in a new tensor: one torch.cat kernel on stream."""
        return self._copies.pack(srcs, stream)

    def _copy_d2h_batch(
        self,
        srcs: Sequence[torch.Tensor],
        host: torch.Tensor,
        offsets: Sequence[int],
        after: Sequence[Fence],
        *,
        owned: bool = False,
    ) -> CudaFence:
        """Queue copies of srcs into host's bytes at offsets on the D2H stream, one fence."""
        return self._batches.copy_d2h_batch(srcs, host, offsets, after, owned=owned)

    # --- lifecycle ------------------------------------------------------------

    def close(self) -> None:
        """Finish queued copies and callbacks, stop the waiters, unpin a registered arena."""
        if self._closed:
            return
        self._closed = True
        self._copies.close()
        self._arena.stop_pinning()
        self._copies.synchronize()
        self._waiters.close(timeout=60.0)
        self._arena.unpin()

    @property
    def memory_bytes(self) -> int:
        """The GPU's whole memory in bytes."""
        return int(torch.cuda.get_device_properties(self._device).total_memory)

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
            "arena_bytes": self._arena.nbytes,
            "pin_chunk_bytes": self.pin_chunk_bytes,
            "huge_pages": self.huge_pages,
            "pack_max_bytes": self.pack_max_bytes,
            "batched_copies": (
                "torch copy_" if self._batches.copier is None else "cuMemcpyBatchAsync"
            ),
            "batched_copies_within_gpu": (
                "torch copy_" if self._copies.d2d_batches is None else "cuMemcpyBatchAsync"
            ),
            "batched_uploads": (
                "torch copy_" if self._copies.h2d_batches is None else "cuMemcpyBatchAsync"
            ),
        }
        if self._driver.instance is not None:
            facts["driver_cuda"] = self._driver.instance.version
        return facts


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
