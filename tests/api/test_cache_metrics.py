"""The cache pushes its figures to Prometheus: each metric moves when it should."""

from __future__ import annotations

import asyncio

from conftest import Rig
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache

KiB32 = 32 / 1024


def _value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, {"cache": "t", **labels})
    return 0.0 if v is None else v


def _cache(rig: Rig, reg: CollectorRegistry, gpu_mb: float = KiB32) -> FeatureCache:
    settings = CacheSettings(gpu_cache_mb=gpu_mb, cpu_cache_mb=1, evict_ahead=0)
    return FeatureCache(settings, rig.device, name="t", registry=reg)


async def test_held_offload_shows_as_pending_copy(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    async with _cache(sim_rig, reg) as cache:
        await cache.put("a", sim_rig.tensor(64, 256))
        with sim_rig.hold():
            put_b = asyncio.create_task(cache.put("b", sim_rig.tensor(64, 256, seed=1)))
            await asyncio.sleep(0.01)
            assert _value(reg, "mmcache_pending_copies", direction="d2h") == 1
            assert not put_b.done()
        await put_b
        await cache.drain()
        assert _value(reg, "mmcache_pending_copies", direction="d2h") == 0
        s = cache.stats()
        assert _value(reg, "mmcache_copy_bytes_total", direction="d2h") == s.d2h_bytes > 0
        assert _value(reg, "mmcache_copy_duration_seconds_count", direction="d2h") == 1
        assert _value(reg, "mmcache_evictions_total", tier="gpu") == 1


async def test_lookups_tiers_and_get_wait(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    async with _cache(sim_rig, reg) as cache:
        await cache.put("a", sim_rig.tensor(64, 256))
        assert await cache.get("a") is not None
        assert await cache.get("missing") is None
        with sim_rig.hold():
            put_b = asyncio.create_task(cache.put("b", sim_rig.tensor(64, 256, seed=1)))
            await asyncio.sleep(0.005)
            reader = asyncio.create_task(cache.get("a", device="cpu"))  # waits on the copy
            await asyncio.sleep(0.01)
        await reader
        await put_b
        await cache.drain()
        assert await cache.get("a", device="cpu") is not None  # a host hit
        assert _value(reg, "mmcache_lookups_total", result="hit_gpu") == 2
        assert _value(reg, "mmcache_lookups_total", result="hit_cpu") == 1
        assert _value(reg, "mmcache_lookups_total", result="miss") == 1
        assert _value(reg, "mmcache_get_wait_seconds_count") >= 1
        s = cache.stats()
        assert _value(reg, "mmcache_tier_bytes", tier="gpu") == s.gpu_bytes
        assert _value(reg, "mmcache_tier_bytes", tier="cpu") == s.cpu_bytes
        assert _value(reg, "mmcache_tier_entries", tier="cpu") == s.cpu_entries == 1
        assert _value(reg, "mmcache_tier_capacity_bytes", tier="gpu") == s.gpu_capacity_bytes


async def test_tier_gauges_follow_puts_without_stats(rig: Rig) -> None:
    # stats() pushes the gauges itself: here only the puts' own pushes may move them.
    reg = CollectorRegistry()
    async with _cache(rig, reg, gpu_mb=1) as cache:
        await cache.put("b", rig.tensor(64, 128, seed=1)[:, :64])  # a view: the general path
        await asyncio.sleep(0.01)
        await cache.put("a", rig.tensor(64, 256))  # 32 KiB, a new key: the short path
        await asyncio.sleep(0.01)  # the push runs once the loop turns
        assert _value(reg, "mmcache_tier_bytes", tier="gpu") == 32768 + 8192  # bf16
        assert _value(reg, "mmcache_tier_entries", tier="gpu") == 2


async def test_dropped_and_fault_counters(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    settings = CacheSettings(gpu_cache_mb=KiB32, cpu_cache_mb=0, evict_ahead=0)
    async with FeatureCache(settings, sim_rig.device, name="t", registry=reg) as cache:
        await cache.put("a", sim_rig.tensor(64, 256))
        await cache.put("b", sim_rig.tensor(64, 256, seed=1))  # no host tier: "a" is dropped
        assert _value(reg, "mmcache_dropped_total") == 1
    reg2 = CollectorRegistry()
    async with _cache(sim_rig, reg2) as cache:
        await cache.put("a", sim_rig.tensor(64, 256))
        sim_rig.device.inject("copy_fails")  # type: ignore[attr-defined]
        await cache.put("b", sim_rig.tensor(64, 256, seed=1))
        await cache.drain()
        assert "a" not in cache
        assert (
            reg2.get_sample_value("mmcache_faults_total", {"cache": "t", "kind": "copy_failed"})
            == 1
        )


async def test_close_removes_the_caches_series(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    other = FeatureCache(
        CacheSettings(gpu_cache_mb=1, cpu_cache_mb=1), sim_rig.device, name="other", registry=reg
    )
    async with other:
        async with _cache(sim_rig, reg) as cache:
            await cache.put("a", sim_rig.tensor(8, 8))
            await cache.get("a")
            assert _value(reg, "mmcache_lookups_total", result="hit_gpu") == 1
        assert (
            reg.get_sample_value("mmcache_lookups_total", {"cache": "t", "result": "hit_gpu"})
            is None
        )
        assert reg.get_sample_value("mmcache_tier_bytes", {"cache": "t", "tier": "gpu"}) is None
        assert (
            reg.get_sample_value("mmcache_tier_capacity_bytes", {"cache": "other", "tier": "gpu"})
            == 2**20
        )


async def test_metrics_port_setting_serves_the_default_registry(sim_rig: Rig) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = CacheSettings(
        gpu_cache_mb=1, cpu_cache_mb=1, metrics_port=port, metrics_addr="127.0.0.1"
    )
    async with FeatureCache(settings, sim_rig.device, name="served") as cache:
        await cache.get("nothing")
        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
    assert b'mmcache_lookups_total{cache="served",result="miss"} 1.0' in body
