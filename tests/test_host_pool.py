"""HostPool placement: best fit by size index, coalescing, chunk edges, fragmented arenas."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

import pytest
import torch

from mmcache.device.base import Fence
from mmcache.device.sim import SimDevice
from mmcache.host_pool import HostBlock, HostPool

ALIGN = 512


def _pool(capacity: int, chunk: int | None = None) -> HostPool:
    def run_now(_fences: Sequence[Fence], callback: Callable[[], None]) -> None:
        callback()

    arena = torch.empty(capacity, dtype=torch.uint8)
    return HostPool(SimDevice(), arena, alignment=ALIGN, defer=run_now, chunk_bytes=chunk)


def _reference_fit(ranges: list[tuple[int, int]], size: int, chunk: int) -> int | None:
    """Where a plain best-fit scan of the free ranges (arena order) places size bytes."""
    best: tuple[int, int] | None = None  # (range size, start)
    for off, free in ranges:
        start = off
        if start // chunk != (start + size - 1) // chunk:
            start = (start // chunk + 1) * chunk
        if start + size > off + free:
            continue
        if best is None or free < best[0]:
            best = (free, start)
    return None if best is None else best[1]


def _check_ranges(pool: HostPool, live: list[HostBlock]) -> None:
    ranges = pool.free_ranges()
    # The size index must hold exactly the free ranges: a stale pair fails here, at once.
    assert pool._by_size == sorted((size, off) for off, size in ranges)
    for (a_off, a_size), (b_off, _) in itertools.pairwise(ranges):
        assert a_off + a_size < b_off, "free ranges overlap or were left uncoalesced"
    spans = sorted([(b.offset, b.nbytes) for b in live] + ranges)
    position = 0
    for off, size in spans:
        assert off == position, "blocks and free ranges must tile the arena exactly"
        position += size
    assert position == pool.capacity_bytes
    assert pool.used_bytes == sum(b.nbytes for b in live)


@pytest.mark.parametrize("chunk_kib", [None, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_placement_matches_a_plain_best_fit_scan(seed: int, chunk_kib: int | None) -> None:
    rng = random.Random(seed)
    capacity = 1 << 20
    chunk = chunk_kib * 1024 if chunk_kib else None
    pool = _pool(capacity, chunk)
    live: list[HostBlock] = []
    for _ in range(3000):
        if live and (rng.random() < 0.45 or pool.free_bytes < 64 * 1024):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            nbytes = rng.choice([1, 511, 512, 4096, 9000, 33_000, 64 * 1024])
            expected = _reference_fit(
                pool.free_ranges(), pool.rounded(nbytes), chunk or pool.capacity_bytes
            )
            block = pool.allocate(nbytes)
            if expected is None:
                assert block is None
            else:
                assert block is not None and block.offset == expected
                if chunk:
                    assert block.offset // chunk == (block.offset + block.nbytes - 1) // chunk
                live.append(block)
        _check_ranges(pool, live)
    for block in live:
        pool.free(block)
    assert pool.free_ranges() == [(0, pool.capacity_bytes)]


def test_a_fragmented_arena_refuses_and_serves_by_size() -> None:
    pool = _pool(16 << 20)
    blocks = [pool.allocate(4096) for _ in range(4096)]
    assert all(b is not None for b in blocks)
    for block in blocks[::2]:
        assert block is not None
        pool.free(block)
    assert len(pool.free_ranges()) == 2048  # 4 KiB holes only
    assert pool.allocate(8192) is None  # no hole fits, and nothing changed
    assert len(pool.free_ranges()) == 2048
    small = pool.allocate(100)
    assert small is not None and small.offset == 0  # lowest offset among equal holes
    assert blocks[1] is not None
    pool.free(blocks[1])  # joins the holes on both sides: 512 B .. 12 KiB
    fit = pool.allocate(8192)
    assert fit is not None and fit.offset == 512
