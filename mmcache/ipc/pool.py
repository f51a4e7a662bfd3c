"""Slice arenas: the IPC pool and the host fallback, each one flat allocation carved into slices.

Slices are best-fit aligned blocks from a coalescing free list (HostPool); a
freed slice is reused only after the fences it is freed after. A fallback
arena on the simulator reserves its /dev/shm pages chunk by chunk as slices
first reach them, so an unused budget costs nothing and a full /dev/shm is a
clean error at send, never SIGBUS.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Final, final

import torch

from mmcache.device.base import Device, Fence
from mmcache.host_pool import Defer, HostBlock, HostPool
from mmcache.ipc.shm import SharedSegment
from mmcache.layouts import contiguous_strides

__all__ = ["COMMIT_CHUNK", "ArenaViews", "SliceArena", "SlotAllocator"]

#: Granularity of lazy /dev/shm reservation.
COMMIT_CHUNK: Final = 2 << 20


@final
class ArenaViews:
    """A flat uint8 tensor's features as tensors of their own dtype and shape, each made
    by one tensor operation (as_strided of the whole arena viewed as that dtype)."""

    __slots__ = ("_typed", "flat")

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        # dtype -> the arena viewed as it and that view's storage offset; None: this dtype
        # cannot view the whole arena, its features are sliced instead.
        self._typed: dict[torch.dtype, tuple[torch.Tensor, int] | None] = {}

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The bytes from offset as a contiguous tensor of shape and dtype; the caller has
        checked that they lie in the arena (as_strided checks only its storage's bounds)."""
        try:
            typed = self._typed[dtype]
        except KeyError:
            typed = self._typed[dtype] = self._typed_alias(dtype)
        itemsize = dtype.itemsize
        if typed is None or offset % itemsize:
            nbytes = math.prod(shape) * itemsize
            return self.flat[offset : offset + nbytes].view(dtype).view(shape)
        alias, base = typed
        return alias.as_strided(shape, contiguous_strides(shape), base + offset // itemsize)

    def _typed_alias(self, dtype: torch.dtype) -> tuple[torch.Tensor, int] | None:
        try:
            alias = self.flat.view(dtype)
        except RuntimeError:  # a size or start that is not a whole number of items
            return None
        return alias, int(alias.storage_offset())


@final
class SliceArena:
    """One flat uint8 arena shared with receivers, handing out aligned slices."""

    __slots__ = (
        "_allocator",
        "_committed",
        "_device",
        "_hint",
        "_segment",
        "_views",
        "tensor",
    )

    def __init__(
        self,
        tensor: torch.Tensor,
        device: Device,
        *,
        alignment: int,
        defer: Defer,
        on_free: Callable[[], None],
        segment: SharedSegment | None = None,
        lazy_commit_hint: str | None = None,
    ) -> None:
        self.tensor = tensor
        self._views = ArenaViews(tensor)
        self._device = device
        self._segment = segment
        self._hint = lazy_commit_hint
        # None: every page is already reserved (or it is device memory).
        self._committed: set[int] | None = set() if lazy_commit_hint is not None else None
        self._allocator = HostPool(
            device, tensor, alignment=alignment, defer=defer, on_free=on_free
        )

    @property
    def capacity_bytes(self) -> int:
        return self._allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes in slices handed out and not yet reclaimed (those freeing included)."""
        return self._allocator.used_bytes

    @property
    def freeing_bytes(self) -> int:
        """Bytes of slices given back and waiting for their fences."""
        return self._allocator.freeing_bytes

    @property
    def max_slice_bytes(self) -> int:
        return self._allocator.max_block_bytes

    def allocate(self, nbytes: int) -> HostBlock | None:
        """Best-fit slice of at least nbytes, or None if none is free now."""
        if nbytes > self.max_slice_bytes:
            return None
        return self._allocator.allocate(nbytes)

    def free(self, block: HostBlock, after: Sequence[Fence] = ()) -> None:
        """Give a slice back; it is reused once every fence in after is done."""
        self._allocator.free(block, after)

    def commit(self, block: HostBlock) -> None:
        """Reserve the /dev/shm pages under block (SharedMemoryFullError when it is full)."""
        if self._committed is None or self._segment is None or self._hint is None:
            return
        first = block.offset // COMMIT_CHUNK
        last = (block.offset + block.nbytes - 1) // COMMIT_CHUNK
        for chunk in range(first, last + 1):
            if chunk in self._committed:
                continue
            start = chunk * COMMIT_CHUNK
            stop = min(start + COMMIT_CHUNK, self.tensor.numel())
            self._segment.commit(start, stop - start, self._hint)
            # Fresh tmpfs pages are zeros: poison them so an early read is never plausible.
            self._device.poison_host(self.tensor[start:stop])
            self._committed.add(chunk)

    @property
    def views(self) -> ArenaViews:
        """The whole arena's typed views (offsets from the arena's start)."""
        return self._views


@final
class SlotAllocator:
    """Control-block slot numbers, lowest free first (so few CUDA IPC events are ever made)."""

    __slots__ = ("_free", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free = list(range(capacity))

    def take(self) -> int | None:
        return heapq.heappop(self._free) if self._free else None

    def give(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
