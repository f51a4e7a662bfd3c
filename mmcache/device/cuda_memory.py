"""Device memory on one GPU: adopting a caller's tensor, allocating, and releasing after fences."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Final, final

import torch

from mmcache.device.base import Fence, Stream
from mmcache.device.cuda_streams import OnStream, as_cuda_stream
from mmcache.errors import DeviceOutOfMemoryError, InvalidValueError

__all__ = ["DeviceMemory", "record_use"]

_MiB: Final = 1 << 20


def record_use(tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """tensor.record_stream(stream): the allocator keeps its block until stream's work is done.

    Never on a lazy conjugate or negative view itself: in torch 2.11 record_stream of such a
    view writes past a host heap chunk (glibc aborts at a later allocation: "malloc():
    unsorted double linked list corrupted"), so the block is named by a plain byte alias
    of the same storage instead.
    """
    if tensor.is_conj() or tensor.is_neg():
        storage = tensor.untyped_storage()
        tensor = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
    tensor.record_stream(stream)


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


@final
class DeviceMemory:
    """The cache's tensors on one GPU, from torch's caching allocator."""

    __slots__ = ("_alloc_stream", "_device", "_name")

    def __init__(self, device: torch.device, name: str, alloc_stream: torch.cuda.Stream) -> None:
        self._device = device
        self._name = name
        self._alloc_stream = alloc_stream  # the pool of allocations that name no stream

    def is_device_tensor(self, tensor: torch.Tensor) -> bool:
        """True if tensor lives in this GPU's memory."""
        return tensor.device == self._device

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return the cache's own alias of a tensor on this GPU."""
        if not self.is_device_tensor(tensor):
            raise InvalidValueError(
                f"expected a tensor on {self._name}, got one on {tensor.device}; "
                f"move it to {self._name} first"
            )
        return tensor.detach()

    def empty(
        self, shape: Sequence[int], dtype: torch.dtype, stream: Stream | None = None
    ) -> torch.Tensor:
        """Allocate on this GPU from the pool of stream (default: the H2D copy stream).

        The pool is the stream that first writes the memory: a block the caching allocator
        hands out on stream S may still be read by work queued on S before it was freed.
        """
        alloc_stream = self._alloc_stream if stream is None else as_cuda_stream(stream)
        with OnStream(alloc_stream):
            return self.empty_here(shape, dtype)

    def empty_here(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Allocate on this GPU from the current stream's pool (the caller switched to it)."""
        try:
            return torch.empty(tuple(shape), dtype=dtype, device=self._device)
        except torch.OutOfMemoryError as exc:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            raise DeviceOutOfMemoryError(
                f"could not allocate {nbytes / _MiB:.1f} MiB on {self._name}; lower "
                "MMCACHE_GPU_CACHE_MB (SGLANG_VLM_CACHE_SIZE_MB) or free GPU memory"
            ) from exc

    @staticmethod
    def host_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Pinned, so a download into it is asynchronous (a pageable one blocks the loop).

        Caller-owned results come from torch's caching host allocator: it rounds sizes up,
        but reuses blocks across gets, and these are not the cache's arena.
        """
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    @staticmethod
    def release(tensor: torch.Tensor, after: Sequence[Fence]) -> None:
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
