"""Host-tier hits that stay the reader's: small ones are copied on the reader's stream.

Such an upload has no fence of its own: the entry remembers the stream, and freeing its
host block records a fence there, so the block is reused only after the copy read it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import (
    CacheFactory,
    KiB,
    Rig,
    assert_exact,
    needs_hold,
    put_feature,
    reader_stream,
    served_from,
    stall,
)

from mmcache.device import SimDevice

pytestmark = pytest.mark.usefixtures("no_collection_during_reports")

FEATURE_KIB = 128


@pytest.mark.parametrize("many", [False, True], ids=["get", "get_many"])
@pytest.mark.parametrize("small_copy_kib", [4096, 0])
async def test_a_small_host_hit_is_copied_on_the_readers_stream(
    rig: Rig, make_cache: CacheFactory, small_copy_kib: int, many: bool
) -> None:
    needs_hold(rig)
    device = rig.device
    assert isinstance(device, SimDevice)
    cache = make_cache(
        gpu_mb=FEATURE_KIB / KiB,
        cpu_mb=1,
        promote_on_hit=False,
        small_copy_bytes=small_copy_kib * KiB,
    )
    want = await put_feature(cache, rig, "a", FEATURE_KIB, seed=1)
    await put_feature(cache, rig, "b", FEATURE_KIB, seed=2)  # "a" goes to the host tier
    await cache.drain()
    before = cache.stats()
    reader = reader_stream(rig)
    with rig.hold():
        read = asyncio.create_task(
            cache.get_many(["a"], stream=reader) if many else cache.get("a", stream=reader)
        )
        await asyncio.sleep(0.01)
        assert not read.done()
        if small_copy_kib:  # below the threshold: on the reader's stream
            assert (len(reader.ops), len(device.h2d_stream.ops)) == (1, 0)
        else:  # at or above it: on the cache's H2D stream
            assert (len(reader.ops), len(device.h2d_stream.ops)) == (0, 1)
    got = await read
    assert_exact(got[0] if isinstance(got, list) else got, want)
    await cache.drain()
    after = cache.stats()
    assert after.h2d_bytes == before.h2d_bytes + FEATURE_KIB * KiB
    assert (after.hits_cpu, after.promotions) == (before.hits_cpu + 1, before.promotions)
    assert after.leaked_bytes == 0


async def test_a_host_block_freed_under_a_queued_upload_is_reused_only_after_it(
    rig: Rig, make_cache: CacheFactory
) -> None:
    # One feature per tier: the next offload wants exactly the block the upload reads.
    cache = make_cache(gpu_mb=FEATURE_KIB / KiB, cpu_mb=FEATURE_KIB / KiB, promote_on_hit=False)
    want = await put_feature(cache, rig, "a", FEATURE_KIB, seed=1)
    await put_feature(cache, rig, "b", FEATURE_KIB, seed=2)  # "a" goes to the host tier
    await cache.drain()
    rig.settle()
    reader = reader_stream(rig)
    if isinstance(rig.device, SimDevice):
        with rig.hold():
            read = asyncio.create_task(cache.get("a", stream=reader))
            await asyncio.sleep(0.01)
            assert cache.discard("a")  # its block is freed while the upload is held
            await put_feature(cache, rig, "c", FEATURE_KIB, seed=3)  # "b" wants a block
        got = await read
    else:
        stall(reader, 0.2)  # the upload queued behind this kernel on the reader's stream
        got = await cache.get("a", stream=reader)
        assert not reader.query()
        assert cache.discard("a")
        await put_feature(cache, rig, "c", FEATURE_KIB, seed=3)  # "b" wants a block
        await asyncio.sleep(0.01)  # time for an offload into a reused block to land
        assert got is not None
        with torch.cuda.stream(reader):
            got = got.clone()
        reader.synchronize()
    assert_exact(got, want)
    await cache.drain()
    rig.settle()
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def test_a_batch_on_the_readers_stream_counts_the_features_bytes_not_its_padding(
    rig: Rig, make_cache: CacheFactory
) -> None:
    # A GPU tier of two features: "a" and "b" go to the host tier.
    cache = make_cache(gpu_mb=1200 / (KiB * KiB), cpu_mb=1, promote_on_hit=False)
    want = {}
    for i, key in enumerate("abcd"):  # 600 bytes each: not a multiple of the alignment
        value = rig.tensor(3, 50, dtype=torch.float32, seed=i)
        want[key] = value.cpu().clone()
        assert await cache.put(key, value)
        del value
    await cache.drain()
    assert await served_from(cache, "a") == "cpu" and await served_from(cache, "b") == "cpu"
    before = cache.stats()
    got = await cache.get_many(["a", "b"])
    for key, read in zip("ab", got, strict=True):
        assert_exact(read, want[key])
    await cache.drain()
    assert cache.stats().h2d_bytes == before.h2d_bytes + 2 * 600
