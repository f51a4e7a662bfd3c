"""Inclusive tiers: a feature promoted back to the GPU tier keeps its host copy, leaves the GPU
tier again with no copy, and every way out of either tier frees exactly what it held."""

from __future__ import annotations

import torch
from conftest import CacheFactory, KiB, Rig, assert_exact, put_feature

from mmcache import FeatureCache
from mmcache.core.entry import Entry, State


def entry_of(cache: FeatureCache, key: str) -> Entry:
    found = cache._core.index[key]
    assert isinstance(found, Entry)
    return found


def audited(cache: FeatureCache, rig: Rig) -> None:
    """No byte unowned in either tier, and (simulator) device memory is what GPU entries hold."""
    assert cache._core.audit() == {"gpu": 0, "cpu": 0}
    assert cache.stats().leaked_bytes == 0
    if rig.kind == "sim":
        rig.settle()
        assert rig.allocated_bytes() == cache.stats().gpu_bytes


async def promoted_a(cache: FeatureCache, rig: Rig) -> dict[str, torch.Tensor]:
    """a, b, c of 128 KiB into a 256 KiB GPU tier (a offloaded), b discarded, a read back:
    a is on the GPU tier with its host copy, c on the GPU tier alone."""
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate("abc")}
    await cache.drain()
    assert cache.discard("b")
    assert_exact(await cache.get("a"), expected["a"])
    await cache.drain()
    a = entry_of(cache, "a")
    assert a.state is State.GPU and a.block is not None
    s = cache.stats()
    assert (s.promotions, s.gpu_entries, s.cpu_entries) == (1, 2, 1)
    assert (s.gpu_bytes, s.cpu_bytes) == (256 * KiB, 128 * KiB)
    audited(cache, rig)
    return expected


async def test_evicting_a_promoted_feature_copies_nothing(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    expected = await promoted_a(cache, rig)
    block = entry_of(cache, "a").block
    before = cache.stats()
    expected["d"] = await put_feature(cache, rig, "d", 128, seed=9)  # evicts c: a copy
    expected["e"] = await put_feature(cache, rig, "e", 128, seed=10)  # evicts a: none
    await cache.drain()
    s = cache.stats()
    assert s.evictions_gpu == before.evictions_gpu + 2
    assert s.d2h_bytes == before.d2h_bytes + 128 * KiB  # c's copy only
    a = entry_of(cache, "a")
    assert a.state is State.HOST and a.block is block and a.tensor is None  # the same copy
    assert (s.gpu_entries, s.cpu_entries) == (2, 2)
    assert (s.gpu_bytes, s.cpu_bytes) == (256 * KiB, 256 * KiB)
    audited(cache, rig)
    for key in "acde":
        assert_exact(await cache.get(key, device="cpu"), expected[key])
    audited(cache, rig)


async def test_a_discard_of_a_promoted_feature_frees_both_tiers(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    await promoted_a(cache, rig)
    assert cache.discard("a")
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_entries, s.cpu_entries) == (1, 0)
    assert (s.gpu_bytes, s.cpu_bytes) == (128 * KiB, 0)
    assert "a" not in cache and await cache.get("a") is None
    audited(cache, rig)


async def test_a_put_replacing_a_promoted_feature_frees_both_tiers(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    await promoted_a(cache, rig)
    new = await put_feature(cache, rig, "a", 64, seed=7)
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_entries, s.cpu_entries) == (2, 0)
    assert (s.gpu_bytes, s.cpu_bytes) == ((128 + 64) * KiB, 0)
    assert entry_of(cache, "a").block is None
    assert_exact(await cache.get("a"), new)
    assert_exact(await cache.get("a", device="cpu"), new)
    audited(cache, rig)


async def test_a_host_eviction_takes_only_the_copy_of_a_promoted_feature(
    rig: Rig, make_cache: CacheFactory
) -> None:
    # Room for two features on either tier.
    cache = make_cache(gpu_mb=0.25, cpu_mb=0.25)
    expected = await promoted_a(cache, rig)  # GPU: c, a; host: a's copy
    expected["d"] = await put_feature(cache, rig, "d", 128, seed=9)  # c to the host tier
    await cache.drain()
    assert_exact(await cache.get("a"), expected["a"])  # a GPU hit: d is the GPU's LRU now
    before = cache.stats()
    # d goes to the host tier, which is full (a's copy, c): it gives up a's copy, the
    # least recently used there, while a stays on the GPU tier, exact.
    expected["e"] = await put_feature(cache, rig, "e", 128, seed=10)
    await cache.drain()
    s = cache.stats()
    assert s.evictions_cpu == before.evictions_cpu + 1
    assert s.dropped == before.dropped  # no feature was lost
    a = entry_of(cache, "a")
    assert a.state is State.GPU and a.block is None and a.tensor is not None
    assert (s.gpu_entries, s.cpu_entries) == (2, 2)
    assert all(key in cache for key in "acde")
    audited(cache, rig)
    assert_exact(await cache.get("a"), expected["a"])  # GPU: e, a
    # Without a host copy, a leaving the GPU tier is a copy again.
    before = cache.stats()
    expected["f"] = await put_feature(cache, rig, "f", 128, seed=11)  # evicts e
    expected["g"] = await put_feature(cache, rig, "g", 128, seed=12)  # then a
    await cache.drain()
    s = cache.stats()
    assert s.d2h_bytes == before.d2h_bytes + 2 * 128 * KiB
    assert entry_of(cache, "a").state is State.HOST
    assert_exact(await cache.get("a", device="cpu"), expected["a"])
    audited(cache, rig)


async def test_a_hotter_host_hit_takes_the_room_of_colder_gpu_entries(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate("hcx")}
    await cache.drain()  # GPU: c, x; host: h
    for _ in range(4):  # c is used often, x never again
        assert_exact(await cache.get("c"), expected["c"])
    before = cache.stats()
    # h, used twice (its put, this read), is hotter than x (its put), not than c (five
    # uses): x, the colder though the more recently used, is offloaded for it. The room
    # comes when that copy lands: h is not promoted by this read.
    assert_exact(await cache.get("h"), expected["h"])
    await cache.drain()
    s = cache.stats()
    assert (s.promotions, s.evictions_gpu) == (before.promotions, before.evictions_gpu + 1)
    assert entry_of(cache, "x").state is State.HOST
    assert entry_of(cache, "c").state is State.GPU
    # h is promoted by its next read, into that room.
    assert_exact(await cache.get("h"), expected["h"])
    await cache.drain()
    assert cache.stats().promotions == before.promotions + 1
    assert entry_of(cache, "h").state is State.GPU
    audited(cache, rig)
    for key in "hcx":
        assert_exact(await cache.get(key, device="cpu"), expected[key])


async def test_a_host_hit_demotes_a_colder_promoted_entry_at_once(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    expected = await promoted_a(cache, rig)  # GPU: c, a (with its host copy); host: -
    expected["d"] = await put_feature(cache, rig, "d", 128, seed=9)  # c to the host tier
    await cache.drain()  # GPU: a, d
    for _ in range(3):
        assert_exact(await cache.get("d"), expected["d"])
    for _ in range(3):
        assert_exact(await cache.get("c"), expected["c"])  # hotter than a now; no room
        await cache.drain()
    s = cache.stats()
    # a (a host copy: free to demote) made the room, with no copy, and c took it.
    assert entry_of(cache, "a").state is State.HOST
    assert entry_of(cache, "c").state is State.GPU
    assert entry_of(cache, "d").state is State.GPU
    assert s.promotions == 2
    audited(cache, rig)
    for key in "acd":
        assert_exact(await cache.get(key, device="cpu"), expected[key])


async def test_a_cold_host_hit_leaves_hot_gpu_entries_alone(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate("zxy")}
    await cache.drain()  # GPU: x, y; host: z
    for _ in range(5):
        for key in "xy":
            assert_exact(await cache.get(key), expected[key])
    before = cache.stats()
    for _ in range(3):
        assert_exact(await cache.get("z"), expected["z"])
        await cache.drain()
    s = cache.stats()
    assert (s.promotions, s.evictions_gpu, s.d2h_bytes) == (
        before.promotions,
        before.evictions_gpu,
        before.d2h_bytes,
    )
    assert entry_of(cache, "z").state is State.HOST
    audited(cache, rig)


async def test_get_many_promotes_hotter_host_hits_into_a_full_tier(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.5, cpu_mb=2)  # four features of 128 KiB on the GPU tier
    keys = [f"k{i}" for i in range(8)]
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate(keys)}
    await cache.drain()  # GPU: k4..k7; host: k0..k3
    hot = keys[:2]
    for _ in range(4):
        got = await cache.get_many(hot)
        for key, out in zip(hot, got, strict=True):
            assert_exact(out, expected[key])
        del got, out
        await cache.drain()
        audited(cache, rig)
    for key in hot:
        assert entry_of(cache, key).state is State.GPU
        assert entry_of(cache, key).block is not None  # each kept its host copy
    assert cache.stats().promotions == 2
    got = await cache.get_many(keys)
    for key, out in zip(keys, got, strict=True):
        assert_exact(out, expected[key])
    del got, out
    await cache.drain()
    audited(cache, rig)


async def test_promote_policy_room_promotes_only_into_free_room(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1, promote_policy="room")
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate("hcx")}
    await cache.drain()
    for _ in range(5):
        assert_exact(await cache.get("h"), expected["h"])
        await cache.drain()
    s = cache.stats()
    assert (s.promotions, s.hits_cpu) == (0, 5)
    assert entry_of(cache, "h").state is State.HOST
    assert cache.discard("x")
    assert_exact(await cache.get("h"), expected["h"])
    await cache.drain()
    assert cache.stats().promotions == 1
    assert entry_of(cache, "h").block is not None  # inclusive all the same
    audited(cache, rig)
