"""Budgets: each tier stays within its bytes, evicts least recently used, and pushes back."""

from __future__ import annotations

import asyncio
import random
import re
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch
from conftest import (
    CacheFactory,
    KiB,
    Rig,
    assert_exact,
    feature,
    needs_hold,
    put_feature,
    served_from,
)

from mmcache import CacheSettings, CacheStats, FeatureCache, ValueTooLargeError
from mmcache.core.state import EvictionPlan


def within_budget(s: CacheStats) -> None:
    assert 0 <= s.gpu_bytes <= s.gpu_capacity_bytes
    assert 0 <= s.cpu_bytes <= s.cpu_capacity_bytes


async def test_tiers_never_exceed_their_budgets(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=0.5, promote_on_hit=True)
    rng = random.Random(0)
    expected: dict[int, torch.Tensor] = {}
    for i in range(40):
        expected[i] = await put_feature(cache, rig, i, rng.choice([16, 32, 48, 64, 96]), seed=i)
        within_budget(cache.stats())
        for key in rng.sample(sorted(expected), min(3, len(expected))):
            out = await cache.get(key, device=rng.choice([None, "cpu"]))
            if out is not None:
                assert_exact(out, expected[key])
            del out
            within_budget(cache.stats())
    await cache.drain()
    s = cache.stats()
    within_budget(s)
    assert s.leaked_bytes == 0
    assert s.evictions_gpu > 0 and s.evictions_cpu > 0
    # A promoted feature keeps its host copy: it counts in both tiers (inclusive).
    assert max(s.gpu_entries, s.cpu_entries) <= len(cache) <= s.gpu_entries + s.cpu_entries
    for key, want in expected.items():
        if key in cache:
            assert_exact(await cache.get(key, device="cpu"), want)
    if rig.kind == "sim":  # nothing but the GPU-resident entries holds device memory
        assert rig.allocated_bytes() == cache.stats().gpu_bytes


async def test_gpu_eviction_offloads_least_recently_used_first(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1, promote_on_hit=False)
    expected = {k: await put_feature(cache, rig, k, 64, seed=i) for i, k in enumerate("abcd")}
    assert cache.stats().evictions_gpu == 0
    assert await cache.get("a") is not None  # a is now the most recently used
    expected["e"] = await put_feature(cache, rig, "e", 64, seed=10)
    expected["f"] = await put_feature(cache, rig, "f", 64, seed=11)
    await cache.drain()
    s = cache.stats()
    assert s.evictions_gpu == 2 and s.dropped == 0
    assert s.gpu_bytes == 4 * 64 * KiB and s.cpu_bytes == 2 * 64 * KiB
    assert [await served_from(cache, k) for k in "abcdef"] == [
        "gpu",
        "cpu",
        "cpu",
        "gpu",
        "gpu",
        "gpu",
    ]
    for key, want in expected.items():
        assert_exact(await cache.get(key), want)


async def test_host_eviction_drops_least_recently_used(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=0.25, promote_on_hit=False)
    expected = {k: await put_feature(cache, rig, k, 64, seed=i) for i, k in enumerate("abcd")}
    await cache.drain()
    assert await cache.get("a", device="cpu") is not None  # refresh a
    assert await cache.get("b") is not None  # refresh b (a device read of a host entry)
    expected["e"] = await put_feature(cache, rig, "e", 64, seed=10)
    await cache.drain()
    s = cache.stats()
    assert s.evictions_cpu == 1
    assert s.cpu_bytes == 4 * 64 * KiB
    assert "c" not in cache
    assert [k for k in "abcde" if k in cache] == ["a", "b", "d", "e"]
    for key in "abde":
        assert_exact(await cache.get(key), expected[key])


async def test_gpu_eviction_into_a_full_host_tier_drops_its_lru(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.125, cpu_mb=0.125, promote_on_hit=False)
    expected = {k: await put_feature(cache, rig, k, 64, seed=i) for i, k in enumerate("abcde")}
    await cache.drain()
    s = cache.stats()
    within_budget(s)
    # a, b, c went to host in that order; the host holds two, so a was dropped.
    assert "a" not in cache
    assert s.evictions_gpu == 3 and s.evictions_cpu == 1
    assert [await served_from(cache, k) for k in "bcde"] == ["cpu", "cpu", "gpu", "gpu"]
    for key in "bcde":
        assert_exact(await cache.get(key), expected[key])


async def test_host_room_goes_to_gpu_victims_in_lru_order_whatever_their_size(
    rig: Rig, make_cache: CacheFactory
) -> None:
    # s is small (its offload is batched), L large (its own copy); the host takes one.
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=32 / 1024, small_copy_bytes=16 * KiB)
    assert await cache.wait_host_ready(timeout=30)  # CUDA pins its arena in the background
    expected = {
        k: await put_feature(cache, rig, k, kib, seed=i)
        for i, (k, kib) in enumerate((("s", 8), ("L", 32)))
    }
    await put_feature(cache, rig, "X", 64, seed=9)  # evicts s, then L: s gets the room
    await cache.drain()
    s = cache.stats()
    assert s.evictions_gpu == 2
    if s.dropped:  # s's copy still running when L asked: the newer victim is the one lost
        assert s.dropped == 1 and "L" not in cache
        kept = "s"
    else:  # s's copy landed at once (a GPU), and the host tier evicted it, its LRU, for L
        assert s.evictions_cpu == 1 and "s" not in cache
        kept = "L"
    assert await served_from(cache, kept) == "cpu"
    assert_exact(await cache.get(kept, device="cpu"), expected[kept])


@pytest.mark.parametrize("tier", ["gpu", "host"])
async def test_a_value_larger_than_its_tier_is_refused_and_nothing_is_lost(
    rig: Rig, make_cache: CacheFactory, tier: str
) -> None:
    # The budgets are keyword arguments here: the error says to raise those.
    if tier == "gpu":
        cache = make_cache(gpu_mb=0.25, cpu_mb=1)
        names = ["CacheSettings(gpu_cache_mb=...)"]
    else:
        cache = make_cache(gpu_mb=0, cpu_mb=0.25)
        names = ["CacheSettings(cpu_cache_mb=...)"]
    expected = {k: await put_feature(cache, rig, k, 96, seed=i) for i, k in enumerate("ab")}
    await cache.drain()
    before = cache.stats()
    big = feature(rig, 257, seed=9)  # one KiB over the tier
    big_clone = big.cpu().clone()
    for key in ("big", "a"):  # a new key, and a replacement of a live one
        with pytest.raises(ValueTooLargeError) as info:
            await cache.put(key, big)
        for name in names:
            assert name in str(info.value)
        assert "MMCACHE_" not in str(info.value)
    await cache.drain()
    assert cache.stats() == before
    assert len(cache) == 2 and "big" not in cache
    for key, want in expected.items():
        assert_exact(await cache.get(key), want)
    assert_exact(big, big_clone)  # the caller's tensor was not taken, nor poisoned


async def test_zero_gpu_budget_puts_straight_to_the_host_tier(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    expected = await put_feature(cache, rig, "k", 64, seed=1)
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_bytes, s.gpu_entries, s.gpu_capacity_bytes) == (0, 0, 0)
    assert (s.cpu_bytes, s.cpu_entries) == (64 * KiB, 1)
    assert s.d2h_bytes == 64 * KiB and s.evictions_gpu == 0
    assert_exact(await cache.get("k", device="cpu"), expected)
    assert_exact(await cache.get("k"), expected)
    await cache.drain()
    s = cache.stats()
    assert (s.gpu_bytes, s.gpu_entries, s.cpu_entries, s.promotions) == (0, 0, 1, 0)
    if rig.kind == "sim":
        assert rig.allocated_bytes() == 0


async def test_both_budgets_zero_store_nothing(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0, cpu_mb=0)
    t = feature(rig, 4)
    assert await cache.put("k", t) is False
    assert await cache.put("k", t, wait=False) is False
    del t
    assert "k" not in cache and len(cache) == 0
    assert await cache.get("k") is None
    s = cache.stats()
    assert (s.gpu_bytes, s.cpu_bytes, s.gpu_entries, s.cpu_entries) == (0, 0, 0, 0)
    if rig.kind == "sim":
        assert rig.allocated_bytes() == 0


async def test_wait_false_drops_when_the_gpu_is_full_of_copies_in_flight(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate("ab")}
    with rig.hold():
        t = feature(rig, 128, seed=5)
        expected["c"] = t.cpu().clone()
        waiting = asyncio.create_task(cache.put("c", t))
        del t
        await asyncio.sleep(0.01)
        assert not waiting.done()  # a is being offloaded; its bytes are still in flight
        small = feature(rig, 16, seed=6)
        assert await cache.put("d", small, wait=False) is False
        del small
        assert "d" not in cache
        assert cache.stats().rejected == 1
        within_budget(cache.stats())
    assert await asyncio.wait_for(waiting, 2) is True
    await cache.drain()
    assert "d" not in cache
    for key, want in expected.items():
        assert_exact(await cache.get(key, device="cpu"), want)
    assert cache.stats().leaked_bytes == 0
    assert rig.allocated_bytes() == cache.stats().gpu_bytes  # d's memory was released


async def test_wait_false_drops_when_the_host_tier_is_full_of_copies_in_flight(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=0.25)
    with rig.hold():
        expected = await put_feature(cache, rig, "a", 256, seed=1)
        t = feature(rig, 16, seed=2)
        assert await cache.put("b", t, wait=False) is False
        del t
        assert "b" not in cache and cache.stats().rejected == 1
    await cache.drain()
    assert_exact(await cache.get("a"), expected)
    assert rig.allocated_bytes() == 0


async def test_put_waits_for_held_offloads_then_proceeds_in_order(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    expected = {k: await put_feature(cache, rig, k, 128, seed=i) for i, k in enumerate("ab")}
    finished: list[str] = []

    async def put(key: str, seed: int) -> None:
        t = feature(rig, 128, seed)
        expected[key] = t.cpu().clone()
        assert await cache.put(key, t)
        finished.append(key)

    with rig.hold():
        tasks = [asyncio.create_task(put(k, 10 + i)) for i, k in enumerate("cd")]
        await asyncio.sleep(0.01)
        assert not any(task.done() for task in tasks)
        within_budget(cache.stats())
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert finished == ["c", "d"]
    await cache.drain()
    within_budget(cache.stats())
    for key, want in expected.items():
        assert_exact(await cache.get(key, device="cpu"), want)


async def test_a_small_put_queued_behind_a_large_one_proceeds_after_it(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    for i, k in enumerate("ab"):
        await put_feature(cache, rig, k, 128, seed=i)
    finished: list[str] = []

    async def put(key: str, kib: int) -> None:
        t = feature(rig, kib)
        assert await cache.put(key, t)
        finished.append(key)

    with rig.hold():
        large = asyncio.create_task(put("large", 256))
        await asyncio.sleep(0.01)
        small = asyncio.create_task(put("small", 64))  # would fit first, but arrived second
        await asyncio.sleep(0.01)
        assert not large.done() and not small.done()
    try:
        await asyncio.wait_for(asyncio.gather(large, small), 1)
    finally:
        for task in (large, small):
            task.cancel()
    assert finished == ["large", "small"]


@pytest.mark.parametrize("start", ["gpu", "host"])
async def test_re_put_replaces_and_keeps_the_ledger_exact(
    rig: Rig, make_cache: CacheFactory, start: str
) -> None:
    cache = make_cache(gpu_mb=0.5, cpu_mb=1)
    other = await put_feature(cache, rig, "other", 64, seed=1)
    await put_feature(cache, rig, "k", 128, seed=2)
    if start == "cpu":  # push k (now the least recently used) to the host tier
        assert await cache.get("other") is not None
        await put_feature(cache, rig, "filler", 384, seed=3)
        await cache.drain()
        assert await served_from(cache, "k") == "cpu"
        assert cache.discard("filler")
    for i, kib in enumerate([32, 192, 64]):
        want = await put_feature(cache, rig, "k", kib, seed=10 + i)
        await cache.drain()
        s = cache.stats()
        assert len(cache) == 2
        assert_exact(await cache.get("k", device="cpu"), want)
        resident = 0
        for key, nbytes in (("k", kib * KiB), ("other", 64 * KiB)):
            if await served_from(cache, key) == "gpu":
                resident += nbytes
        assert s.gpu_bytes == resident
        assert s.gpu_entries + s.cpu_entries == 2
        assert s.leaked_bytes == 0
        within_budget(s)
    assert_exact(await cache.get("other"), other)
    await cache.drain()
    if rig.kind == "sim":
        assert rig.allocated_bytes() == cache.stats().gpu_bytes


async def test_re_put_while_the_old_value_is_offloading(rig: Rig, make_cache: CacheFactory) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    with rig.hold():
        await put_feature(cache, rig, "k", 64, seed=1)
        assert cache.stats().pending_copies == 1
        want = await put_feature(cache, rig, "k", 32, seed=2)
        assert len(cache) == 1
    await cache.drain()
    s = cache.stats()
    assert (s.cpu_entries, s.cpu_bytes, s.leaked_bytes, s.pending_copies) == (1, 32 * KiB, 0, 0)
    assert_exact(await cache.get("k", device="cpu"), want)
    assert_exact(await cache.get("k"), want)
    assert rig.allocated_bytes() == 0


async def test_re_put_does_not_evict_other_keys_when_the_replacement_fits(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    await put_feature(cache, rig, "a", 64, seed=1)
    await put_feature(cache, rig, "k", 128, seed=2)
    t = feature(rig, 128, seed=3)
    want = t.cpu().clone()
    assert await cache.put("k", t, wait=False) is True
    del t
    await cache.drain()
    s = cache.stats()
    assert (s.evictions_gpu, s.d2h_bytes, s.gpu_bytes) == (0, 0, 192 * KiB)
    assert_exact(await cache.get("k"), want)


async def test_re_put_does_not_offload_the_value_it_replaces(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    await put_feature(cache, rig, "k", 192, seed=1)
    want = await put_feature(cache, rig, "k", 192, seed=2)
    await cache.drain()
    s = cache.stats()
    assert (s.evictions_gpu, s.d2h_bytes, s.cpu_entries) == (0, 0, 0)
    assert_exact(await cache.get("k"), want)


@pytest.mark.parametrize(
    "view",
    [
        pytest.param(lambda b: b[8:40], id="rows"),
        pytest.param(lambda b: b[:, 16:48], id="columns"),
        pytest.param(lambda b: b[3], id="one-row"),
        pytest.param(lambda b: b.t(), id="transposed"),
    ],
)
async def test_a_view_is_compacted_at_put(
    rig: Rig, make_cache: CacheFactory, view: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    base = rig.tensor(64, 256, dtype=torch.float32, seed=4)  # 64 KiB
    v = view(base)
    expected = v.cpu().clone()
    nbytes = v.numel() * v.element_size()
    assert await cache.put("k", v)
    del v, base
    await cache.drain()
    assert cache.stats().gpu_bytes == nbytes
    out = await cache.get("k")
    assert_exact(out, expected)
    assert out is not None and out.is_contiguous()
    assert out.untyped_storage().nbytes() == nbytes
    del out
    if rig.kind == "sim":  # the base was never charged to, nor kept alive by, the cache
        assert rig.allocated_bytes() == nbytes
    # The compacted copy survives an offload and comes back exact.
    await put_feature(cache, rig, "filler", 256 - nbytes // KiB + 1, seed=5)
    await cache.drain()
    assert await served_from(cache, "k") == "cpu"
    assert_exact(await cache.get("k", device="cpu"), expected)


@pytest.mark.parametrize("ahead", [0.0, 0.25])
async def test_evict_ahead_keeps_room_beyond_what_the_put_needs(
    rig: Rig, make_cache: CacheFactory, ahead: float
) -> None:
    """With evict_ahead, puts into a full tier offload LRU entries early, in one batch."""
    cache = make_cache(gpu_mb=0.25, cpu_mb=1, evict_ahead=ahead)
    for i in range(9):  # 9 x 32 KiB into 256 KiB: the last ones need room
        await cache.put(i, rig.tensor(64, 256, seed=i))
    await cache.drain()
    s = cache.stats()
    room = s.gpu_capacity_bytes - s.gpu_bytes
    if ahead == 0:
        assert s.evictions_gpu == 1 and room == 0  # exactly what was needed
    else:
        assert room >= int(s.gpu_capacity_bytes * ahead) // 2  # the low-water mark holds
        assert s.evictions_gpu > 1
    for i in range(s.evictions_gpu):  # the least recently used went to the host, exact
        got = await cache.get(i, device="cpu")
        assert got is not None and torch.equal(got, rig.tensor(64, 256, seed=i).cpu())


def record_offload_batches(
    cache: FeatureCache, monkeypatch: pytest.MonkeyPatch
) -> list[list[Hashable]]:
    """The keys of each offload batch in the eviction plans cache makes from now on."""
    batches: list[list[Hashable]] = []
    state = cache._core.state
    plan_eviction = state.plan_eviction

    def recorded(needed: int, **options: Any) -> EvictionPlan:
        plan = plan_eviction(needed, **options)
        batches.extend([entry.key for entry, _ in items] for items in plan.batches)
        return plan

    monkeypatch.setattr(state, "plan_eviction", recorded)
    return batches


@pytest.mark.parametrize(
    ("ahead", "sizes"),
    [
        # 8 MiB free at the 97th put, under its low-water mark (256 KiB + 8 MiB): it
        # evicts to 16.25 MiB free or on the way, 32 + 1 features, and tops the 1 up.
        (0.5, [32, 32]),
        # 2 MiB free at the 121st put (mark 2.25 MiB): it evicts 9 features to 4.25 MiB,
        # then tops them up by half its 4 MiB evict-ahead room, 8 more.
        (0.125, [17]),
    ],
)
async def test_an_eviction_ahead_tops_up_its_last_batch(
    rig: Rig,
    make_cache: CacheFactory,
    monkeypatch: pytest.MonkeyPatch,
    ahead: float,
    sizes: list[int],
) -> None:
    """A batch of small features left part full by an eviction ahead of need is topped
    up (to 8 MiB at most, by half the evict-ahead room) rather than copied on its own."""
    cache = make_cache(gpu_mb=32, cpu_mb=64, evict_ahead=ahead)
    batches = record_offload_batches(cache, monkeypatch)
    expected = {}
    for i in range(128):  # 256 KiB each: the last ones need room
        expected[i] = await put_feature(cache, rig, i, 256, seed=i)
    await cache.drain()
    assert [len(batch) for batch in batches] == sizes
    evicted = sum(sizes)
    assert [key for batch in batches for key in batch] == list(range(evicted))  # LRU order
    for i in (0, evicted - 1):
        assert await served_from(cache, i) == "cpu"
        assert_exact(await cache.get(i, device="cpu"), expected[i])
    assert await served_from(cache, evicted) == "gpu"


async def test_without_a_host_tier_nothing_is_evicted_ahead(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """Ahead of need a victim is offloaded so that its copy overlaps the next puts; with
    no host tier it could only be dropped while it still fits."""
    cache = make_cache(gpu_mb=32, cpu_mb=0, evict_ahead=0.5)
    for i in range(128):  # 128 x 256 KiB: the tier exactly
        await put_feature(cache, rig, i, 256, seed=i)
    s = cache.stats()
    assert s.dropped == 0 and s.gpu_entries == 128
    await put_feature(cache, rig, 128, 256, seed=128)  # one more: one goes
    s = cache.stats()
    assert s.dropped == 1 and s.gpu_entries == 128


@pytest.mark.parametrize(
    ("variable", "raise_what"),
    [
        ("MMCACHE_GPU_CACHE_MB", "raise MMCACHE_GPU_CACHE_MB"),
        ("SGLANG_VLM_CACHE_SIZE_MB", "raise SGLANG_VLM_CACHE_SIZE_MB"),
    ],
)
async def test_too_large_names_the_variable_the_budget_came_from(
    monkeypatch: pytest.MonkeyPatch, rig: Rig, variable: str, raise_what: str
) -> None:
    for name in CacheSettings.env_names("gpu_cache_mb"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(variable, "1")
    settings = CacheSettings(cpu_cache_mb=0)
    async with FeatureCache(settings, rig.device) as cache:
        with pytest.raises(ValueTooLargeError, match=re.escape(raise_what)):
            await cache.put("big", feature(rig, 1025))
