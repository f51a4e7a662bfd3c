"""A GPU hit marks its block used on the reader's stream (CUDA's record_stream) once per
stream: the allocator records its event on every marked stream when the block is freed,
so a second mark on the same stream adds nothing but cost."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from conftest import CacheFactory, KiB, Rig, put_feature, reader_stream, stall

from mmcache import FeatureCache
from mmcache.device import Stream

pytestmark = pytest.mark.usefixtures("no_collection_during_reports")

FEATURE_KIB = 64


async def two_resident(rig: Rig, make_cache: CacheFactory) -> FeatureCache:
    """A cache with features 0 and 1 on its GPU tier."""
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    for key in range(2):
        await put_feature(cache, rig, key, FEATURE_KIB, seed=key)
    return cache


def count_marks(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each (block address, stream) the cache marks as used from now on."""
    marks: list[tuple[int, int]] = []
    device = rig.device
    use_on = device.use_on  # the device's own: a base use_all_on calls use_on

    def counted(tensor: torch.Tensor, stream: Stream) -> None:
        marks.append((tensor.untyped_storage().data_ptr(), id(stream)))
        use_on(tensor, stream)

    def counted_all(tensors: Iterable[torch.Tensor], stream: Stream) -> None:
        for tensor in tensors:
            marks.append((tensor.untyped_storage().data_ptr(), id(stream)))
            use_on(tensor, stream)

    monkeypatch.setattr(device, "use_on", counted)
    monkeypatch.setattr(device, "use_all_on", counted_all)
    return marks


async def test_gpu_hits_on_one_stream_mark_a_block_once(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = await two_resident(rig, make_cache)
    reader = reader_stream(rig)
    marks = count_marks(rig, monkeypatch)
    mine = rig.device.current_stream()
    blocks = []
    for key in range(2):
        got = await cache.get(key)
        assert got is not None
        blocks.append(got.untyped_storage().data_ptr())
    del got
    for _ in range(3):
        assert await cache.get(0) is not None
        assert all(t is not None for t in await cache.get_many([0, 1]))
        # The concurrent gets of one turn are one batch, and mark as get_many does.
        assert all(t is not None for t in await asyncio.gather(cache.get(0), cache.get(1)))
    assert sorted(marks) == sorted((block, id(mine)) for block in blocks)
    # Another stream: each block marked once on it too.
    del marks[:]
    for _ in range(3):
        assert await cache.get(1, stream=reader) is not None
        assert all(t is not None for t in await cache.get_many([0, 1], stream=reader))
    assert sorted(marks) == sorted((block, id(reader)) for block in blocks)
    # The mark remembers the last stream only: back on the first, marked again, once.
    del marks[:]
    for _ in range(3):
        assert all(t is not None for t in await cache.get_many([0, 1]))
    assert sorted(marks) == sorted((block, id(mine)) for block in blocks)


async def test_a_mark_that_could_not_be_made_is_made_by_the_next_read(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = await two_resident(rig, make_cache)
    device = rig.device

    def refuse(tensors: Iterable[torch.Tensor], stream: Stream) -> None:
        raise RuntimeError("record_stream refused")

    with monkeypatch.context() as refusing:
        refusing.setattr(device, "use_on", refuse)
        refusing.setattr(device, "use_all_on", refuse)
        with pytest.raises(RuntimeError, match="refused"):
            await cache.get_many([0, 1])
        with pytest.raises(RuntimeError, match="refused"):
            await cache.get(0)
    marks = count_marks(rig, monkeypatch)
    assert all(t is not None for t in await cache.get_many([0, 1]))
    assert len(marks) == 2, "the blocks not marked then are marked now"


async def test_a_block_promoted_again_is_marked_again(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A GPU tier of one feature: a put pushes the resident one to the host tier.
    cache = make_cache(gpu_mb=FEATURE_KIB / KiB, cpu_mb=1, promote_on_hit=True)
    await put_feature(cache, rig, "hot", FEATURE_KIB, seed=1)
    marks = count_marks(rig, monkeypatch)
    blocks: set[int] = set()
    for round_ in range(3):
        await put_feature(cache, rig, round_, FEATURE_KIB, seed=2)  # "hot" to the host tier
        await cache.drain()
        assert cache.discard(round_)  # room again: the next host hit is promoted into it
        for _ in range(3):
            got = await cache.get("hot")
            assert got is not None
            blocks.add(got.untyped_storage().data_ptr())
            del got
        assert _tier(cache, "hot") == "gpu"
    assert cache.stats().hits_cpu == 3 and cache.stats().hits_gpu == 6
    # Each promotion's upload marks its new block, and its first GPU hit marks it again
    # (a new block starts unmarked); its second GPU hit does not.
    assert len(marks) == 6 and {block for block, _ in marks} == blocks


def _tier(cache: Any, key: object) -> str:
    return str(cache._core.state.index[key].state.value)


async def test_a_block_read_again_unmarked_stays_until_the_readers_work_is_done(
    rig: Rig, make_cache: CacheFactory
) -> None:
    if rig.kind == "sim":
        pytest.skip("the CUDA caching allocator's reuse of a freed block")
    cache = make_cache(gpu_mb=64, cpu_mb=64)
    feature_kib = 16 * KiB
    want = await put_feature(cache, rig, "k", feature_kib, seed=3)
    reader = reader_stream(rig)
    first = await cache.get("k", stream=reader)  # marks the block used on reader
    assert first is not None
    del first
    stall(reader, 0.3)
    again = await cache.get("k", stream=reader)  # not marked again
    assert again is not None
    with torch.cuda.stream(reader):
        seen = again.clone()  # runs after the stall
    assert cache.discard("k")
    await cache.drain()
    del again  # the last holder: the block is freed while the reader's clone is queued
    grabbed = [torch.full((feature_kib * KiB,), 0xFF, dtype=torch.uint8, device=rig.device.name)]
    grabbed += [torch.full_like(grabbed[0], 0xFF) for _ in range(3)]
    reader.synchronize()
    assert torch.equal(seen.cpu(), want)
