"""Promotion: a host tier hit comes back to the GPU tier when it fits (into a full tier, see
test_inclusive_tier.py), keeping its host copy."""

from __future__ import annotations

import torch
from conftest import CacheFactory, KiB, Rig, assert_exact, put_feature

from mmcache import FeatureCache


async def offloaded(cache: FeatureCache, rig: Rig) -> dict[str, torch.Tensor]:
    """Put a, b, c of 128 KiB into a 256 KiB GPU tier: a ends up on the host tier."""
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate("abc")}
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_entries, s.cpu_entries, s.evictions_gpu) == (2, 1, 1)
    return expected


async def test_a_host_hit_is_promoted_when_it_fits(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1, promote_on_hit=True)
    expected = await offloaded(cache, rig)
    assert cache.discard("b")  # room for a
    await cache.drain()
    before = cache.stats()
    assert_exact(await cache.get("a"), expected["a"])
    await cache.drain()
    s = cache.stats()
    assert s.promotions == before.promotions + 1
    assert s.hits_cpu == before.hits_cpu + 1
    # Inclusive tiers: a keeps its host copy, still counted in the host tier.
    assert (s.gpu_entries, s.cpu_entries) == (2, 1)
    assert (s.gpu_bytes, s.cpu_bytes) == (256 * KiB, 128 * KiB)
    assert s.h2d_bytes == before.h2d_bytes + 128 * KiB
    assert s.leaked_bytes == 0

    # Now a GPU hit: no further copy, and the data is still exact on both paths.
    assert_exact(await cache.get("a"), expected["a"])
    assert_exact(await cache.get("a", device="cpu"), expected["a"])
    await cache.drain()
    after = cache.stats()
    assert after.hits_gpu == s.hits_gpu + 2
    assert (after.h2d_bytes, after.promotions) == (s.h2d_bytes, s.promotions)

    # c is offloaded (a copy); a, evicted next, is demoted to its host copy with none.
    await put_feature(cache, rig, "d", 128, seed=9)  # c is the LRU now
    await put_feature(cache, rig, "e", 128, seed=10)  # then a
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_entries, s.cpu_entries) == (2, 2)
    assert s.d2h_bytes == after.d2h_bytes + 128 * KiB
    assert_exact(await cache.get("a", device="cpu"), expected["a"])
    assert_exact(await cache.get("c", device="cpu"), expected["c"])
    if rig.kind == "sim":
        assert rig.allocated_bytes() == s.gpu_bytes


async def test_no_promotion_when_promote_on_hit_is_off(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1, promote_on_hit=False)
    expected = await offloaded(cache, rig)
    assert cache.discard("b")  # room enough: only the setting keeps a on the host tier
    await cache.drain()
    before = cache.stats()
    for _ in range(2):
        assert_exact(await cache.get("a"), expected["a"])
    await cache.drain()
    s = cache.stats()
    assert s.promotions == 0
    assert s.hits_cpu == before.hits_cpu + 2
    assert (s.gpu_entries, s.cpu_entries) == (1, 1)
    assert s.gpu_bytes == before.gpu_bytes == 128 * KiB
    assert s.h2d_bytes == before.h2d_bytes + 2 * 128 * KiB
    if rig.kind == "sim":  # the temporary device copies were released
        assert rig.allocated_bytes() == s.gpu_bytes


async def test_a_promotion_that_does_not_fit_is_skipped(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1, promote_on_hit=True, promote_policy="room")
    expected = await offloaded(cache, rig)  # GPU full of b and c
    before = cache.stats()
    out = await cache.get("a")
    assert_exact(out, expected["a"])
    await cache.drain()
    s = cache.stats()
    assert s.promotions == 0
    assert (s.gpu_entries, s.cpu_entries) == (2, 1)
    assert s.evictions_gpu == before.evictions_gpu  # nothing was pushed out to make room
    assert s.gpu_bytes == 256 * KiB
    assert s.h2d_bytes == before.h2d_bytes + 128 * KiB
    # The skipped promotion's device copy is the caller's and stays exact after more churn.
    expected["d"] = await put_feature(cache, rig, "d", 128, seed=9)
    await cache.drain()
    assert_exact(out, expected["a"])
    for key in "abcd":
        assert_exact(await cache.get(key, device="cpu"), expected[key])


async def test_rows_reads_of_a_host_entry_move_only_those_rows(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1, promote_on_hit=True)
    expected = await offloaded(cache, rig)
    assert cache.discard("b")  # a would fit: still, partial reads never promote
    await cache.drain()
    before = cache.stats()
    for rows in (slice(0, 4), slice(100, 128), slice(-8, -3)):
        assert_exact(await cache.get("a", rows=rows), expected["a"][rows])
    await cache.drain()
    s = cache.stats()
    assert s.promotions == 0
    assert (s.gpu_entries, s.cpu_entries) == (1, 1)
    assert s.h2d_bytes == before.h2d_bytes + (4 + 28 + 5) * KiB  # rows of 1 KiB
    # Host reads of rows move nothing to the device.
    assert_exact(await cache.get("a", rows=slice(10, 20), device="cpu"), expected["a"][10:20])
    await cache.drain()
    assert cache.stats().h2d_bytes == s.h2d_bytes
    # A whole read promotes.
    assert_exact(await cache.get("a"), expected["a"])
    await cache.drain()
    assert cache.stats().promotions == 1
