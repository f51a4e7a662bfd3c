"""The offload race of the seed bug, on our API: no host read before its copy completes.

Each scenario runs against the real cache (it must see the original values) and
against deliberately broken variants that skip the fence (they must see poison),
so a race test that cannot fail would show here.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, feature, stall

import mmcache.core.reads
from mmcache import FeatureCache
from mmcache.device import SimDevice

ROWS, COLS = 64, 256  # 32 KiB in bf16
FEATURE_MB = ROWS * COLS * 2 / 2**20


async def _read_while_offload_is_held(
    rig: Rig, cache: FeatureCache, rows: slice | None, *, expect_pending: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Evict "a" under a hold, read it to the host while its copy is held; return (got, want).

    expect_pending=False is for broken variants, whose read resolves inside the hold.
    """
    t = rig.tensor(ROWS, COLS, seed=1)
    want = t.cpu().clone()
    await cache.put("a", t)
    del t
    with rig.hold():
        newcomer = asyncio.create_task(cache.put("b", rig.tensor(ROWS, COLS, seed=2)))
        await asyncio.sleep(0.01)  # "b" needs a's room: "a" is now offloading, held
        reader = asyncio.create_task(cache.get("a", device="cpu", rows=rows))
        await asyncio.sleep(0.02)
        pending = not reader.done()
    got = await reader
    await newcomer
    assert got is not None
    if rig.kind == "sim" and expect_pending:
        assert pending, "get(device='cpu') resolved while the offload copy was still held"
    return got, want if rows is None else want[rows]


@pytest.mark.parametrize("rows", [None, slice(5, 37)], ids=["whole", "rows"])
async def test_host_get_waits_for_held_offload(
    rig: Rig, make_cache: CacheFactory, rows: slice | None
) -> None:
    cache = make_cache(gpu_mb=FEATURE_MB, cpu_mb=1)
    got, want = await _read_while_offload_is_held(rig, cache, rows)
    assert torch.equal(got, want)
    assert not torch.isnan(got.float()).any()
    await cache.drain()
    assert cache.stats().leaked_bytes == 0


async def _no_wait(fences: object, timeout: object = None) -> float:  # noqa: ASYNC109
    return 0.0


@pytest.mark.parametrize("rows", [None, slice(5, 37)], ids=["whole", "rows"])
async def test_broken_variant_reader_skips_fence_sees_poison(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch, rows: slice | None
) -> None:
    from prometheus_client import CollectorRegistry

    from mmcache import CacheSettings

    monkeypatch.setattr(mmcache.core.reads, "wait_fences", _no_wait)
    settings = CacheSettings(gpu_cache_mb=FEATURE_MB, cpu_cache_mb=1)
    async with FeatureCache(settings, sim_rig.device, registry=CollectorRegistry()) as cache:
        got, want = await _read_while_offload_is_held(sim_rig, cache, rows, expect_pending=False)
    assert not torch.equal(got, want)
    assert torch.isnan(got.float()).all()  # the arena's poison, not plausible zeros


async def _evict_under_hold_then_read(
    rig: Rig, cache: FeatureCache, rows: slice | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Evict "a" while its copy is held, let everything run, then read it back to the host."""
    t = rig.tensor(ROWS, COLS, seed=5)
    want = t.cpu().clone()
    await cache.put("a", t)
    del t
    with rig.hold():
        newcomer = asyncio.create_task(cache.put("b", rig.tensor(ROWS, COLS, seed=6)))
        await asyncio.sleep(0.01)
    await newcomer
    rig.settle()
    got = await cache.get("a", device="cpu", rows=rows)
    assert got is not None
    return got, want if rows is None else want[rows]


@pytest.mark.parametrize("rows", [None, slice(5, 37)], ids=["whole", "rows"])
async def test_offloaded_source_outlives_its_held_copy(
    rig: Rig, make_cache: CacheFactory, rows: slice | None
) -> None:
    cache = make_cache(gpu_mb=FEATURE_MB, cpu_mb=1)
    got, want = await _evict_under_hold_then_read(rig, cache, rows)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [None, slice(5, 37)], ids=["whole", "rows"])
async def test_broken_variant_source_released_before_copy_sees_poison(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch, rows: slice | None
) -> None:
    """The seed bug: the copy's completion is not tracked, so the source is released at once."""
    from prometheus_client import CollectorRegistry

    from mmcache import CacheSettings
    from mmcache.core.offload import OffloadPipeline

    def untracked(self: OffloadPipeline, *, now: bool = False) -> None:
        while self._landing:  # every queued offload counts as landed at once
            offload, _ = self._landing.popitem(last=False)
            self._land(offload)

    monkeypatch.setattr(OffloadPipeline, "watch", untracked)
    settings = CacheSettings(gpu_cache_mb=FEATURE_MB, cpu_cache_mb=1)
    async with FeatureCache(settings, sim_rig.device, registry=CollectorRegistry()) as cache:
        got, want = await _evict_under_hold_then_read(sim_rig, cache, rows)
    assert not torch.equal(got, want)
    assert torch.isnan(got.float()).all()  # the copy read recycled (poisoned) device memory


async def test_device_get_during_offload_stays_valid_after_it(
    rig: Rig, make_cache: CacheFactory
) -> None:
    cache = make_cache(gpu_mb=FEATURE_MB, cpu_mb=1)
    t = rig.tensor(ROWS, COLS, seed=3)
    want = t.cpu().clone()
    await cache.put("a", t)
    del t
    with rig.hold():
        newcomer = asyncio.create_task(cache.put("b", rig.tensor(ROWS, COLS, seed=4)))
        await asyncio.sleep(0.01)
        on_device = await asyncio.wait_for(cache.get("a"), 1)  # still valid: returned at once
    await newcomer
    await cache.drain()
    assert on_device is not None
    assert cache.stats().cpu_entries == 1  # "a" really left the GPU tier
    assert torch.equal(on_device.cpu(), want)  # the caller's alias outlived the release


async def test_producer_still_writing_when_put_and_evicted(sim_rig: Rig) -> None:
    """put reads the producer's stream at entry: the offload waits for the producer."""
    from prometheus_client import CollectorRegistry

    from mmcache import CacheSettings

    dev = sim_rig.device
    assert isinstance(dev, SimDevice)
    producer = dev.stream("encoder")
    out = dev.empty((ROWS, COLS), torch.bfloat16)  # poison until the "kernel" writes it
    want = torch.full((ROWS, COLS), 2.5, dtype=torch.bfloat16)
    gate = threading.Event()

    def kernel(dst: torch.Tensor = out) -> None:  # bound now: the test drops its name below
        gate.wait(5)
        dst.copy_(want)

    dev.launch(producer, kernel)
    settings = CacheSettings(gpu_cache_mb=FEATURE_MB, cpu_cache_mb=1)
    async with FeatureCache(settings, dev, registry=CollectorRegistry()) as cache:
        with dev.use_stream(producer):
            await cache.put("a", out)
        dev.release(out, after=[])  # our own alias from empty(); the cache holds its own
        del out
        newcomer = asyncio.create_task(cache.put("b", sim_rig.tensor(ROWS, COLS)))
        reader = asyncio.create_task(cache.get("a", device="cpu"))
        await asyncio.sleep(0.02)
        assert not reader.done()
        gate.set()
        got = await reader
        await newcomer
    assert got is not None and torch.equal(got, want)


async def test_many_puts_behind_a_busy_producer_never_block_the_loop(
    rig: Rig, make_cache: CacheFactory
) -> None:
    """An encoder's stream runs a long kernel while the engine puts many features from it.

    Every put returns without waiting for the kernel (on CUDA, a fence per put that the
    host would block on when recorded past the driver's limit of pending blocking-sync
    events on one stream, about 56, stalls the loop until the kernel ends); every read
    then waits for the kernel and sees its values.
    """
    count = 200
    cache = make_cache(gpu_mb=64, cpu_mb=4)
    await cache.start()
    wants = [feature(rig, 16, seed=i) for i in range(count)]
    values = [w.clone() for w in wants]
    gate = threading.Event()
    busy_s = 1.0
    if rig.kind == "sim":
        dev = rig.device
        assert isinstance(dev, SimDevice)
        producer: Any = dev.stream("encoder")
        dev.launch(producer, lambda: gate.wait(10))
    else:
        producer = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        rig.settle()
        stall(producer, busy_s)
    start = time.perf_counter()
    for i in range(count):
        assert await cache.put(i, values[i], stream=producer)
    took = time.perf_counter() - start
    assert took < busy_s / 2, f"{count} puts took {took:.2f} s behind a {busy_s} s kernel"
    gate.set()
    del values
    for i in (0, count // 2, count - 1):
        assert_exact(await cache.get(i, device="cpu"), wants[i])
    await cache.drain()
    assert cache.stats().leaked_bytes == 0
