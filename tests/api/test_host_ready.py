"""The host arena pins in the background: the GPU tier serves meanwhile, and stats() says when."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, feature, put_feature
from ipc_support import settled_bytes
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache
from mmcache.device import Device, SimDevice
from mmcache.device.base import ArenaProgress


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

    rig.device.host_arena = later  # type: ignore[method-assign]
    try:
        cache = make_cache(gpu_mb=0, cpu_mb=4)
        await cache.start()
        assert not cache.stats().host_ready
        yield cache, pending
    finally:
        del rig.device.host_arena
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
        pending[0].set_result(rig.device._host_arena(cache.stats().cpu_capacity_bytes))
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


# --- an arena that pins chunk by chunk ---------------------------------------------------

MiB = 1 << 20


def pinning_sim(chunk_s: float) -> SimDevice:
    """A simulator whose host arena pins in 1 MiB chunks, each chunk_s long."""
    return SimDevice(pin_chunk_bytes=MiB, pin_chunk_s=chunk_s)


def chunked_cache(device: Device, gpu_mb: float, cpu_mb: float) -> FeatureCache:
    settings = CacheSettings(gpu_cache_mb=gpu_mb, cpu_cache_mb=cpu_mb, evict_ahead=0)
    return FeatureCache(settings, device, registry=CollectorRegistry())


async def pinned_at_least(cache: FeatureCache, nbytes: int, timeout: float = 10) -> int:  # noqa: ASYNC109
    """Wait until the cache's host tier serves nbytes of its arena; what it serves then."""
    async with asyncio.timeout(timeout):
        while True:
            served = cache.stats().host_ready_bytes
            if served >= nbytes:
                return served
            await asyncio.sleep(0.005)


async def test_evictions_go_to_the_chunks_already_pinned() -> None:
    """A cache that takes traffic while its arena pins offloads into the pinned chunks
    instead of dropping what it evicts; wait_host_ready still means the whole arena."""
    device = pinning_sim(chunk_s=0.2)  # 8 chunks: the whole arena in about 1.6 s
    registry = CollectorRegistry()
    settings = CacheSettings(gpu_cache_mb=1, cpu_cache_mb=8, evict_ahead=0)
    rig = Rig(device, "sim")
    try:
        async with FeatureCache(settings, device, registry=registry) as cache:
            assert cache.stats().host_ready_bytes == 0  # nothing pinned yet
            # 16 features of 64 KiB fill the GPU tier; the next 16 are evicted.
            want = {k: await put_feature(cache, rig, k, 64, seed=k) for k in range(16)}
            await asyncio.sleep(0.5)  # a chunk or two pinned, far from all eight
            want |= {k: await put_feature(cache, rig, k, 64, seed=k) for k in range(16, 32)}
            await cache.drain()
            s = cache.stats()
            assert (s.dropped, s.gpu_entries, s.cpu_entries) == (0, 16, 16)
            assert not s.host_ready and MiB <= s.host_ready_bytes < 8 * MiB
            assert s.cpu_capacity_bytes == 8 * MiB
            gauge = registry.get_sample_value("mmcache_host_ready_bytes", {"cache": "default"})
            assert gauge == s.host_ready_bytes
            for k, value in want.items():
                assert_exact(await cache.get(k, device="cpu"), value)
            assert await cache.wait_host_ready(timeout=10)
            s = cache.stats()
            assert s.host_ready and s.host_ready_bytes == 8 * MiB and s.leaked_bytes == 0
            gauge = registry.get_sample_value("mmcache_host_ready_bytes", {"cache": "default"})
            assert gauge == 8 * MiB
            del want, value
    finally:
        device.close()
    assert device.pinned_bytes == 0


@pytest.mark.cuda
async def test_evictions_go_to_the_chunks_already_pinned_on_a_gpu() -> None:
    """The same on a GPU: 1 MiB features offload into 8 MiB registrations (blocks cross
    their edges, copies are split there) while a 16 GiB arena is still pinning."""
    from mmcache.device.cuda import CudaDevice

    device = CudaDevice(0)  # pins in the background, the default
    settings = CacheSettings(gpu_cache_mb=64, cpu_cache_mb=16384, evict_ahead=0)
    try:
        async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
            await pinned_at_least(cache, 128 * MiB, timeout=60)
            assert not cache.stats().host_ready
            rig = Rig(device, "cuda")
            want = {k: await put_feature(cache, rig, k, 1024, seed=k) for k in range(128)}
            await cache.drain()
            s = cache.stats()
            assert (s.dropped, s.gpu_entries, s.cpu_entries) == (0, 64, 64)
            for k, value in want.items():
                assert_exact(await cache.get(k, device="cpu"), value)
            assert cache.stats().leaked_bytes == 0
            del want, value
    finally:
        device.close()  # stops the pinning and unpins


async def test_with_the_gpu_tier_off_a_put_waits_for_enough_pinned_room() -> None:
    device = pinning_sim(chunk_s=0.15)
    try:
        async with chunked_cache(device, gpu_mb=0, cpu_mb=4) as cache:
            rig = Rig(device, "sim")
            small, large = feature(rig, 64, seed=1), feature(rig, 1536, seed=2)
            want_small, want_large = small.clone(), large.clone()
            put_small = asyncio.ensure_future(cache.put("small", small))
            put_large = asyncio.ensure_future(cache.put("large", large))
            del small, large
            assert await asyncio.wait_for(put_small, 10)
            assert await asyncio.wait_for(put_large, 10)
            # 1.5 MiB waited in line for a second chunk (and the small put behind it).
            assert cache.stats().host_ready_bytes >= 2 * MiB
            assert_exact(await cache.get("small", device="cpu"), want_small)
            assert_exact(await cache.get("large", device="cpu"), want_large)
            await cache.drain()
            s = cache.stats()
            assert (s.cpu_entries, s.dropped, s.rejected, s.leaked_bytes) == (2, 0, 0, 0)
    finally:
        device.close()


async def test_close_during_chunked_pinning_stops_it_and_frees_everything() -> None:
    device = pinning_sim(chunk_s=0.2)  # 64 chunks: about 13 s to pin it all
    baseline = device.allocated_bytes
    cache = chunked_cache(device, gpu_mb=1, cpu_mb=64)
    await cache.start()
    await pinned_at_least(cache, MiB)
    rig = Rig(device, "sim")
    for k in range(24):
        await put_feature(cache, rig, k, 64, seed=k)
    await cache.drain()
    s = cache.stats()
    assert (s.cpu_entries, s.dropped, s.leaked_bytes) == (8, 0, 0)
    waiting = asyncio.ensure_future(cache.wait_host_ready())
    await asyncio.sleep(0.01)
    await cache.close(timeout=10)
    assert await asyncio.wait_for(waiting, 1) is False  # not left waiting for ever
    assert cache.stats().leaked_bytes == 0
    started = asyncio.get_running_loop().time()
    device.close()  # stops the pinning at its next chunk and unpins what it pinned
    assert asyncio.get_running_loop().time() - started < 1.0
    assert device.pinned_bytes == 0
    assert await settled_bytes(rig, baseline) == baseline
    await asyncio.sleep(0.05)  # a last report of the pinning thread finds the cache closed


@contextlib.contextmanager
def pinned_in_part(device: Device) -> Iterator[Callable[[], None]]:
    """The device's next arena reports its first MiB pinned at once; calling what this
    yields then fails the rest (the host ran out of lockable memory, say)."""
    finish: list[Callable[[], None]] = []

    def half(nbytes: int, on_pinned: ArenaProgress | None = None) -> Future[torch.Tensor]:
        future: Future[torch.Tensor] = Future()
        assert on_pinned is not None
        on_pinned(device._host_arena(nbytes), MiB)
        finish.append(lambda: future.set_exception(MemoryError("cannot pin more")))
        return future

    device.host_arena = half  # type: ignore[method-assign]
    try:
        yield lambda: finish[0]()
    finally:
        del device.host_arena


async def test_an_arena_pinned_only_in_part_keeps_serving_what_was_pinned(
    sim_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    """Pinning that fails half-way leaves the chunks already pinned serving; the tier
    ends there and wait_host_ready says False."""
    with pinned_in_part(sim_rig.device) as fail_the_rest:
        with caplog.at_level(logging.ERROR, logger="mmcache"):
            async with chunked_cache(sim_rig.device, gpu_mb=1, cpu_mb=4) as cache:
                await pinned_at_least(cache, MiB)
                fail_the_rest()
                assert not await cache.wait_host_ready(5)
                assert "pinned only in part" in caplog.text
                s = cache.stats()
                assert (s.host_ready, s.host_ready_bytes, s.cpu_capacity_bytes) == (
                    False,
                    MiB,
                    MiB,
                )
                want = {k: await put_feature(cache, sim_rig, k, 64, seed=k) for k in range(48)}
                await cache.drain()
                s = cache.stats()
                # 16 on the GPU tier, 16 in the pinned MiB, the oldest 16 given up for room.
                assert (s.gpu_entries, s.cpu_entries, s.evictions_cpu) == (16, 16, 16)
                for k in range(16, 48):
                    assert_exact(await cache.get(k, device="cpu"), want[k])
                assert cache.stats().leaked_bytes == 0
                del want


async def test_with_the_gpu_tier_off_a_put_the_partial_arena_cannot_hold_gives_up(
    sim_rig: Rig,
) -> None:
    with pinned_in_part(sim_rig.device) as fail_the_rest:
        async with chunked_cache(sim_rig.device, gpu_mb=0, cpu_mb=4) as cache:
            await pinned_at_least(cache, MiB)
            large = asyncio.ensure_future(cache.put("large", feature(sim_rig, 2048)))
            await asyncio.sleep(0.05)
            assert not large.done()  # waits for more of the arena
            fail_the_rest()
            assert await asyncio.wait_for(large, 5) is False  # never comes: gives up
            want = await put_feature(cache, sim_rig, "small", 64)
            assert_exact(await cache.get("small", device="cpu"), want)
            s = cache.stats()
            assert (len(cache), s.leaked_bytes) == (1, 0)


class PaceReports(list[tuple[int, bool]]):
    """Each report of an arena, (ready bytes, whether the cache asked for the next chunk
    at once), as the pinning thread gets it; while held is clear, the next report waits."""

    def __init__(self) -> None:
        super().__init__()
        self.held = threading.Event()
        self.held.set()


@contextlib.contextmanager
def pace_reports(device: Device) -> Iterator[PaceReports]:
    """The reports of the device's next arena."""
    reports = PaceReports()
    pin = device.host_arena

    def host_arena(nbytes: int, on_pinned: ArenaProgress | None = None) -> Future[torch.Tensor]:
        assert on_pinned is not None

        def report(arena: torch.Tensor, ready: int) -> bool:
            reports.held.wait(10)
            hurry = on_pinned(arena, ready)
            reports.append((ready, hurry))
            return hurry

        return pin(nbytes, report)

    device.host_arena = host_arena  # type: ignore[method-assign]
    try:
        yield reports
    finally:
        del device.host_arena


@contextlib.asynccontextmanager
async def paced_cache(gpu_mb: float) -> AsyncIterator[tuple[FeatureCache, PaceReports, Rig]]:
    """A cache of a 16 MiB host tier on a simulator that pins it in 1 MiB chunks of
    10 ms, with the reports of its arena (4 MiB of headroom: a quarter of it)."""
    device = pinning_sim(chunk_s=0.01)
    try:
        with pace_reports(device) as reports:
            async with chunked_cache(device, gpu_mb=gpu_mb, cpu_mb=16) as cache:
                yield cache, reports, Rig(device, "sim")
    finally:
        device.close()


async def next_report(reports: list[tuple[int, bool]], timeout: float = 5) -> tuple[int, bool]:  # noqa: ASYNC109
    seen = len(reports)
    async with asyncio.timeout(timeout):
        while True:
            if len(reports) > seen:
                return reports[seen]
            await asyncio.sleep(0.002)


async def reported_at_least(reports: list[tuple[int, bool]], nbytes: int) -> None:
    """Wait until the pinning thread has recorded a report of nbytes or more."""
    async with asyncio.timeout(10):
        while True:
            if reports and reports[-1][0] >= nbytes:
                return
            await asyncio.sleep(0.002)


async def test_an_idle_cache_pins_at_the_devices_pace_once_room_is_ahead() -> None:
    """Pinning holds the driver lock an engine's launches wait for: once a quarter of the
    arena is pinned and free, an idle cache lets the rest pin at PIN_PACE; someone waiting
    for the whole arena has it pinned at full speed again."""
    async with paced_cache(gpu_mb=1) as (cache, reports, _):
        await reported_at_least(reports, 6 * MiB)
        assert all(hurry for ready, hurry in reports if ready < 4 * MiB)
        assert [hurry for ready, hurry in reports if 5 * MiB <= ready <= 6 * MiB] == [
            False,
            False,
        ]
        waiting = asyncio.create_task(cache.wait_host_ready(timeout=10))
        await asyncio.sleep(0)  # the wait has begun: every later report hurries
        after = len(reports) + 1  # a report may be on its way already
        assert await waiting
        assert reports[-1][0] == 16 * MiB
        assert all(hurry for _, hurry in reports[after:])


async def test_puts_that_use_the_pinned_room_make_the_arena_pin_at_full_speed() -> None:
    async with paced_cache(gpu_mb=0) as (cache, reports, rig):
        await pinned_at_least(cache, 5 * MiB)
        assert (await next_report(reports))[1] is False  # 4 MiB or more free ahead
        reports.held.clear()  # no report while the puts run: the next sees them all
        try:
            for k in range(8):  # 4 MiB to the host tier: less than a quarter left free
                await put_feature(cache, rig, k, 512, seed=k)
            assert cache.stats().cpu_bytes == 4 * MiB
        finally:
            reports.held.set()
        assert (await next_report(reports))[1] is True


async def test_a_put_waiting_for_host_room_makes_the_arena_pin_at_full_speed() -> None:
    async with paced_cache(gpu_mb=0) as (cache, reports, rig):
        await pinned_at_least(cache, 5 * MiB)
        ready, hurry = await next_report(reports)
        assert hurry is False
        reports.held.clear()  # the next report waits until the put waits
        # 3 MiB more than is pinned, all at once or none: the put waits.
        wanted = min(ready + 3 * MiB, 16 * MiB)
        items = [(k, feature(rig, 512, seed=k)) for k in range(wanted // (512 << 10))]
        putting = asyncio.create_task(cache.put_many(items))
        await asyncio.sleep(0.05)
        assert not putting.done()
        after = len(reports)
        reports.held.set()
        assert await asyncio.wait_for(putting, 10)
        waited = [hurry for ready, hurry in reports[after:] if ready < wanted]
        assert waited and all(waited)
