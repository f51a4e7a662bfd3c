"""NodeHostPool: a HostPool whose blocks come from the node's shared arena (host_share="node").

The arena is mapped by every rank of the node, and its blocks are the NodeDirectory's:
this pool carves them there, and keeps this rank's own count of the blocks it holds (the
audit's). A block this rank frees goes back to the node only when no rank holds it.

The directory keeps one bit per rank and block, yet a rank may hold one block twice (an
entry adopts the node's copy while the rank's earlier block of that feature still waits
for its free): the pool counts its references per offset, and the directory hears of the
rank's release only when the last one goes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Sequence
from typing import final

import torch

from mmcache.device.base import Device
from mmcache.host_pool import Defer, HostBlock, HostPool
from mmcache.node_directory import NodeDirectory
from mmcache.remote.codec import encode_key

__all__ = ["NodeHostPool", "feature_digest"]


def feature_digest(key: Hashable, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """A feature's name on the node: a 128-bit BLAKE2b digest of its key (the remote tier's
    stable encoding), dtype and shape, as two int64. The ranks of a TP group compute the
    same feature under the same key, so one copy serves them all."""
    digest = hashlib.blake2b(
        encode_key(key) + f"|{dtype}|{shape}".encode(), digest_size=16
    ).digest()
    return (
        int.from_bytes(digest[:8], "little", signed=True),
        int.from_bytes(digest[8:], "little", signed=True),
    )


@final
class NodeHostPool(HostPool):
    """This rank's view of the node's shared arena: blocks carved in the NodeDirectory."""

    shared = True

    def __init__(
        self,
        device: Device,
        arena: torch.Tensor,
        directory: NodeDirectory,
        *,
        alignment: int,
        defer: Defer,
        on_free: Callable[[], None] = lambda: None,
    ) -> None:
        self._directory = directory
        self._refs: dict[int, int] = {}  # this rank's references by block offset
        super().__init__(device, arena, alignment=alignment, defer=defer, on_free=on_free)

    def grow(self, ready_bytes: int) -> bool:
        """The node's arena is usable whole once mapped (and pinned): nothing to add."""
        ready = min(ready_bytes, self.capacity_bytes) // self.alignment * self.alignment
        if ready <= self.ready_bytes:
            return False
        self.ready_bytes = ready
        return True

    def allocate_run(self, sizes: Sequence[int]) -> list[HostBlock] | None:
        """Blocks for sizes, back to back in one free range of the node's arena, or None."""
        if not sizes:
            return []
        rounded = [self.rounded(nbytes) for nbytes in sizes]
        start = self._carve_run(rounded)
        if start is None:
            return None
        blocks = []
        for size in rounded:
            blocks.append(HostBlock(start, size, self.arena))
            self._refs[start] = 1
            start += size
        self.blocks_live += len(blocks)
        return blocks

    def adopt(
        self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int
    ) -> HostBlock | None:
        """The node's written copy of key's feature, now held by this rank too; None if the
        node has none."""
        size = self.rounded(nbytes)
        offset = self._directory.adopt(feature_digest(key, shape, dtype), size)
        return None if offset is None else self._held(offset, size)

    def publish(
        self, block: HostBlock, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype
    ) -> HostBlock | None:
        """Share block, which holds key's feature now; or, where another rank wrote it first,
        that rank's block, now held by this one too (free block then)."""
        offset = self._directory.publish(block.offset, feature_digest(key, shape, dtype))
        return None if offset is None else self._held(offset, block.nbytes)

    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of every free range of the node's arena, in arena order."""
        ranges = []
        at = 0
        for offset, nbytes, _, _, _ in self._directory.records():
            if offset > at:
                ranges.append((at, offset - at))
            at = offset + nbytes
        if at < self.capacity_bytes:
            ranges.append((at, self.capacity_bytes - at))
        return ranges

    # --- internals ------------------------------------------------------------------

    def _held(self, offset: int, size: int) -> HostBlock:
        self._refs[offset] = self._refs.get(offset, 0) + 1
        self.used_bytes += size
        self.blocks_live += 1
        return HostBlock(offset, size, self.arena)

    def _carve(self, size: int) -> int | None:
        start = self._carve_run([size])
        if start is not None:
            self._refs[start] = 1
        return start

    def _carve_run(self, sizes: list[int]) -> int | None:
        """A run of sizes carved in the node's arena (after a sweep of dead ranks' blocks
        where it is full); its offset, or None."""
        total = sum(sizes)
        if total > self.ready_bytes:
            return None
        start = self._directory.carve(sizes)
        if start is None and self._directory.sweep():
            start = self._directory.carve(sizes)
        if start is None:
            return None
        self.used_bytes += total
        if self._device.poisons_host:  # fresh bytes read as poison until written
            self._device.poison_host(self.arena, start, start + total)
        return start

    def _maybe_reclaim(self, block: HostBlock) -> None:
        if not block.freeing or block.pins or block.fences_pending:
            return
        block.freeing = False
        refs = self._refs.pop(block.offset) - 1
        if refs:  # another block of this rank holds these bytes still
            self._refs[block.offset] = refs
        else:
            poison = self._poison if self._device.poisons_host else None
            self._directory.release(block.offset, poison)
        self.freeing_bytes -= block.nbytes
        self.used_bytes -= block.nbytes
        self.blocks_live -= 1
        self._on_free()

    def _poison(self, offset: int, nbytes: int) -> None:
        """The last holder let go of these bytes: an early reader shows poison (under the
        directory's lock, before another rank can take them)."""
        self._device.poison_host(self.arena, offset, offset + nbytes)

    def _insert_free(self, off: int, size: int) -> None:
        raise AssertionError("mmcache internal error: the node's free ranges are its directory's")
