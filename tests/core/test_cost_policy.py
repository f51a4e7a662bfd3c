"""The cost eviction policy (GreedyDual-Size-Frequency): its order alone and in a cache.

A feature's priority is the clock + hits x compute seconds / bytes; the victim is the
lowest, and the clock rises to it. Costs come from put(..., cost=) and from the time
get_or_compute's fn took.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Hashable

import pytest
import torch
from conftest import CacheFactory, Rig, TimedFence, feature, put_feature
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache
from mmcache.core.cost_policy import FIRST_SECONDS_PER_BYTE, CostPolicy
from mmcache.core.entry import Entry, State
from mmcache.core.policy import make_policy
from mmcache.errors import InvalidValueError


def _entry(key: Hashable, nbytes: int, cost: float | None = None) -> Entry:
    return Entry(key, (nbytes,), torch.uint8, nbytes, State.GPU, None, TimedFence(0), cost=cost)


def _cached(cache: FeatureCache, key: Hashable) -> Entry:
    """The entry the cache holds key in (a feature put on its own)."""
    entry = cache._core.index[key]
    assert isinstance(entry, Entry)
    return entry


def test_priority_is_the_clock_plus_hits_times_seconds_per_byte() -> None:
    policy = make_policy("cost")
    assert isinstance(policy, CostPolicy)
    policy["image"] = _entry("image", 1_000, cost=0.005)  # 5 µs a byte
    policy["clip"] = _entry("clip", 8_000, cost=0.080)  # 10 µs a byte
    policy["free"] = _entry("free", 10, cost=0.0)
    assert policy.priority("image") == pytest.approx(5e-6)
    assert policy.priority("clip") == pytest.approx(1e-5)
    policy.touch("image")
    policy.touch("image")
    assert policy.priority("image") == pytest.approx(3 * 5e-6)
    assert policy.evict().key == "free"
    assert policy.clock == 0
    assert policy.evict().key == "clip"
    assert policy.clock == pytest.approx(1e-5)
    # A newcomer's priority starts from the clock: what was evicted ages what stays.
    policy["late"] = _entry("late", 1_000, cost=0.001)
    assert policy.priority("late") == pytest.approx(1e-5 + 1e-6)
    policy.touch("image")  # from the clock too: 1e-5 + 4 hits x 5e-6
    assert policy.priority("image") == pytest.approx(1e-5 + 4 * 5e-6)
    assert [policy.evict().key for _ in range(2)] == ["late", "image"]
    assert policy.clock == pytest.approx(3e-5)


def test_an_expensive_entry_left_unused_ages_out() -> None:
    policy = CostPolicy()
    policy["old"] = _entry("old", 1_000, cost=0.0105)  # 10.5 µs a byte, never used again
    victims = []
    for i in range(12):  # a newcomer (1 µs a byte) comes in, then one entry goes
        policy[i] = _entry(i, 1_000, cost=0.001)
        victims.append(policy.evict().key)
    # Newcomer i has priority (i + 1) µs a byte: the old entry goes once the clock nears it.
    assert victims == [*range(10), "old", 10]


def test_uncosted_entries_are_charged_the_mean_rate_of_costed_ones() -> None:
    policy = CostPolicy()
    policy["big"] = _entry("big", 1_000_000)
    policy["small"] = _entry("small", 10)
    assert policy.priority("small") == policy.priority("big") == FIRST_SECONDS_PER_BYTE
    policy.touch("big")
    victim = policy.next_victim()
    assert victim is not None and victim.key == "small"  # by hits, whatever their sizes
    policy.pop("small", None)
    policy["a"] = _entry("a", 1_000, cost=0.01)
    policy["b"] = _entry("b", 3_000, cost=0.05)
    policy["plain"] = _entry("plain", 500)
    assert policy.priority("plain") == pytest.approx(0.06 / 4_000)  # seconds over bytes given


def test_next_victim_skips_removed_and_touched_items() -> None:
    policy = CostPolicy()
    for key, cost in (("a", 1.5), ("b", 2.0), ("c", 3.0)):
        policy[key] = _entry(key, 100, cost=cost)
    policy.touch("a")
    policy.touch("a")  # a: 3 x 0.015 a byte, above c's 0.03
    assert policy.pop("b", None) is not None
    victim = policy.next_victim()
    assert victim is not None and victim.key == "c"
    assert policy.evict() is victim
    policy["a"] = replaced = _entry("a", 100, cost=0.0)  # a new entry under a's key
    assert len(policy) == 1
    assert policy.evict() is replaced
    assert policy.next_victim() is None
    with pytest.raises(KeyError):
        policy.evict()


def test_touches_do_not_grow_the_heap_without_bound() -> None:
    policy = CostPolicy()
    for key in range(10):
        policy[key] = _entry(key, 100, cost=0.5)
    for i in range(10_000):
        policy.touch(i % 3)
    assert len(policy._heap) <= 2 * len(policy) + 64
    # 0 had one touch more than 1 and 2 (10,000 = 3,334 + 3,333 + 3,333); 1's last is older.
    assert [policy.evict().key for _ in range(10)] == [*range(3, 10), 1, 2, 0]


async def test_an_expensive_small_feature_outlives_cheap_ones(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """16 KiB that took a second to encode stays where LRU would drop it for 64 KiB of cheap."""
    kept: dict[str, list[str]] = {}
    for name in ("lru", "cost"):
        cache = make_cache(gpu_mb=(16 + 2 * 64) / 1024, cpu_mb=0, eviction_policy=name)
        expensive = feature(rig, 16)
        assert await cache.put("expensive", expensive, cost=1.0)
        del expensive
        for key in ("cheap1", "cheap2"):
            t = feature(rig, 64)
            assert await cache.put(key, t, cost=0.001)
            del t
        for key in ("cheap1", "cheap2"):  # the expensive feature is now the least recent
            assert await cache.get(key) is not None
        await put_feature(cache, rig, "new", 64)
        kept[name] = [key for key in ("expensive", "cheap1", "cheap2", "new") if key in cache]
    assert kept == {"lru": ["cheap2", "new"], "cost": ["expensive", "cheap2", "new"]}


@pytest.mark.parametrize(("name", "kept"), [("lru", "bcd"), ("cost", "acd")])
async def test_the_cost_goes_with_the_feature_to_the_host_tier(
    rig: Rig, make_cache: CacheFactory, name: str, kept: str
) -> None:
    # One feature fits the GPU tier, two the host tier; host reads never promote. One cache
    # per test: a GPU's host arena is pinned once per device.
    cache = make_cache(
        gpu_mb=64 / 1024, cpu_mb=2 * 64 / 1024, eviction_policy=name, promote_on_hit=False
    )
    assert await cache.wait_host_ready(10)
    for key, cost in (("a", 1.0), ("b", 0.001), ("c", 0.001)):  # a, then b go to the host
        t = feature(rig, 64)
        assert await cache.put(key, t, cost=cost)
        del t
        await cache.drain()
    assert await cache.get("b", device="cpu") is not None  # a is the least recent
    await put_feature(cache, rig, "d", 64)  # c is offloaded: the host tier gives one up
    await cache.drain()
    assert cache.stats().evictions_cpu == 1
    assert "".join(key for key in "abcd" if key in cache) == kept


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, -math.inf, "1", True, 10**400])
async def test_put_refuses_a_cost_that_is_not_seconds(
    rig: Rig, make_cache: CacheFactory, bad: object
) -> None:
    cache = make_cache(eviction_policy="cost")
    t = feature(rig, 4)
    with pytest.raises(InvalidValueError, match=r"cost must be a finite number of seconds >= 0"):
        await cache.put("k", t, cost=bad)  # type: ignore[arg-type]
    assert "k" not in cache
    for good in (0, 2, 0.25):
        assert await cache.put(f"k{good}", feature(rig, 4), cost=good)
    assert len(cache) == 3


async def test_get_or_compute_puts_the_time_fn_took_as_the_cost(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=3 * 64 / 1024, cpu_mb=0, eviction_policy="cost")

    async def slow() -> torch.Tensor:
        await asyncio.sleep(0.05)
        return feature(rig, 64)

    def blocking() -> torch.Tensor:
        time.sleep(0.02)
        return feature(rig, 64)

    await cache.get_or_compute("slow", slow)
    await cache.get_or_compute("blocking", blocking)
    await cache.get_or_compute("fast", lambda: feature(rig, 64))
    costs = {key: _cached(cache, key).cost for key in ("slow", "blocking", "fast")}
    assert costs["slow"] is not None and 0.05 <= costs["slow"] < 5
    assert costs["blocking"] is not None and 0.02 <= costs["blocking"] < costs["slow"]
    assert costs["fast"] is not None and 0 <= costs["fast"] < costs["blocking"]
    for key in ("blocking", "fast", "fast"):  # slow becomes the least recent and least used
        assert await cache.get(key) is not None
    await put_feature(cache, rig, "new", 64)  # uncosted: the mean rate of the three
    assert [key for key in ("slow", "blocking", "fast", "new") if key in cache] == [
        "slow",
        "blocking",
        "new",
    ]


async def test_the_setting_cost_from_the_environment_orders_both_tiers(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MMCACHE_EVICTION_POLICY", "cost")
    monkeypatch.setenv("MMCACHE_GPU_CACHE_MB", str(2 * 64 / 1024))
    monkeypatch.setenv("MMCACHE_CPU_CACHE_MB", "1")
    monkeypatch.setenv("MMCACHE_EVICT_AHEAD", "0")
    settings = CacheSettings()
    assert settings.eviction_policy == "cost"
    async with FeatureCache(settings, device=rig.device, registry=CollectorRegistry()) as cache:
        assert isinstance(cache._core.state.gpu_order, CostPolicy)
        assert isinstance(cache._core.state.host_order, CostPolicy)
        for key, cost in (("expensive", 1.0), ("cheap1", 0.001), ("cheap2", 0.001)):
            t = feature(rig, 64)
            assert await cache.put(key, t, cost=cost)
            del t
        await cache.drain()
        # The first put, the expensive feature kept its GPU place; a cheap one made room.
        assert [_cached(cache, key).state for key in ("expensive", "cheap1", "cheap2")] == [
            State.GPU,
            State.HOST,
            State.GPU,
        ]
