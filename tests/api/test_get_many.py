"""get_many: the features of a request in one call, each as get would return it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, feature, put_feature

from mmcache import CopyFailedError, DeviceOutOfMemoryError, FeatureCache, InvalidKeyError
from mmcache.device.sim import SimDevice


async def test_a_mixed_batch_reads_each_feature_exactly(rig: Rig, make_cache: CacheFactory) -> None:
    # GPU tier of 64 KiB: the first features put end in the host tier.
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1, promote_on_hit=False)
    assert await cache.wait_host_ready(5)
    want = {f"f{i}": await put_feature(cache, rig, f"f{i}", 16, seed=i) for i in range(8)}
    await cache.drain()
    before = cache.stats()
    keys = ["f0", "f7", "nope", "f1", "f6", "f0"]
    got = await cache.get_many(keys)
    after = cache.stats()
    for key, value in zip(keys, got, strict=True):
        if key == "nope":
            assert value is None
        else:
            assert value is not None and value.device.type == (
                "cpu" if rig.kind == "sim" else "cuda"
            )
            assert_exact(value, want[key])
    assert after.misses - before.misses == 1
    # A key given twice is read once.
    assert (after.hits_gpu + after.hits_cpu) - (before.hits_gpu + before.hits_cpu) == 4
    assert after.hits_cpu - before.hits_cpu == 2  # f0 and f1 were offloaded
    del got
    await cache.drain()
    assert cache.stats().leaked_bytes == 0
    for key, value in want.items():  # the host copies are intact after the batch
        assert_exact(await cache.get(key, device="cpu"), value)


async def test_host_hits_are_promoted_while_the_gpu_tier_has_room(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1)
    assert await cache.wait_host_ready(5)
    want = {f"f{i}": await put_feature(cache, rig, f"f{i}", 16, seed=i) for i in range(6)}
    await cache.drain()
    cache.discard("f5")
    cache.discard("f4")  # 32 KiB of GPU room: two of the host hits are promoted
    await cache.drain()
    before = cache.stats()
    got = await cache.get_many(["f0", "f1", "f2"])
    for key, value in zip(["f0", "f1", "f2"], got, strict=True):
        assert_exact(value, want[key])
    del got
    await cache.drain()
    after = cache.stats()
    assert after.promotions - before.promotions == 2
    assert after.gpu_bytes == 64 * 1024
    hits = cache.stats().hits_gpu
    assert_exact(await cache.get("f0"), want["f0"])  # promoted: now a GPU hit
    assert cache.stats().hits_gpu == hits + 1
    for key in ("f0", "f1", "f2", "f3"):
        assert_exact(await cache.get(key), want[key])
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_group_members_are_read_from_their_group(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1, promote_on_hit=False)
    assert await cache.wait_host_ready(5)
    values = [feature(rig, 8, seed=i) for i in range(4)]
    want = [v.cpu().clone() for v in values]
    assert await cache.put_many([(f"m{i}", v) for i, v in enumerate(values)])
    del values
    for i in range(4):  # push the group to the host tier
        await put_feature(cache, rig, f"x{i}", 16, seed=10 + i)
    await cache.drain()
    got = await cache.get_many(["m3", "m0", "x3"])
    assert_exact(got[0], want[3])
    assert_exact(got[1], want[0])
    assert got[2] is not None
    del got
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_a_batch_to_the_host_returns_copies(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1)
    assert await cache.wait_host_ready(5)
    want = {f"f{i}": await put_feature(cache, rig, f"f{i}", 16, seed=i) for i in range(6)}
    got = await cache.get_many(["f0", "f5", "x"], device="cpu")
    assert got[0] is not None and got[0].device.type == "cpu"
    assert_exact(got[0], want["f0"])
    assert_exact(got[1], want["f5"])
    assert got[2] is None


async def test_a_key_given_twice_to_the_host_is_read_and_counted_once(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1, promote_on_hit=False)
    assert await cache.wait_host_ready(5)
    want = {f"f{i}": await put_feature(cache, rig, f"f{i}", 16, seed=i) for i in range(6)}
    await cache.drain()  # f0 and f1 on the host tier, f5 on the GPU
    before = cache.stats()
    keys = ["f0", "f5", "nope", "f0", "f5", "nope"]
    got = await cache.get_many(keys, device="cpu")
    after = cache.stats()
    assert (after.hits_cpu - before.hits_cpu, after.hits_gpu - before.hits_gpu) == (1, 1)
    assert after.misses - before.misses == 1
    for key, value in zip(keys, got, strict=True):
        if key == "nope":
            assert value is None
        else:
            assert value is not None and value.device.type == "cpu"
            assert_exact(value, want[key])
    assert got[3] is not got[0] and got[4] is not got[1]  # each position a tensor of its own


async def test_an_empty_batch_and_bad_keys(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    assert await cache.get_many([]) == []
    await put_feature(cache, rig, "a", 4)
    before = cache.stats()
    with pytest.raises(InvalidKeyError, match="list of keys"):
        await cache.get_many("a")
    with pytest.raises(InvalidKeyError):
        await cache.get_many(["a", ["unhashable"]])  # type: ignore[list-item]
    after = cache.stats()
    assert (after.hits_gpu, after.misses) == (before.hits_gpu, before.misses)  # nothing read


async def test_the_device_memory_of_a_batch_goes_back(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1, promote_on_hit=False)
    assert await cache.wait_host_ready(5)
    for i in range(8):
        await put_feature(cache, rig, f"f{i}", 16, seed=i)
    await cache.drain()
    rig.settle()
    before = rig.allocated_bytes()
    for _ in range(5):
        got = await cache.get_many([f"f{i}" for i in range(8)])
        assert all(g is not None for g in got)
        del got
    await cache.drain()
    rig.settle()
    assert rig.allocated_bytes() == before
    assert cache.stats().leaked_bytes == 0


async def offloaded(
    rig: Rig, make_cache: CacheFactory, small_copy_bytes: int = 4 << 20
) -> tuple[FeatureCache, dict[str, torch.Tensor]]:
    """A cache whose GPU tier (64 KiB, no promotion) holds the last four of six 16 KiB
    features put, the host tier the first two; and the features, to compare with.

    Host hits below small_copy_bytes are uploaded on the reader's stream, the others on
    the cache's H2D stream."""
    cache = make_cache(
        gpu_mb=64 / 1024, cpu_mb=1, promote_on_hit=False, small_copy_bytes=small_copy_bytes
    )
    assert await cache.wait_host_ready(5)
    want = {f"f{i}": await put_feature(cache, rig, f"f{i}", 16, seed=i) for i in range(6)}
    await cache.drain()
    return cache, want


def _sim(rig: Rig) -> SimDevice:
    """The rig's simulator (the test injects faults or holds copies: skipped on a GPU)."""
    if not isinstance(rig.device, SimDevice):
        pytest.skip("injects faults or holds copies back: SimDevice only")
    return rig.device


@pytest.mark.parametrize("small_copy_bytes", [4 << 20, 0])
async def test_a_failed_batch_upload_raises_and_keeps_the_entries(
    rig: Rig, make_cache: CacheFactory, small_copy_bytes: int
) -> None:
    cache, want = await offloaded(rig, make_cache, small_copy_bytes)
    _sim(rig).inject("copy_fails")
    with pytest.raises(CopyFailedError):
        await cache.get_many(["f0", "f1", "f5"])
    await cache.drain()
    for key, value in want.items():
        assert_exact(await cache.get(key), value)
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


@pytest.mark.parametrize("small_copy_bytes", [4 << 20, 0])
async def test_out_of_memory_in_a_batch_raises_and_frees_what_it_took(
    rig: Rig, make_cache: CacheFactory, small_copy_bytes: int
) -> None:
    cache, want = await offloaded(rig, make_cache, small_copy_bytes)
    rig.settle()
    before = rig.allocated_bytes()
    _sim(rig).inject("alloc_fails")
    with pytest.raises(DeviceOutOfMemoryError):
        await cache.get_many(["f0", "f1"])
    await cache.drain()
    rig.settle()
    assert rig.allocated_bytes() == before
    for key, value in want.items():
        assert_exact(await cache.get(key), value)


@pytest.mark.parametrize("small_copy_bytes", [4 << 20, 0])
async def test_a_batch_resolves_only_after_its_uploads(
    rig: Rig, make_cache: CacheFactory, small_copy_bytes: int
) -> None:
    _sim(rig)
    cache, want = await offloaded(rig, make_cache, small_copy_bytes)
    with rig.hold():  # the batch's upload copies are held back
        read = asyncio.create_task(cache.get_many(["f0", "f1", "f5"]))
        await asyncio.sleep(0.02)
        assert not read.done()
    got = await read
    for key, value in zip(["f0", "f1", "f5"], got, strict=True):
        assert_exact(value, want[key])
