"""HostPool: one host arena allocated once, carved into aligned blocks; coalescing free list."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from mmcache.device.base import Device, Fence

__all__ = ["HostBlock", "HostPool"]

#: fresh arena bytes a device that poisons host memory is told of at once, at least
POISON_AHEAD_BYTES = 1 << 20

Defer = Callable[[Sequence[Fence], Callable[[], None]], None]


@dataclass(slots=True, eq=False)
class HostBlock:
    """A byte range of the arena: offset and size are multiples of the pool's alignment."""

    offset: int
    nbytes: int
    arena: torch.Tensor  # the pool's whole arena (shared by every block, not a copy)
    pins: int = 0
    freeing: bool = False
    fences_pending: bool = False
    _view: torch.Tensor | None = None

    @property
    def view(self) -> torch.Tensor:
        """The block's bytes as a uint8 tensor, made on first use.

        An offload needs only the offset (copies address the arena); slicing a tensor
        costs host time, which adds up over thousands of small features.
        """
        if self._view is None:
            self._view = self.arena[self.offset : self.offset + self.nbytes]
        return self._view

    def bytes(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """A uint8 view of bytes start..stop of the block."""
        if start == 0 and (stop is None or stop == self.nbytes):
            return self.view  # the whole block: no new view
        stop = self.nbytes if stop is None else stop
        return self.arena[self.offset + start : self.offset + stop]


class HostPool:
    """Allocates blocks from one arena; a freed block is reused only after its fences and pins."""

    #: Whether other processes hold blocks of this arena too (a node's shared host tier,
    #: mmcache.node_pool): then a feature's bytes may be there already (adopt), and a copy
    #: written is offered to the others (publish).
    shared = False

    def __init__(
        self,
        device: Device,
        arena: torch.Tensor,
        *,
        alignment: int,
        defer: Defer,
        on_free: Callable[[], None] = lambda: None,
        chunk_bytes: int | None = None,
        ready_bytes: int | None = None,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self._device = device
        self.arena = arena
        self.alignment = alignment
        self.capacity_bytes = arena.numel() // alignment * alignment
        self._chunk = chunk_bytes if chunk_bytes else self.capacity_bytes
        if self._chunk % alignment:
            raise ValueError("arena chunk size must be a multiple of the alignment")
        self._defer = defer
        self._on_free = on_free
        # Free ranges twice over: in arena order (offsets and sizes, parallel lists) to
        # coalesce neighbours, and as (size, offset) pairs in size order to find the best
        # fit by bisection. A fragmented arena has thousands of holes: scanning them all
        # on every eviction would cost the loop time in proportion to the holes.
        self._free_offsets: list[int] = []
        self._free_sizes: list[int] = []
        self._by_size: list[tuple[int, int]] = []
        #: the leading bytes of the arena that blocks may use (the rest is not pinned yet)
        self.ready_bytes = 0
        self.grow(self.capacity_bytes if ready_bytes is None else ready_bytes)
        self.used_bytes = 0
        self.freeing_bytes = 0
        self.blocks_live = 0
        # The top of the bytes ever handed out: a device that poisons host memory is told
        # of blocks reaching past it (fresh pages; its check that they are pinned).
        self._handed_out = 0

    @property
    def max_block_bytes(self) -> int:
        """The largest block this pool could ever hand out."""
        return min(self._chunk, self.capacity_bytes)

    @property
    def ready_block_bytes(self) -> int:
        """The largest block this pool could hand out now, from the part that is pinned."""
        return min(self._chunk, self.ready_bytes)

    @property
    def free_bytes(self) -> int:
        return self.ready_bytes - self.used_bytes

    def grow(self, ready_bytes: int) -> bool:
        """Let blocks use the arena's first ready_bytes (rounded down to the alignment).

        The arena is one contiguous range pinned front to back, so the new bytes join the
        free range before them: a block may span two pinned pieces, and a device that
        cannot copy across its pinning's pieces splits such a copy itself. Returns whether
        any bytes were added.
        """
        ready = min(ready_bytes, self.capacity_bytes) // self.alignment * self.alignment
        if ready <= self.ready_bytes:
            return False
        self._insert_free(self.ready_bytes, ready - self.ready_bytes)
        self.ready_bytes = ready
        return True

    def end_at_ready(self) -> None:
        """The rest of the arena will never be pinned: the pool ends where it is ready."""
        self.capacity_bytes = self.ready_bytes

    def rounded(self, nbytes: int) -> int:
        """The block size that nbytes occupies."""
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    def allocate(self, nbytes: int) -> HostBlock | None:
        """Best-fit allocate a block of at least nbytes, or None if no free range fits now.

        The smallest free range that fits wins, the lowest offset among equals.
        """
        size = self.rounded(nbytes)
        start = self._carve(size)
        if start is None:
            return None
        self.blocks_live += 1
        return HostBlock(start, size, self.arena)

    def allocate_run(self, sizes: Sequence[int]) -> list[HostBlock] | None:
        """Blocks for sizes, back to back in one best-fit range (and one arena chunk), or None.

        An offload batch then needs one search for all its features, and its blocks form
        one run that a single copy can fill.
        """
        if not sizes:
            return []
        a = self.alignment
        rounded = []  # a loop, not rounded() per size: an offload batch's hot path
        total = 0
        for nbytes in sizes:
            size = max(a, (nbytes + a - 1) // a * a)
            rounded.append(size)
            total += size
        # Within one chunk of the arena, so that no block of the run straddles an edge.
        if total > min(self._chunk, self.capacity_bytes):
            return None
        start = self._carve(total)
        if start is None:
            return None
        blocks = []
        arena = self.arena
        for size in rounded:
            blocks.append(HostBlock(start, size, arena))
            start += size
        self.blocks_live += len(blocks)
        return blocks

    def free(self, block: HostBlock, after: Sequence[Fence] = ()) -> None:
        """Give block back; it is reused once every fence in after is done and it is unpinned."""
        if block.freeing:
            raise RuntimeError("host block freed twice")
        block.freeing = True
        self.freeing_bytes += block.nbytes
        pending = [f for f in after if not f.done()]
        if pending:
            block.fences_pending = True
            self._defer(pending, lambda: self._fences_done(block))
        else:
            self._maybe_reclaim(block)

    def pin(self, block: HostBlock) -> None:
        """Keep block from being reclaimed while a reader uses it."""
        block.pins += 1

    def unpin(self, block: HostBlock) -> None:
        block.pins -= 1
        self._maybe_reclaim(block)

    def adopt(
        self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int
    ) -> HostBlock | None:
        """A block that already holds key's feature, written by another process; this pool's
        arena is its own alone, so None."""
        return None

    def publish(
        self, block: HostBlock, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype
    ) -> HostBlock | None:
        """block now holds key's feature, written: offer it to the other processes, or get
        the block they wrote it into first (then free block). Alone: None."""
        return None

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range in arena order (tests, fragmentation stats)."""
        return list(zip(self._free_offsets, self._free_sizes, strict=True))

    # --- internals ------------------------------------------------------------------

    def _carve(self, size: int) -> int | None:
        """Take size bytes from the smallest free range that fits; their offset, or None."""
        by_size = self._by_size
        chunk = self._chunk
        j = bisect.bisect_left(by_size, (size, -1))
        while j < len(by_size):
            free, off = by_size[j]
            if off // chunk == (off + size - 1) // chunk:
                start: int | None = off  # within one chunk: fits at its front (common)
            else:
                start = self._fit(off, free, size)
            if start is not None:
                break
            j += 1  # only a chunked arena gets here: the range straddles a chunk edge
        else:
            return None
        del by_size[j]
        i = bisect.bisect_left(self._free_offsets, off)
        end = start + size
        if start == off and end < off + free:
            # Carved from the front: the range shrinks in place (the common case).
            self._free_offsets[i] = end
            self._free_sizes[i] = off + free - end
            bisect.insort(by_size, (off + free - end, end))
        else:
            del self._free_offsets[i], self._free_sizes[i]
            if start > off:
                self._add_range(i, off, start - off)
                i += 1
            if end < off + free:
                self._add_range(i, end, off + free - end)
        self.used_bytes += size
        stop = start + size
        if self._device.poisons_host and stop > self._handed_out:
            # Below the top, blocks were handed out before and are poisoned when
            # reclaimed (first fit carves upward; a gap left at a chunk's end is the one
            # range below it that stays unpoisoned until used). Fresh pages are told a
            # step ahead, within what is pinned: small blocks cost a call a step, not each.
            top = min(max(stop, self._handed_out + POISON_AHEAD_BYTES), self.ready_bytes)
            self._device.poison_host(self.arena, start, top, unused=True)
            self._handed_out = top
        return start

    def _fit(self, off: int, free: int, size: int) -> int | None:
        """Where a block of size fits in [off, off+free) without straddling a chunk."""
        start = off
        if start // self._chunk != (start + size - 1) // self._chunk:
            start = (start // self._chunk + 1) * self._chunk
        return start if start + size <= off + free else None

    def _fences_done(self, block: HostBlock) -> None:
        block.fences_pending = False
        self._maybe_reclaim(block)

    def _maybe_reclaim(self, block: HostBlock) -> None:
        if not block.freeing or block.pins or block.fences_pending:
            return
        block.freeing = False
        if self._device.poisons_host:  # an early reader shows poison, never old data
            self._device.poison_host(block.view)
        self.freeing_bytes -= block.nbytes
        self.used_bytes -= block.nbytes
        self.blocks_live -= 1
        self._insert_free(block.offset, block.nbytes)
        self._on_free()

    def _insert_free(self, off: int, size: int) -> None:
        """Insert a free range, coalescing with its neighbours."""
        offsets, sizes = self._free_offsets, self._free_sizes
        i = bisect.bisect_left(offsets, off)
        if i > 0 and offsets[i - 1] + sizes[i - 1] == off:
            i -= 1
            off = offsets[i]
            size += sizes[i]
            self._remove_range(i)
        if i < len(offsets) and off + size == offsets[i]:
            size += sizes[i]
            self._remove_range(i)
        self._add_range(i, off, size)

    def _add_range(self, i: int, off: int, size: int) -> None:
        """Record free range [off, off+size) at index i of the arena-order lists."""
        self._free_offsets.insert(i, off)
        self._free_sizes.insert(i, size)
        bisect.insort(self._by_size, (size, off))

    def _remove_range(self, i: int) -> None:
        """Forget the free range at index i of the arena-order lists."""
        off = self._free_offsets.pop(i)
        size = self._free_sizes.pop(i)
        j = bisect.bisect_left(self._by_size, (size, off))
        del self._by_size[j]
