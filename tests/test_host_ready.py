"""The host arena pins in the background: the GPU tier serves meanwhile, and stats() says when."""

from __future__ import annotations

import pytest
import torch
from conftest import CacheFactory, Rig
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache


async def test_wait_host_ready_on_a_ready_arena(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=1)
    assert await cache.wait_host_ready(timeout=30)
    assert cache.stats().host_ready


async def test_host_tier_off_is_ready_at_once(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=1, cpu_mb=0)
    assert await cache.wait_host_ready(timeout=0.01)


@pytest.mark.cuda
async def test_background_pinning_serves_the_gpu_tier_meanwhile() -> None:
    from mmcache.device.cuda import CudaDevice

    device = CudaDevice(0)  # pins in the background, the default
    settings = CacheSettings(gpu_cache_mb=64, cpu_cache_mb=2048)  # ~1 s of pinning
    async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
        assert not cache.stats().host_ready
        t = torch.randn(1024, 1024, device="cuda:0")
        want = t.clone()
        await cache.put("early", t)
        del t
        got = await cache.get("early")
        assert got is not None and torch.equal(got, want)
        assert await cache.wait_host_ready(timeout=60)
        assert cache.stats().host_ready
    device.close()
