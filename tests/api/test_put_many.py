"""put_many: several features in one call, all or none, with their offloads batched."""

from __future__ import annotations

import gc
import types
from typing import Any

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, feature, needs_hold
from test_groups import offload_copies

from mmcache import InvalidKeyError, InvalidValueError, ValueTooLargeError


def features(rig: Rig, n: int, kib: int, seed: int = 0) -> list[torch.Tensor]:
    return [feature(rig, kib, seed + i) for i in range(n)]


@pytest.mark.parametrize("gpu_mb", [1, 0], ids=["gpu-tier", "host-only"])
async def test_every_feature_of_a_batch_reads_back_exactly(
    rig: Rig, make_cache: CacheFactory, gpu_mb: float
) -> None:
    cache = make_cache(gpu_mb=gpu_mb, cpu_mb=4)
    values = features(rig, 24, 16)  # 384 KiB: fits either tier
    want = [v.cpu().clone() for v in values]
    assert await cache.put_many((("img", i), v) for i, v in enumerate(values))
    del values
    await cache.drain()
    for i, expected in enumerate(want):
        assert_exact(await cache.get(("img", i)), expected)
        assert_exact(await cache.get(("img", i), device="cpu"), expected)
    await cache.drain()  # host-only reads to the device upload: let those land too
    s = cache.stats()
    assert s.leaked_bytes == 0 and s.pending_copies == 0


async def test_a_batch_that_forces_eviction_offloads_small_features_in_few_copies(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """64 features of 4 KiB evicted by the next batch: a few batched copies, not 64."""
    cache = make_cache(gpu_mb=0.25, cpu_mb=4)
    first = features(rig, 64, 4)
    want = [v.cpu().clone() for v in first]
    assert await cache.put_many((("a", i), v) for i, v in enumerate(first))
    del first
    await cache.drain()
    before = offload_copies(cache)
    assert await cache.put_many((("b", i), v) for i, v in enumerate(features(rig, 64, 4, 99)))
    await cache.drain()
    s = cache.stats()
    assert s.evictions_gpu == 64 and s.dropped == 0 and s.cpu_entries == 64  # all offloaded
    copies = offload_copies(cache) - before
    assert 1 <= copies <= 64 // 8, copies
    for i, expected in enumerate(want):
        assert_exact(await cache.get(("a", i), device="cpu"), expected)


async def test_replacing_keys_in_a_batch_keeps_only_the_new_values(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    assert await cache.put_many([("x", feature(rig, 8, 1)), ("y", feature(rig, 8, 2))])
    new = feature(rig, 8, 3)
    assert await cache.put_many([("x", new), ("z", feature(rig, 8, 4))])
    assert_exact(await cache.get("x"), new)
    assert len(cache) == 3
    # Each batch is one packed group: the replaced x keeps its rows of the first group
    # charged until the group's last member, y, goes too.
    assert cache.stats().gpu_bytes == 4 * 8 * 1024
    assert cache.discard("y")
    await cache.drain()
    assert cache.stats().gpu_bytes == 2 * 8 * 1024
    assert cache.stats().gpu_entries == 2 and cache.stats().leaked_bytes == 0


@pytest.mark.parametrize(
    ("items", "error"),
    [
        ([("k", "not a tensor")], InvalidValueError),
        (["not a pair"], InvalidValueError),
        ([(["unhashable"], None)], InvalidKeyError),
        ([("same", None), ("same", None)], InvalidKeyError),
    ],
    ids=["value", "pair", "key", "duplicate"],
)
async def test_bad_batches_are_refused_whole(
    rig: Rig, make_cache: CacheFactory, items: list[Any], error: type[Exception]
) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=4)
    good = feature(rig, 8)
    assert await cache.put("kept", good)
    batch = [
        (item[0], feature(rig, 8) if item[1] is None else item[1])
        if isinstance(item, tuple)
        else item
        for item in items
    ]
    with pytest.raises(error):
        await cache.put_many([("first", feature(rig, 8)), *batch])
    assert "first" not in cache and len(cache) == 1  # nothing of the batch was taken
    assert_exact(await cache.get("kept"), good)


async def test_a_batch_larger_than_the_gpu_tier_is_refused_and_loses_nothing(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=4)
    assert await cache.put("kept", feature(rig, 64))
    values = features(rig, 5, 64)  # 320 KiB > 256 KiB
    want = [v.cpu().clone() for v in values]
    with pytest.raises(ValueTooLargeError, match="smaller groups"):
        await cache.put_many(enumerate(values))
    for v, w in zip(values, want, strict=True):  # the caller's tensors are untouched
        assert_exact(v, w)
    assert len(cache) == 1 and cache.stats().leaked_bytes == 0


async def test_no_room_without_waiting_drops_the_whole_batch(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    sim_rig = rig
    cache = make_cache(gpu_mb=0.25, cpu_mb=0.25)
    with sim_rig.hold():
        assert await cache.put("big", feature(sim_rig, 192))
        # Room for this batch needs big's offload, held back: refused without waiting.
        ok = await cache.put_many([(i, feature(sim_rig, 32)) for i in range(3)], wait=False)
    assert ok is False
    assert all(i not in cache for i in range(3))
    await cache.drain()
    s = cache.stats()
    assert s.rejected == 3 and s.leaked_bytes == 0


async def test_an_empty_batch_is_a_no_op(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    assert await cache.put_many([])
    assert len(cache) == 0


@pytest.mark.parametrize("group", [1, 4], ids=["put", "put_many"])
async def test_offloads_leave_no_cyclic_garbage(
    rig: Rig, make_cache: CacheFactory, group: int
) -> None:
    """Per-operation objects die by reference counting: garbage that only the cyclic
    collector frees makes its pauses (tens of ms in a large process) more frequent."""
    needs_hold(rig)  # the simulator: torch's CUDA objects are not what is measured here
    sim_rig = rig
    # put_many: groups of four, evicted from both tiers, some members discarded first.
    cache = make_cache(gpu_mb=0.25, cpu_mb=8 if group == 1 else 1)
    for i in range(32):  # warm up: the host arena, the tiers, lazily made objects
        assert await cache.put(("warm", i), feature(sim_rig, 16, i))
    await cache.drain()
    gc.collect()
    gc.disable()
    try:
        for i in range(0, 200, group):  # about 190 offloads (GPU tier: 16 features)
            items = [(k, feature(sim_rig, 16, k)) for k in range(i, i + group)]
            assert await (cache.put(*items[0]) if group == 1 else cache.put_many(items))
            del items
            if group > 1 and i % 8 == 0:
                cache.discard(i)
        await cache.drain()
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what the collector finds, to look at it
        gc.collect()
        # Only the cache's own objects: other threads (earlier tests' fence waiters, say)
        # may leave garbage of their own meanwhile.
        ours = [obj for obj in gc.garbage if _made_by_mmcache(obj)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cache.stats().evictions_gpu >= 180
    # A cycle per offload (a closure naming itself, say) left about 190 here.
    assert len(ours) < 10, f"{len(ours)} mmcache objects in reference cycles: {ours[:5]}"


def _made_by_mmcache(obj: object) -> bool:
    """True for instances of mmcache classes and for mmcache functions, methods, frames."""
    if isinstance(obj, types.MethodType):
        obj = obj.__func__
    if isinstance(obj, types.FunctionType):
        return obj.__module__.startswith("mmcache")
    if isinstance(obj, types.CoroutineType | types.FrameType):
        code = obj.cr_code if isinstance(obj, types.CoroutineType) else obj.f_code
        return "/mmcache/" in code.co_filename
    return type(obj).__module__.startswith("mmcache")
