"""close(): finishes queued copies, fails whoever waits on budget, and refuses later calls."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import torch
from conftest import CacheFactory, Rig, assert_exact, longest_loop_gap, needs_hold
from prometheus_client import CollectorRegistry

from mmcache import CacheClosedError, CacheSettings, FeatureCache


async def assert_refuses_calls(cache: FeatureCache, rig: Rig) -> None:
    t = rig.tensor(4, 64)
    with pytest.raises(CacheClosedError):
        await cache.put("new", t)
    with pytest.raises(CacheClosedError):
        await cache.put("new", t, wait=False)
    with pytest.raises(CacheClosedError):
        await cache.get("k")
    with pytest.raises(CacheClosedError):
        await cache.get("k", device="cpu")
    with pytest.raises(CacheClosedError):
        await cache.get_or_compute("k", lambda: t)
    with pytest.raises(CacheClosedError):
        cache.discard("k")
    with pytest.raises(CacheClosedError):
        await cache.drain()
    with pytest.raises(CacheClosedError):
        await cache.start()
    with pytest.raises(CacheClosedError):
        async with cache:
            pass


async def test_async_with_starts_and_closes(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    t = rig.tensor(16, 64, seed=1)
    expected = t.cpu().clone()
    async with cache as entered:
        assert entered is cache
        assert await cache.put("k", t)
        del t
        assert_exact(await cache.get("k"), expected)
    await assert_refuses_calls(cache, rig)


async def test_calls_after_close_raise(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache(gpu_mb=0.0625, cpu_mb=1)
    for i in range(4):  # some on each tier
        await cache.put(i, rig.tensor(32, 256, seed=i))
    await cache.close()
    await assert_refuses_calls(cache, rig)


async def test_close_twice_and_close_unstarted(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    await cache.put("k", rig.tensor(16, 64))
    await cache.close()
    await cache.close()
    never_started = make_cache()
    await never_started.close()
    await never_started.close()
    await assert_refuses_calls(never_started, rig)


async def test_close_finishes_queued_copies(rig: Rig, make_cache: CacheFactory) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    with rig.hold():
        for i in range(3):
            await cache.put(i, rig.tensor(16, 64, seed=i))
        assert cache.stats().pending_copies == 3
        closing = asyncio.create_task(cache.close())
        await asyncio.sleep(0.01)
        assert not closing.done()
    await asyncio.wait_for(closing, 2)
    s = cache.stats()
    assert s.pending_copies == 0
    assert s.leaked_bytes == 0
    assert rig.allocated_bytes() == 0


@pytest.mark.parametrize("tier", ["gpu", "host"])
async def test_close_fails_a_put_waiting_for_budget(
    rig: Rig, make_cache: CacheFactory, tier: str
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0.125 if tier == "gpu" else 0, cpu_mb=0.125)
    await cache.start()
    with rig.hold():
        assert await cache.put("a", rig.tensor(128, 256, dtype=torch.float32))  # fills the tier
        # b needs a's held offload to finish (gpu), or the host tier is full of it (host).
        waiting = asyncio.create_task(cache.put("b", rig.tensor(64, 256, dtype=torch.float32)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
        closing = asyncio.create_task(cache.close())
        await asyncio.sleep(0.01)
        assert waiting.done()  # failed at once, not after the copies
        with pytest.raises(CacheClosedError):
            waiting.result()
    await asyncio.wait_for(closing, 2)
    assert "b" not in cache
    assert rig.allocated_bytes() == 0


async def a_put_waiting_for_gpu_room(
    rig: Rig, make_cache: CacheFactory
) -> tuple[FeatureCache, asyncio.Task[bool]]:
    """A cache whose GPU tier (three 64 KiB features) holds a and b, and a task whose put of
    c (128 KiB) waits for a's held offload to land; dropping b grants it room at once.
    Call it with the rig's copies held."""
    cache = make_cache(gpu_mb=0.1875, cpu_mb=1)
    await cache.start()
    for key in ("a", "b"):
        assert await cache.put(key, rig.tensor(64, 256, dtype=torch.float32))
    waiting = asyncio.create_task(cache.put("c", rig.tensor(128, 256, dtype=torch.float32)))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    return cache, waiting


async def test_a_put_granted_room_just_before_close_inserts_nothing(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    with rig.hold():
        cache, waiting = await a_put_waiting_for_gpu_room(rig, make_cache)
        assert cache.discard("b")
    await cache.close()  # runs up to its first wait before the granted put resumes
    with pytest.raises(CacheClosedError):
        await waiting
    assert "c" not in cache and len(cache) == 0
    assert rig.allocated_bytes() == 0


async def test_a_put_granted_room_then_cancelled_as_close_begins_gives_it_back(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    with rig.hold():
        cache, waiting = await a_put_waiting_for_gpu_room(rig, make_cache)
        closing = asyncio.create_task(cache.close())
        asyncio.get_running_loop().call_soon(waiting.cancel)  # after close() has begun
        assert cache.discard("b")  # grants c its room; c resumes cancelled
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await closing
    stats = cache.stats()
    # gpu_bytes counts granted bytes too: the grant went back, not only out of sight.
    assert (stats.gpu_bytes, stats.leaked_bytes) == (0, 0)


async def test_a_put_woken_for_host_room_just_before_close_inserts_nothing(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=0.125)
    await cache.start()
    with rig.hold():
        assert await cache.put("a", rig.tensor(128, 256, dtype=torch.float32))  # fills it
        waiting = asyncio.create_task(cache.put("b", rig.tensor(64, 256, dtype=torch.float32)))
        await asyncio.sleep(0.01)
        assert not waiting.done()
    rig.settle()
    assert cache.discard("a")  # frees a's block now: wakes b, with room
    await cache.close()  # runs up to its first wait before b resumes
    with pytest.raises(CacheClosedError):
        await asyncio.wait_for(waiting, 2)
    assert "b" not in cache and len(cache) == 0
    assert rig.allocated_bytes() == 0


@pytest.mark.parametrize(
    "wait_on",
    ["offload", "upload"],
)
async def test_close_while_a_get_waits_on_a_held_copy(
    rig: Rig, make_cache: CacheFactory, wait_on: str
) -> None:
    needs_hold(rig)
    cache = make_cache(gpu_mb=0, cpu_mb=1)
    t = rig.tensor(32, 64, seed=2)
    expected = t.cpu().clone()
    if wait_on == "upload":  # settle on the host tier first; the upload is what waits
        await cache.put("k", t)
        await cache.drain()
    with contextlib.ExitStack() as stack:
        stack.enter_context(rig.hold())
        if wait_on == "offload":
            await cache.put("k", t)
        del t
        getting = asyncio.create_task(
            cache.get("k", device="cpu" if wait_on == "offload" else None)
        )
        await asyncio.sleep(0.01)
        assert not getting.done()

        async def release_later() -> None:
            await asyncio.sleep(0.02)
            stack.close()

        releasing = asyncio.create_task(release_later())
        await asyncio.wait_for(cache.close(), 2)
        await releasing
    try:
        out = await asyncio.wait_for(getting, 2)
    except CacheClosedError:
        pass
    else:  # if the read is served, it is served right
        assert_exact(out, expected)
        del out
    del getting  # the task keeps its result alive
    # Python 3.12 leaves a wake-up for the finished task queued on the loop, and that
    # handle holds the task (and its result) until the loop runs it.
    await asyncio.sleep(0)
    assert rig.allocated_bytes() == 0


async def test_close_with_a_computation_in_flight(rig: Rig, make_cache: CacheFactory) -> None:
    cache = make_cache()
    gate = asyncio.Event()

    async def encode() -> torch.Tensor:
        await gate.wait()
        return rig.tensor(16, 64, seed=3)

    waiter = asyncio.create_task(cache.get_or_compute("k", encode))
    await asyncio.sleep(0.01)
    closing = asyncio.create_task(cache.close())
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.wait_for(closing, 2)
    with pytest.raises(CacheClosedError):
        await asyncio.wait_for(waiter, 2)
    if rig.kind == "sim":
        assert rig.allocated_bytes() == 0


async def test_device_memory_is_released_after_close(rig: Rig, make_cache: CacheFactory) -> None:
    needs_hold(rig)  # SimDevice.allocated_bytes counts exactly the simulated device memory
    cache = make_cache(gpu_mb=0.25, cpu_mb=1)
    expected = {}
    for i in range(6):  # 64 KiB each: two end up on the host tier
        t = rig.tensor(64, 256, dtype=torch.float32, seed=i)
        expected[i] = t.cpu().clone()
        await cache.put(i, t)
        del t
    held = await cache.get(5)  # a caller's alias outlives the cache
    host_read = await cache.get(0)  # an upload of a host entry the caller keeps
    assert held is not None and host_read is not None
    await cache.drain()
    assert rig.allocated_bytes() > 0
    await cache.close()
    assert rig.allocated_bytes() == held.untyped_storage().nbytes() + host_read.nbytes
    assert_exact(held, expected[5])
    assert_exact(host_read, expected[0])
    del held
    assert rig.allocated_bytes() == host_read.nbytes
    del host_read
    assert rig.allocated_bytes() == 0


async def cache_with_slow_device_close(
    monkeypatch: pytest.MonkeyPatch, closed: list[bool], error: Exception | None = None
) -> FeatureCache:
    """A started cache on a simulator it made, whose close takes 0.2 s (appending True to
    closed when done), or raises error after that."""
    cache = FeatureCache(
        CacheSettings(gpu_cache_mb=1, cpu_cache_mb=1), "sim", registry=CollectorRegistry()
    )
    await cache.start()
    assert await cache.put("k", torch.ones(16, 64))
    device = cache.device
    real_close = device.close

    def slow_close() -> None:
        time.sleep(0.2)
        real_close()
        closed.append(True)
        if error is not None:
            raise error

    monkeypatch.setattr(device, "close", slow_close)
    return cache


async def test_closing_its_own_device_does_not_hold_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache that made its device closes it off the loop: unpinning a large arena holds
    the driver for a while (105 ms for 4 GiB on the H200)."""
    closed: list[bool] = []
    cache = await cache_with_slow_device_close(monkeypatch, closed)
    assert await longest_loop_gap(cache.close()) < 0.1  # the device's close takes 0.2 s
    assert closed == [True]  # close() returns once the device is closed


async def test_a_close_whose_caller_is_cancelled_still_finishes_and_a_second_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closed: list[bool] = []
    cache = await cache_with_slow_device_close(monkeypatch, closed)
    first = asyncio.create_task(cache.close())
    await asyncio.sleep(0.05)  # the device is closing
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert closed == []
    await cache.close()  # returns once the device is closed, not at once
    assert closed == [True]


async def test_a_cache_close_whose_own_work_was_cancelled_says_so_to_later_callers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cancelled half-way (as the loop shutting down cancels every task), the cache's close
    did not finish and cannot run again: a later close() must not pretend it did."""
    closed: list[bool] = []
    cache = await cache_with_slow_device_close(monkeypatch, closed)
    first = asyncio.create_task(cache.close())
    await asyncio.sleep(0.05)  # closing its device
    assert cache._life.closing._task is not None
    cache._life.closing._task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    with pytest.raises(asyncio.CancelledError):
        await cache.close()
    await asyncio.sleep(0.3)  # the device's close, on its own thread, finishes regardless


async def test_a_cache_closes_its_device_after_the_default_executor_is_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closed: list[bool] = []
    cache = await cache_with_slow_device_close(monkeypatch, closed)
    await asyncio.get_running_loop().shutdown_default_executor()
    await cache.close()
    assert closed == [True]


async def test_an_error_closing_the_device_reaches_every_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    closed: list[bool] = []
    cache = await cache_with_slow_device_close(monkeypatch, closed, RuntimeError("unpin"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="unpin"):
            await cache.close()
    assert closed == [True]
