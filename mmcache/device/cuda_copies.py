"""Single copies on one GPU: checked, queued on a copy stream or the caller's, each fenced."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import final

import torch

from mmcache.device.base import (
    Fence,
    Stream,
    Views,
    check_flat_destination,
    destination_pairs,
    packed_shape,
    typed_view,
)
from mmcache.device.cuda_arena import PinnedArena
from mmcache.device.cuda_driver import BatchCopier
from mmcache.device.cuda_driver_copies import LEGACY_DEFAULT_STREAM, DriverCopies
from mmcache.device.cuda_fence import CudaFence, order_after, record_fence
from mmcache.device.cuda_memory import DeviceMemory, record_use
from mmcache.device.cuda_streams import OnStream, as_cuda_stream
from mmcache.device.cuda_waiters import FenceWaiters
from mmcache.errors import (
    CacheClosedError,
    CopyFailedError,
    DeviceOutOfMemoryError,
    InvalidValueError,
    MMCacheError,
)
from mmcache.layouts import rows_back_to_back

__all__ = ["CudaCopies", "enqueue_error", "flat_bytes"]

_log = logging.getLogger(__name__)


def flat_bytes(tensor: torch.Tensor, role: str) -> torch.Tensor:
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


def _dense(tensor: torch.Tensor) -> bool:
    """Whether tensor's values are its bytes, back to back: copied as bytes, exact."""
    return tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def _gather_rows(srcs: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[int] | None:
    """Each source's rows, if srcs are several of one dtype and row shape, destined back to
    back, with values that are their bytes (no conjugate or negative bit); else None."""
    if len(srcs) < 2 or any(src.is_conj() or src.is_neg() for src in srcs):
        return None
    parts = [(at, tuple(src.shape), src.dtype) for src, at in zip(srcs, offsets, strict=True)]
    return rows_back_to_back(parts, srcs[0].dtype.itemsize)


def keep_blocks(tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """record_stream once per block of device memory among tensors (views of one buffer
    share it): the allocator keeps each block until the work queued on stream is done."""
    recorded: set[int] = set()
    for tensor in tensors:
        block = tensor.untyped_storage().data_ptr()
        if block not in recorded:
            recorded.add(block)
            record_use(tensor, stream)


def enqueue_error(direction: str, nbytes: int, exc: RuntimeError) -> MMCacheError:
    """The mmcache error for a copy that CUDA refused at enqueue."""
    if isinstance(exc, torch.OutOfMemoryError):
        return DeviceOutOfMemoryError(
            f"no GPU memory to queue a {direction} copy of {nbytes} bytes; lower "
            "MMCACHE_GPU_CACHE_MB (SGLANG_VLM_CACHE_SIZE_MB) or free GPU memory"
        )
    return CopyFailedError(f"queuing a {direction} copy of {nbytes} bytes failed: {exc}")


@final
class CudaCopies:
    """The copy streams of one GPU and the copies queued one at a time, each with its fence.

    Not slotted: a benchmark wraps copy_bytes on an instance to time each DMA copy.
    """

    def __init__(
        self,
        device: torch.device,
        name: str,
        memory: DeviceMemory,
        arena: PinnedArena,
        waiters: FenceWaiters,
        d2h: torch.cuda.Stream,
        h2d: torch.cuda.Stream,
        d2d_batches: BatchCopier | None = None,
        h2d_batches: BatchCopier | None = None,
    ) -> None:
        self._device = device
        self._name = name
        self._memory = memory
        self._arena = arena
        self._waiters = waiters
        self._d2h = d2h
        self._h2d = h2d
        # Several copies within the GPU, or from the arena, by one driver call where the
        # driver has them.
        self._by_driver = DriverCopies(name, device, arena, d2d_batches, h2d_batches)
        self._closed = False

    @property
    def d2d_batches(self) -> BatchCopier | None:
        """The driver's batched copies within the GPU; None without them, or once refused."""
        return self._by_driver.d2d

    @property
    def h2d_batches(self) -> BatchCopier | None:
        """The driver's batched copies from the arena; None without them, or once refused."""
        return self._by_driver.h2d

    @property
    def d2h(self) -> torch.cuda.Stream:
        """The dedicated device-to-host copy stream."""
        return self._d2h

    @property
    def h2d(self) -> torch.cuda.Stream:
        """The dedicated host-to-device copy stream."""
        return self._h2d

    def record(self, stream: Stream) -> CudaFence:
        """A fence that completes after all work queued on stream so far."""
        return self.record_on(as_cuda_stream(stream))

    def record_on(self, stream: torch.cuda.Stream) -> CudaFence:
        """record() for a stream known to be a torch.cuda.Stream."""
        return record_fence(stream, self._waiters)

    def check_open(self) -> None:
        """Raise CacheClosedError once close() has been called."""
        if self._closed:
            raise CacheClosedError(f"{self._name}: the device was closed")

    def close(self) -> None:
        """Refuse new copies (those queued run on)."""
        self._closed = True

    def synchronize(self) -> None:
        """Block until every copy queued on the copy streams has completed."""
        self._d2h.synchronize()
        self._h2d.synchronize()

    def copy_d2h(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> CudaFence:
        """Queue src (this GPU) -> dst (pinned host) on the D2H stream after the fences."""
        self.check_open()
        src_bytes, dst_bytes = self._operands(src, dst, device_src=True)
        stream = self._d2h
        try:
            with OnStream(stream):
                order_after(stream, after)
                self.copy_bytes(dst_bytes, src_bytes, host=dst_bytes)
                # The caching allocator must not recycle src while the copy engine reads it.
                record_use(src, stream)
                return self.record_on(stream)
        except RuntimeError as exc:
            raise enqueue_error("device-to-host", src_bytes.numel(), exc) from exc

    def copy_h2d(self, src: torch.Tensor, dst: torch.Tensor, after: Sequence[Fence]) -> CudaFence:
        """Queue src (pinned host) -> dst (this GPU) on the H2D stream after the fences."""
        self.check_open()
        dst_bytes, src_bytes = self._operands(dst, src, device_src=False)
        stream = self._h2d
        try:
            with OnStream(stream):
                order_after(stream, after)
                self.copy_bytes(dst_bytes, src_bytes, host=src_bytes)
                record_use(dst, stream)
                return self.record_on(stream)
        except RuntimeError as exc:
            raise enqueue_error("host-to-device", src_bytes.numel(), exc) from exc

    def copy_h2d_new(
        self, src: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, after: Sequence[Fence]
    ) -> tuple[torch.Tensor, CudaFence]:
        """A new tensor of this GPU filled from src (pinned host) on the H2D stream.

        Allocated from the H2D stream's own pool, in the same stream switch as the copy:
        the allocator then orders its reuse after the copy with no record_stream.
        """
        stream = self._h2d
        with OnStream(stream):
            dst = self._new_from_host(src, shape, dtype, stream, after)
            try:
                return dst, self.record_on(stream)
            except RuntimeError as exc:
                raise enqueue_error("host-to-device", dst.nbytes, exc) from exc

    def upload_on(
        self,
        src: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: Stream,
        after: Sequence[Fence],
    ) -> torch.Tensor:
        """A new tensor of this GPU filled from src (pinned host) on the reader's stream.

        Allocated from that stream's pool and copied there: the reader's later work is
        ordered after the copy, and the memory is the reader's like any it allocated.
        """
        cuda_stream = as_cuda_stream(stream)
        with OnStream(cuda_stream):
            return self._new_from_host(src, shape, dtype, cuda_stream, after)

    def upload_packed_on(
        self,
        srcs: Sequence[torch.Tensor],
        offsets: Sequence[int],
        nbytes: int,
        stream: Stream,
        after: Sequence[Fence],
    ) -> torch.Tensor:
        """A new flat uint8 buffer of nbytes filled from srcs (pinned host, flat bytes) at
        offsets, allocated and copied on the reader's stream (see upload_on)."""
        self.check_open()
        for src, offset in zip(srcs, offsets, strict=True):
            if src.device.type != "cpu":
                raise InvalidValueError(f"copy source is on {src.device}, not host memory")
            if offset < 0 or offset + src.nbytes > nbytes:
                raise InvalidValueError(
                    f"a {src.nbytes}-byte source at offset {offset} overruns {nbytes} bytes"
                )
        cuda_stream = as_cuda_stream(stream)
        try:
            with OnStream(cuda_stream):
                buffer = self._memory.empty_here((nbytes,), torch.uint8)
                order_after(cuda_stream, after)
                base = buffer.data_ptr()
                if not self._by_driver.upload(
                    srcs, [base + offset for offset in offsets], cuda_stream
                ):
                    for src, offset in zip(srcs, offsets, strict=True):
                        src_bytes = flat_bytes(src, "source")
                        dst = buffer[offset : offset + src_bytes.numel()]
                        self.copy_bytes(dst, src_bytes, host=src_bytes)
        except RuntimeError as exc:
            raise enqueue_error("host-to-device", nbytes, exc) from exc
        return buffer

    def _new_from_host(
        self,
        src: torch.Tensor,
        shape: Sequence[int],
        dtype: torch.dtype,
        stream: torch.cuda.Stream,
        after: Sequence[Fence],
    ) -> torch.Tensor:
        """Allocate on the current stream (the caller switched to stream) and queue a copy
        of src into it there, after the fences."""
        self.check_open()
        src_bytes = flat_bytes(src, "source")
        if src.device.type != "cpu":
            raise InvalidValueError(f"copy source is on {src.device}, not host memory")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if src_bytes.numel() != nbytes:
            raise InvalidValueError(
                f"copy of {src_bytes.numel()} bytes into a {nbytes}-byte destination"
            )
        try:
            dst = self._memory.empty_here(shape, dtype)
            order_after(stream, after)
            self.copy_bytes(flat_bytes(dst, "destination"), src_bytes, host=src_bytes)
        except RuntimeError as exc:
            raise enqueue_error("host-to-device", nbytes, exc) from exc
        return dst

    def copy_h2d_many(
        self, srcs: Sequence[torch.Tensor], dsts: Sequence[torch.Tensor], after: Sequence[Fence]
    ) -> CudaFence:
        """copy_h2d of several pairs on the H2D stream: one ordering, one fence for all."""
        self.check_open()
        device = self._device
        nbytes = 0
        for src, dst in zip(srcs, dsts, strict=True):
            # The checks of _operands without its flat views, which only torch's copies
            # need: a turn's batch checks dozens of pairs.
            if not (
                dst.device == device
                and src.device.type == "cpu"
                and dst.is_contiguous()
                and src.is_contiguous()
                and not (dst.is_conj() or dst.is_neg() or src.is_conj() or src.is_neg())
                and dst.nbytes == src.nbytes
            ):
                self._operands(dst, src, device_src=False)  # raises what is wrong
            nbytes += src.nbytes
        stream = self._h2d
        try:
            with OnStream(stream):
                order_after(stream, after)
                if not self._by_driver.upload(srcs, [dst.data_ptr() for dst in dsts], stream):
                    for src, dst in zip(srcs, dsts, strict=True):
                        src_bytes = flat_bytes(src, "source")
                        self.copy_bytes(flat_bytes(dst, "destination"), src_bytes, host=src_bytes)
                keep_blocks(dsts, stream)
                return self.record_on(stream)
        except RuntimeError as exc:
            raise enqueue_error("host-to-device", nbytes, exc) from exc

    def copy_d2d(self, src: torch.Tensor, dst: torch.Tensor, stream: Stream) -> CudaFence:
        """Queue src -> dst (both on this GPU; src may be strided) on stream."""
        return self.copy_d2d_many(((src, dst),), stream)

    def copy_d2d_many(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        stream: Stream,
        *,
        dsts_held: bool = False,
    ) -> CudaFence:
        """Queue each src -> dst of pairs on stream behind one fence (one event recorded).

        The caching allocator keeps each source's block (once per block: views of one
        tensor share it) and, unless dsts_held (the caller keeps them, as the IPC pool,
        which is not the allocator's), each destination's until the copies are done.
        """
        self.check_open()
        cuda_stream = as_cuda_stream(stream)
        alike = []  # per pair: the same shape and dtype (an element-wise copy)
        for src, dst in pairs:
            for tensor, role in ((src, "source"), (dst, "destination")):
                if not self._memory.is_device_tensor(tensor):
                    raise InvalidValueError(f"copy {role} is on {tensor.device}, not {self._name}")
            same = src.shape == dst.shape and src.dtype == dst.dtype
            if not same and src.nbytes != dst.nbytes:
                raise InvalidValueError(
                    f"copy of {src.nbytes} bytes into a {dst.nbytes}-byte destination"
                )
            alike.append(same)
        srcs = [src for src, _ in pairs]
        # Several dense pairs: one driver batch, where the driver has them.
        by_driver = (
            self._by_driver.d2d is not None
            and len(pairs) > 1
            and all(_dense(src) and _dense(dst) for src, dst in pairs)
        )
        try:
            if not (
                by_driver
                and self._by_driver.within_gpu(srcs, [d.data_ptr() for _, d in pairs], cuda_stream)
            ):
                with OnStream(cuda_stream):
                    for (src, dst), same in zip(pairs, alike, strict=True):
                        if same:
                            dst.copy_(src, non_blocking=True)
                        else:
                            flat_bytes(dst, "destination").copy_(
                                flat_bytes(src, "source"), non_blocking=True
                            )
            kept = srcs if dsts_held else [t for p in pairs for t in p]
            keep_blocks(kept, cuda_stream)
            return self.record_on(cuda_stream)
        except RuntimeError as exc:
            nbytes = sum(src.nbytes for src, _ in pairs)
            raise enqueue_error("device-to-device", nbytes, exc) from exc

    def copy_d2d_into(
        self,
        srcs: Sequence[torch.Tensor],
        dst: torch.Tensor,
        offsets: Sequence[int],
        stream: Stream,
        views: Views | None = None,
    ) -> CudaFence:
        """Queue srcs into dst's bytes at offsets on stream behind one fence (see
        CopyPlan "d2d" into): sources alike and destined back to back (a request's
        features) by one gather kernel; other dense ones by one driver batch, naming
        addresses (no destination views), where the driver has batched copies; else view
        by view."""
        self.check_open()
        check_flat_destination(srcs, dst, offsets)
        for tensor in (dst, *srcs):
            if not self._memory.is_device_tensor(tensor):
                raise InvalidValueError(f"copy operand is on {tensor.device}, not {self._name}")
        cuda_stream = as_cuda_stream(stream)
        rows = _gather_rows(srcs, offsets)
        if rows is not None:
            return self._gather_into(srcs, dst, offsets[0], rows, cuda_stream, views)
        # One copy on the legacy default stream gains nothing from the driver's batches
        # (they need a stream of their own there, see DriverCopies.batch).
        alone = len(srcs) < 2 and cuda_stream.cuda_stream == LEGACY_DEFAULT_STREAM
        if self._by_driver.d2d is None or alone or not all(map(_dense, srcs)):
            pairs = destination_pairs(srcs, dst, offsets, views)
            return self.copy_d2d_many(pairs, stream, dsts_held=True)
        base = dst.data_ptr()
        try:
            if not self._by_driver.within_gpu(srcs, [base + at for at in offsets], cuda_stream):
                return self.copy_d2d_into(srcs, dst, offsets, stream, views)  # now by torch
            keep_blocks(srcs, cuda_stream)
            return self.record_on(cuda_stream)
        except RuntimeError as exc:
            raise enqueue_error("device-to-device", sum(s.nbytes for s in srcs), exc) from exc

    def _gather_into(
        self,
        srcs: Sequence[torch.Tensor],
        dst: torch.Tensor,
        offset: int,
        rows: Sequence[int],
        stream: torch.cuda.Stream,
        views: Views | None,
    ) -> CudaFence:
        """Queue srcs (alike, see _gather_rows) into dst's bytes from offset by one torch.cat
        on stream: one kernel launch writes them all, where the driver's batch costs host
        time per copy and, on the legacy default stream, a side stream's two waits."""
        first = srcs[0]
        shape = (sum(rows), *first.shape[1:])
        whole = (
            views(offset, shape, first.dtype)
            if views is not None
            else typed_view(dst, offset, shape, first.dtype)
        )
        try:
            with OnStream(stream):
                torch.cat(list(srcs), out=whole)
            keep_blocks(srcs, stream)
            return self.record_on(stream)
        except RuntimeError as exc:
            raise enqueue_error("device-to-device", sum(s.nbytes for s in srcs), exc) from exc

    def copy_d2d_new(self, src: torch.Tensor, stream: Stream) -> tuple[torch.Tensor, CudaFence]:
        """A new tensor of this GPU filled from src (this GPU, contiguous) on stream.

        Allocated from stream's pool, in the same stream switch as the copy: the allocator
        then orders its reuse after the copy with no record_stream. src gets none either:
        the caller keeps it valid until the fence is done.
        """
        self.check_open()
        if not self._memory.is_device_tensor(src):
            raise InvalidValueError(f"copy source is on {src.device}, not {self._name}")
        cuda_stream = as_cuda_stream(stream)
        try:
            with OnStream(cuda_stream):
                dst = self._memory.empty_here(src.shape, src.dtype)
                dst.copy_(src, non_blocking=True)
                return dst, self.record_on(cuda_stream)
        except RuntimeError as exc:
            raise enqueue_error("device-to-device", src.nbytes, exc) from exc

    def pack(self, srcs: Sequence[torch.Tensor], stream: Stream) -> tuple[torch.Tensor, CudaFence]:
        """srcs' rows back to back in a new tensor: one torch.cat kernel on stream.

        The result comes from stream's pool (the stream that writes it). As with
        copy_d2h_batch, the caller keeps the sources referenced until the fence: they may
        come from another stream's pool, and a record_stream for each would cost the loop
        host time per feature.
        """
        self.check_open()
        cuda_stream = as_cuda_stream(stream)
        try:
            # Contiguous whatever the sources' layout (torch.cat keeps channels_last), and
            # outside autograd: the cache must not keep an encoder's graph alive.
            with OnStream(cuda_stream), torch.no_grad():
                packed = torch.empty(packed_shape(srcs), dtype=srcs[0].dtype, device=self._device)
                torch.cat(list(srcs), out=packed)
                return packed, self.record(cuda_stream)
        except RuntimeError as exc:
            raise enqueue_error("device-to-device", sum(s.nbytes for s in srcs), exc) from exc

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor, *, host: torch.Tensor) -> None:
        """dst.copy_(src) on the current stream, split where host crosses an arena chunk."""
        if dst.numel() == 0:
            return
        pieces = self._arena.chunk_pieces(host.data_ptr(), host.numel())
        if pieces is None:
            dst.copy_(src, non_blocking=True)
            return
        for start, stop in pieces:
            dst[start:stop].copy_(src[start:stop], non_blocking=True)

    def _operands(
        self, device_side: torch.Tensor, host_side: torch.Tensor, *, device_src: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate a device/host pair; return (device bytes, host bytes) views."""
        device_role, host_role = (
            ("source", "destination") if device_src else ("destination", "source")
        )
        if not self._memory.is_device_tensor(device_side):
            raise InvalidValueError(
                f"copy {device_role} is on {device_side.device}, not {self._name}"
            )
        if host_side.device.type != "cpu":
            raise InvalidValueError(f"copy {host_role} is on {host_side.device}, not host memory")
        device_bytes = flat_bytes(device_side, device_role)
        host_bytes = flat_bytes(host_side, host_role)
        if device_bytes.numel() != host_bytes.numel():
            src_n, dst_n = (
                (device_bytes.numel(), host_bytes.numel())
                if device_src
                else (host_bytes.numel(), device_bytes.numel())
            )
            raise InvalidValueError(f"copy of {src_n} bytes into a {dst_n}-byte destination")
        return device_bytes, host_bytes
