"""HostPool placement: best fit by size index, runs of blocks, coalescing, chunk edges."""

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
SIZES = (1, 511, 512, 4096, 9000, 33_000, 64 * 1024)


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
    assert pool.blocks_live == len(live)


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
            # One block, or a run of blocks for an offload batch (one search for all).
            sizes = [SIZES[rng.randrange(len(SIZES))] for _ in range(rng.choice([1, 1, 3, 8]))]
            rounded = [pool.rounded(n) for n in sizes]
            total = sum(rounded)
            limit = chunk or pool.capacity_bytes
            expected = _reference_fit(pool.free_ranges(), total, limit) if total <= limit else None
            single = len(sizes) == 1 and rng.random() < 0.5
            blocks = [pool.allocate(sizes[0])] if single else pool.allocate_run(sizes)
            if expected is None:
                assert blocks is None or blocks == [None]
            else:
                assert blocks is not None
                offset = expected
                for block, size in zip(blocks, rounded, strict=True):
                    assert block is not None and (block.offset, block.nbytes) == (offset, size)
                    offset += size
                    live.append(block)
                if chunk:  # the whole run in one chunk of the arena
                    assert expected // chunk == (offset - 1) // chunk
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


def test_a_run_needs_one_range_for_all_its_blocks() -> None:
    pool = _pool(64 * 1024)
    blocks = [pool.allocate(4096) for _ in range(16)]
    for block in blocks[::2]:
        assert block is not None
        pool.free(block)
    free = pool.free_ranges()
    assert pool.allocate_run([4096, 4096]) is None  # 32 KiB free, but no two holes adjoin
    assert pool.free_ranges() == free and pool.used_bytes == 8 * 4096  # nothing taken
    assert pool.allocate_run([]) == []
    assert blocks[1] is not None
    pool.free(blocks[1])  # joins holes 0..2: 12 KiB
    run = pool.allocate_run([100, 4096, 5000])
    assert run is not None
    assert [(b.offset, b.nbytes) for b in run] == [(0, 512), (512, 4096), (4608, 5120)]
    assert pool.blocks_live == 7 + 3


def test_a_pool_grows_as_its_arena_pins() -> None:
    """Only the pinned front of the arena is handed out; what pins next joins the free range
    before it, so a block may span the edge between two pinned pieces."""

    def run_now(_fences: Sequence[Fence], callback: Callable[[], None]) -> None:
        callback()

    arena = torch.empty(8 * 4096, dtype=torch.uint8)
    pool = HostPool(SimDevice(), arena, alignment=ALIGN, defer=run_now, ready_bytes=4096 + 100)
    assert (pool.capacity_bytes, pool.ready_bytes, pool.free_bytes) == (8 * 4096, 4096, 4096)
    assert pool.max_block_bytes == 8 * 4096 and pool.ready_block_bytes == 4096
    first = pool.allocate(7 * ALIGN)
    assert first is not None and first.offset == 0
    assert pool.allocate(2 * ALIGN) is None  # 1 block's room is left in the pinned part
    assert pool.allocate_run([ALIGN, ALIGN]) is None
    assert not pool.grow(4096)  # nothing new
    assert pool.grow(3 * 4096)
    assert pool.free_ranges() == [(7 * ALIGN, 3 * 4096 - 7 * ALIGN)]  # coalesced
    across = pool.allocate(4096)  # over the old edge at 4096
    assert across is not None and across.offset == 7 * ALIGN
    assert pool.grow(10 * 4096) and pool.ready_bytes == pool.capacity_bytes
    pool.free(first)
    pool.free(across)
    assert pool.free_ranges() == [(0, 8 * 4096)] and pool.used_bytes == 0


def test_a_pool_whose_pinning_failed_ends_where_it_is_ready() -> None:
    pool = HostPool(
        SimDevice(),
        torch.empty(8 * 4096, dtype=torch.uint8),
        alignment=ALIGN,
        defer=lambda fences, callback: callback(),
        ready_bytes=2 * 4096,
    )
    pool.end_at_ready()
    assert (pool.capacity_bytes, pool.max_block_bytes, pool.free_bytes) == (2 * 4096,) * 3
