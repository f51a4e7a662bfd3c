"""The host arena pins in the background: the GPU tier serves meanwhile, and stats() says when."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from concurrent.futures import Future

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, feature
from prometheus_client import CollectorRegistry
from test_ipc_support import settled_bytes

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


@contextlib.asynccontextmanager
async def cache_awaiting_its_arena(
    rig: Rig, make_cache: CacheFactory
) -> AsyncIterator[tuple[FeatureCache, list[Future[torch.Tensor]]]]:
    """A started cache, GPU tier off, whose host arena comes when the test completes the
    future; the device's memory must be back where it was once the block is left."""
    baseline = rig.allocated_bytes()
    pending: list[Future[torch.Tensor]] = []

    def later(nbytes: int, on_pinned: object = None) -> Future[torch.Tensor]:
        pending.append(Future())
        return pending[-1]

    rig.device.host_arena_async = later  # type: ignore[method-assign]
    try:
        cache = make_cache(gpu_mb=0, cpu_mb=4)
        await cache.start()
        assert not cache.stats().host_ready
        yield cache, pending
    finally:
        del rig.device.host_arena_async
    assert await settled_bytes(rig, baseline) == baseline


async def test_with_the_gpu_tier_off_puts_wait_for_the_arena(
    rig: Rig, make_cache: CacheFactory
) -> None:
    async with cache_awaiting_its_arena(rig, make_cache) as (cache, pending):
        assert not await cache.put("now", feature(rig, 64), wait=False)
        assert cache.stats().rejected == 1 and "now" not in cache
        want = {k: feature(rig, 64, seed=k) for k in range(6)}
        batch = torch.cat([want[3], want[4], want[5]])
        puts = [
            asyncio.ensure_future(cache.put(0, want[0].clone())),
            asyncio.ensure_future(cache.put_many([(k, want[k].clone()) for k in (1, 2)])),
            asyncio.ensure_future(cache.put_split([3, 4, 5], batch, [64, 64, 64])),
        ]
        del batch
        await asyncio.sleep(0.05)
        assert not any(put.done() for put in puts)  # waiting for host room, holding nothing
        assert len(cache) == 0
        pending[0].set_result(rig.device.host_arena(cache.stats().cpu_capacity_bytes))
        assert await asyncio.wait_for(asyncio.gather(*puts), 10) == [True, True, True]
        for k, value in want.items():
            assert_exact(await cache.get(k, device="cpu"), value)
        await cache.drain()
        s = cache.stats()
        assert (s.cpu_entries, s.gpu_entries, s.dropped, s.leaked_bytes) == (6, 0, 0, 0)
        del want, value


async def test_with_the_gpu_tier_off_a_failed_arena_refuses_puts(
    rig: Rig, make_cache: CacheFactory
) -> None:
    async with cache_awaiting_its_arena(rig, make_cache) as (cache, pending):
        waiting = asyncio.ensure_future(cache.put_many([(k, feature(rig, 64)) for k in range(2)]))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        pending[0].set_exception(MemoryError("cannot pin"))
        assert await asyncio.wait_for(waiting, 10) is False  # given up, not waiting for ever
        assert await cache.put("later", feature(rig, 64)) is False
        assert not await cache.wait_host_ready(0.1)
        s = cache.stats()
        assert (len(cache), s.rejected, s.leaked_bytes) == (0, 3, 0)
