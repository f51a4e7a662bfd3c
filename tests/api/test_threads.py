"""Threads and event loops: a cache belongs to the loop that started it.

Every call from another loop or thread is refused with WrongLoopError (the cache has no
locks: its ledger and recency are plain dicts). The way in from another thread is
put_threadsafe/get_threadsafe, which read the calling thread's stream;
asyncio.run_coroutine_threadsafe works too when the producer's stream is passed explicitly.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Rig
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache, WrongLoopError
from mmcache.device import SimDevice

pytestmark = pytest.mark.usefixtures("no_collection_during_reports")


def value(seed: int, rows: int = 16) -> torch.Tensor:
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))


def make(rig: Rig, gpu_kib: float = 64, cpu_kib: float = 256) -> FeatureCache:
    settings = CacheSettings(gpu_cache_mb=gpu_kib / 1024, cpu_cache_mb=cpu_kib / 1024)
    return FeatureCache(settings, rig.device, registry=CollectorRegistry())


def sim(rig: Rig) -> SimDevice:
    assert isinstance(rig.device, SimDevice)
    return rig.device


def in_thread(fn: Callable[[], Any]) -> BaseException | None:
    """Run fn in a new thread (no event loop there); return what it raised, if anything."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:
            raised.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert not t.is_alive()
    return raised[0] if raised else None


async def test_a_cache_used_by_a_later_loop_in_the_same_thread(sim_rig: Rig) -> None:
    """The common mistake: one cache shared by two asyncio.run() calls (or two test loops)."""
    cache = make(sim_rig)
    await cache.put("k", value(1))

    async def second_run() -> None:
        await cache.get("k")

    def later_loop() -> None:
        asyncio.run(second_run())

    raised = in_thread(later_loop)
    assert isinstance(raised, WrongLoopError)
    assert "another event loop" in str(raised) and "run_coroutine_threadsafe" in str(raised)
    got = await cache.get("k", device="cpu")
    assert got is not None and torch.equal(got, value(1))
    await cache.close()


async def test_discard_from_another_thread_is_refused(sim_rig: Rig) -> None:
    cache = make(sim_rig)
    await cache.put("k", value(1))
    raised = in_thread(lambda: cache.discard("k"))
    assert isinstance(raised, WrongLoopError)
    assert "k" in cache
    await cache.close()


async def test_close_from_another_loop_is_refused(sim_rig: Rig) -> None:
    cache = make(sim_rig)
    await cache.put("k", value(1))
    raised = in_thread(lambda: asyncio.run(cache.close()))
    assert isinstance(raised, WrongLoopError)
    got = await cache.get("k", device="cpu")  # still open and intact
    assert got is not None and torch.equal(got, value(1))
    await cache.close()


async def test_worker_threads_go_through_run_coroutine_threadsafe(sim_rig: Rig) -> None:
    """Eight threads put and read back through the owning loop; every byte is exact."""
    dev = sim(sim_rig)
    cache = make(sim_rig, gpu_kib=64, cpu_kib=256)  # 16 values on the GPU: threads evict
    await cache.start()
    loop = asyncio.get_running_loop()
    stream = dev.default_stream

    def worker(w: int) -> int:
        checked = 0
        for i in range(25):
            key = (w, i % 10)
            seed = w * 1000 + i
            t = value(seed)
            call = cache.put(key, t, stream=stream)
            del t
            assert asyncio.run_coroutine_threadsafe(call, loop).result(10)
            for device in ("cpu", None):
                read = cache.get(key, device=device, stream=stream)
                got = asyncio.run_coroutine_threadsafe(read, loop).result(10)
                # Another thread never writes this key: it is ours, or dropped (host full).
                assert got is None or torch.equal(got, value(seed)), (key, device)
                checked += got is not None
        return checked

    counts = await asyncio.gather(*(asyncio.to_thread(worker, w) for w in range(8)))
    assert sum(counts) > 0
    await cache.drain()
    dev.synchronize()
    await cache.drain()
    s = cache.stats()
    assert s.leaked_bytes == 0 and s.pending_copies == 0
    gc.collect()
    assert dev.allocated_bytes == s.gpu_bytes  # settled: what the GPU entries hold
    await cache.close()


def _produce_on_a_side_stream(dev: SimDevice, src: torch.Tensor) -> torch.Tensor:
    """A tensor that a kernel queued on a side stream (the caller's current one) fills."""
    out = torch.full_like(src, 7.0)  # wrong until the kernel runs
    dev.launch(dev.current_stream(), lambda: out.copy_(src))
    return out


async def test_from_a_thread_pass_the_producers_stream(sim_rig: Rig) -> None:
    """The coroutine runs on the loop's thread: the caller's stream must be passed in."""
    dev = sim(sim_rig)
    cache = make(sim_rig)
    await cache.start()
    loop = asyncio.get_running_loop()
    side = dev.stream("producer")
    want = value(3)

    def producer() -> None:
        with dev.use_stream(side):
            t = _produce_on_a_side_stream(dev, want)
            stream = dev.current_stream()  # read here, in the producing thread
            call = cache.put("k", t, stream=stream)
            del t
            assert asyncio.run_coroutine_threadsafe(call, loop).result(10)

    with dev.hold():  # the producer's kernel has not run yet
        await asyncio.to_thread(producer)
        reading = asyncio.create_task(cache.get("k", device="cpu"))
        await asyncio.sleep(0.01)
        assert not reading.done()  # ordered after the kernel
    got = await reading
    assert got is not None and torch.equal(got, want)
    await cache.close()


async def test_a_threadsafe_put_orders_after_the_callers_stream(sim_rig: Rig) -> None:
    dev = sim(sim_rig)
    cache = make(sim_rig)
    await cache.start()
    side = dev.stream("producer")
    want = value(4)
    put_threadsafe = cache.put_threadsafe

    def producer() -> None:
        with dev.use_stream(side):
            t = _produce_on_a_side_stream(dev, want)
            assert put_threadsafe("k", t, timeout=10)

    try:
        with dev.hold():
            await asyncio.to_thread(producer)
            reading = asyncio.create_task(cache.get("k", device="cpu"))
            await asyncio.sleep(0.01)
        got = await reading
        assert got is not None and torch.equal(got, want)
        raised = None
        try:
            put_threadsafe("k2", value(5), timeout=1)  # on the loop's own thread: would deadlock
        except WrongLoopError as e:
            raised = e
        assert raised is not None
    finally:
        await cache.close()


async def test_a_threadsafe_put_that_times_out_never_inserts_later(sim_rig: Rig) -> None:
    dev = sim(sim_rig)
    settings = CacheSettings(
        gpu_cache_mb=8 / 1024, cpu_cache_mb=64 / 1024, evict_ahead=0, small_copy_bytes=0
    )
    async with FeatureCache(settings, dev, registry=CollectorRegistry()) as cache:
        await cache.put(0, value(0))
        await cache.put(1, value(1))  # the GPU tier is full
        mine = value(2)
        with dev.hold():  # the offload that makes the room is held back
            with pytest.raises(TimeoutError):
                await asyncio.to_thread(cache.put_threadsafe, "k", mine, timeout=0.2)
            mine.fill_(7.0)  # told it failed, the caller uses its tensor again
        await cache.drain()
        assert "k" not in cache  # the put gave up with its caller
        assert cache.stats().leaked_bytes == 0
        # Within its timeout it is served as ever.
        assert await asyncio.to_thread(cache.put_threadsafe, "k", value(3), timeout=10)
        got = await cache.get("k", device="cpu")
        assert got is not None and torch.equal(got, value(3))
