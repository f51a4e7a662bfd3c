"""Eviction policies: which entry goes first under a scripted access pattern, per policy.

The pattern: put a, b, c; hit c three times, then b, then a. Least recently used is
c, least frequently used is b (a and b have as many uses; b's is older), first put is a.
Features put without a cost, all of one size, weigh the same per byte for the cost
policy, which then orders them as LFU does (test_cost_policy.py tests costs).
"""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch
from conftest import CacheFactory, Rig, TimedFence, put_feature

from mmcache.core.entry import Entry, State
from mmcache.core.policy import POLICY_NAMES, LruPolicy, make_policy

FIRST_VICTIM = {"lru": "c", "lfu": "b", "fifo": "a", "cost": "b"}
VICTIM_ORDER = {
    "lru": ["c", "b", "a"],
    "lfu": ["b", "a", "c"],
    "fifo": ["a", "b", "c"],
    "cost": ["b", "a", "c"],
}
HITS = ["c", "c", "c", "b", "a"]


def _entry(key: Hashable) -> Entry:
    return Entry(key, (1,), torch.uint8, 1, State.GPU, None, TimedFence(0))


def test_every_setting_value_has_a_policy() -> None:
    assert set(POLICY_NAMES) == set(FIRST_VICTIM)
    assert isinstance(make_policy("lru"), LruPolicy)
    with pytest.raises(ValueError, match="lru, lfu, fifo"):
        make_policy("random")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_gives_up_entries_in_its_order(name: str) -> None:
    policy = make_policy(name)
    for key in "abc":
        policy[key] = _entry(key)
    for key in HITS:
        policy.touch(key)
    assert len(policy) == 3
    peek = policy.next_victim()
    order = [policy.evict().key for _ in range(3)]
    assert order == VICTIM_ORDER[name]
    assert peek is None or peek.key == order[0]
    assert len(policy) == 0
    with pytest.raises(KeyError):
        policy.evict()


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_removed_entries_are_never_victims(name: str) -> None:
    policy = make_policy(name)
    for key in "abc":
        policy[key] = _entry(key)
    removed = policy.pop("a", None)
    assert removed is not None and removed.key == "a"
    assert policy.pop("a", None) is None
    assert [policy.evict().key for _ in range(2)] == ["b", "c"]


@pytest.mark.parametrize("name", POLICY_NAMES)
async def test_gpu_tier_evicts_by_its_policy(rig: Rig, make_cache: CacheFactory, name: str) -> None:
    # Three 64 KiB features fill the GPU tier; no host tier: the victim is dropped.
    cache = make_cache(gpu_mb=3 * 64 / 1024, cpu_mb=0, eviction_policy=name)
    for key in "abc":
        await put_feature(cache, rig, key, 64)
    for key in HITS:
        assert await cache.get(key) is not None
    await put_feature(cache, rig, "d", 64)
    gone = [key for key in "abcd" if key not in cache]
    assert gone == [FIRST_VICTIM[name]]
    assert cache.stats().evictions_gpu == 1


@pytest.mark.parametrize("name", POLICY_NAMES)
async def test_host_tier_evicts_by_its_policy(
    rig: Rig, make_cache: CacheFactory, name: str
) -> None:
    # One feature fits the GPU tier, three the host tier; host reads never promote.
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=3 * 64 / 1024, eviction_policy=name)
    assert await cache.wait_host_ready(10)
    for key in "abcd":  # a, b, c go to the host tier in this order
        await put_feature(cache, rig, key, 64)
        await cache.drain()
    for key in HITS:
        assert await cache.get(key, device="cpu") is not None
    assert cache.stats().hits_cpu == len(HITS)
    await put_feature(cache, rig, "e", 64)  # d is offloaded: the host tier gives one up
    await cache.drain()
    gone = [key for key in "abcde" if key not in cache]
    assert gone == [FIRST_VICTIM[name]]
    assert cache.stats().evictions_cpu == 1
