"""Host copies: one memcpy for small host reads, a slice per loop turn for large ones."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact

import mmcache.host_copy as host_copy
from mmcache import FeatureCache
from mmcache.host_copy import SLICE_BYTES, copy_host_bytes, copy_host_bytes_in_slices

MiB = 1 << 20


class Memmoves:
    """Stands in for the memcpy: records each call's span and the loop turns seen so far,
    and runs a hook after a chosen call."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int]] = []  # (dst, src, size, turns so far)
        self.turns = 0  # advanced by a ticker task while the loop runs other work
        self.after_call: dict[int, Callable[[], object]] = {}
        self.real: Callable[[int, int, int], object] = host_copy._memmove

    def __call__(self, dst: int, src: int, size: int) -> object:
        self.calls.append((dst, src, size, self.turns))
        done = self.real(dst, src, size)
        hook = self.after_call.get(len(self.calls))
        if hook is not None:
            hook()
        return done


@pytest.fixture
def memmoves(monkeypatch: pytest.MonkeyPatch) -> Iterator[Memmoves]:
    fake = Memmoves()
    monkeypatch.setattr(host_copy, "_memmove", fake)
    yield fake


async def ticking(memmoves: Memmoves, stop: asyncio.Event) -> None:
    """Another task of the loop: counts its turns."""
    while not stop.is_set():
        memmoves.turns += 1
        await asyncio.sleep(0)


def random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


# --- copy_host_bytes --------------------------------------------------------------------


def test_copy_host_bytes_copies_views_exactly() -> None:
    arena = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    src = arena[1024:3072].view(torch.int32)  # a view at an offset, as a block's rows are
    dst = torch.full((512,), -1, dtype=torch.int32)
    copy_host_bytes(dst, src)
    assert torch.equal(dst, torch.arange(256, 768, dtype=torch.int32))
    copy_host_bytes(torch.empty(0), torch.empty(0))  # nothing to copy is no error


BAD_PAIRS = [
    (torch.zeros(8), torch.ones(9), "36 bytes into a 32-byte"),
    (torch.zeros(4, 4), torch.ones(4, 4).t(), "source must be a contiguous host"),
    (torch.empty(8, device="meta"), torch.ones(8), "destination must be a contiguous host"),
]


@pytest.mark.parametrize(("dst", "src", "match"), BAD_PAIRS)
def test_copy_host_bytes_refuses_what_one_memcpy_cannot_copy(
    dst: torch.Tensor, src: torch.Tensor, match: str
) -> None:
    before = dst.clone() if dst.device.type == "cpu" else None
    with pytest.raises(ValueError, match=match):
        copy_host_bytes(dst, src)
    if before is not None:
        assert torch.equal(dst, before)  # refused before a byte moved


# --- copy_host_bytes_in_slices ------------------------------------------------------------


async def test_a_sliced_copy_is_exact_and_lets_the_loop_run_between_slices(
    memmoves: Memmoves,
) -> None:
    src = random_bytes(3 * MiB + 12345, seed=1)  # not a whole number of slices
    dst = torch.zeros_like(src)
    stop = asyncio.Event()
    ticker = asyncio.create_task(ticking(memmoves, stop))
    await asyncio.sleep(0)
    await copy_host_bytes_in_slices(dst, src, slice_bytes=MiB)
    stop.set()
    await ticker
    assert torch.equal(dst, src)
    offsets = [(d - dst.data_ptr(), s - src.data_ptr(), n) for d, s, n, _ in memmoves.calls]
    assert offsets == [(i * MiB, i * MiB, MiB) for i in range(3)] + [(3 * MiB, 3 * MiB, 12345)]
    turns = [t for *_, t in memmoves.calls]
    assert all(b > a for a, b in itertools.pairwise(turns))  # a turn between slices


async def test_a_cancelled_sliced_copy_stops_between_slices(memmoves: Memmoves) -> None:
    src = random_bytes(4 * MiB, seed=2)
    dst = torch.zeros_like(src)
    copying = asyncio.create_task(copy_host_bytes_in_slices(dst, src, slice_bytes=MiB))
    memmoves.after_call[2] = copying.cancel
    with pytest.raises(asyncio.CancelledError):
        await copying
    assert len(memmoves.calls) == 2
    assert torch.equal(dst[: 2 * MiB], src[: 2 * MiB]) and not dst[2 * MiB :].any()


@pytest.mark.parametrize(("dst", "src", "match"), BAD_PAIRS)
async def test_a_sliced_copy_refuses_bad_pairs_before_a_byte_moves(
    memmoves: Memmoves, dst: torch.Tensor, src: torch.Tensor, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        await copy_host_bytes_in_slices(dst, src, slice_bytes=4)
    assert memmoves.calls == []


async def test_a_slice_must_hold_a_byte() -> None:
    with pytest.raises(ValueError, match="slice_bytes must be > 0"):
        await copy_host_bytes_in_slices(torch.zeros(4), torch.ones(4), slice_bytes=0)


# --- host reads through the cache -------------------------------------------------------


async def put_on_host(cache: FeatureCache, rig: Rig, key: str) -> torch.Tensor:
    """Put a 4 MiB feature into a cache without a GPU tier; return a copy to compare with."""
    t = rig.tensor(1024, 1024, dtype=torch.float32, seed=7)
    expected = t.cpu().clone()
    assert await cache.put(key, t)
    del t
    await cache.drain()
    assert cache.stats().cpu_entries == 1
    return expected


@pytest.mark.parametrize("rows", [None, slice(0, 700), slice(5, 9)])
async def test_a_large_host_read_goes_a_slice_per_loop_turn_and_is_exact(
    rig: Rig, make_cache: CacheFactory, memmoves: Memmoves, rows: slice | None
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    expected = await put_on_host(cache, rig, "k")
    memmoves.calls.clear()
    stop = asyncio.Event()
    ticker = asyncio.create_task(ticking(memmoves, stop))
    await asyncio.sleep(0)
    out = await cache.get("k", device="cpu", rows=rows)
    stop.set()
    await ticker
    assert_exact(out, expected if rows is None else expected[rows])
    assert out is not None and out.is_pinned() == (rig.kind == "cuda")
    slices = -(-out.nbytes // SLICE_BYTES)
    assert [n for _, _, n, _ in memmoves.calls][:-1] == [SLICE_BYTES] * (slices - 1)
    turns = [t for *_, t in memmoves.calls]
    assert all(b > a for a, b in itertools.pairwise(turns))


async def test_a_read_cancelled_between_slices_gives_its_block_back(
    rig: Rig, make_cache: CacheFactory, memmoves: Memmoves
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    await put_on_host(cache, rig, "k")
    memmoves.calls.clear()
    reader = asyncio.create_task(cache.get("k", device="cpu"))
    memmoves.after_call[1] = reader.cancel
    with pytest.raises(asyncio.CancelledError):
        await reader
    assert len(memmoves.calls) == 1  # nothing reads the block after the cancel
    assert cache.discard("k")
    await cache.drain()
    s = cache.stats()
    assert s.cpu_bytes == 0 and s.leaked_bytes == 0


async def test_a_read_in_flight_at_close_finishes(
    rig: Rig, make_cache: CacheFactory, memmoves: Memmoves
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=8)
    expected = await put_on_host(cache, rig, "k")
    reader = asyncio.create_task(cache.get("k", device="cpu"))
    closing: list[asyncio.Task[None]] = []
    memmoves.after_call[len(memmoves.calls) + 1] = lambda: closing.append(
        asyncio.create_task(cache.close(timeout=5))
    )
    assert_exact(await reader, expected)
    await closing[0]
