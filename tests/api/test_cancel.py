"""Cancellation at any await point leaves no partial state (invariant 6).

A cancelled put either completed or left the key absent with its value released;
copies already queued complete and stay accounted; a shared get_or_compute runs
to the end and is cached even if every waiter was cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import Rig
from prometheus_client import CollectorRegistry

from mmcache import CacheSettings, FeatureCache
from mmcache.device import SimDevice

KiB32 = 32 / 1024  # MiB


def _cache(rig: Rig, gpu_mb: float, cpu_mb: float) -> FeatureCache:
    settings = CacheSettings(gpu_cache_mb=gpu_mb, cpu_cache_mb=cpu_mb, evict_ahead=0)
    return FeatureCache(settings, rig.device, registry=CollectorRegistry())


async def _cancel_after(task: asyncio.Task[object], steps: int) -> None:
    for _ in range(steps):
        await asyncio.sleep(0)
    task.cancel()


async def _settled(rig: Rig, cache: FeatureCache) -> None:
    """Let every copy and release finish, then check the ledger and device memory."""
    rig.settle()
    await cache.drain()
    stats = cache.stats()
    assert stats.pending_copies == 0
    assert stats.leaked_bytes == 0
    owned = stats.gpu_bytes  # settled: only what the cache's GPU entries hold
    device = rig.device
    assert isinstance(device, SimDevice)
    if device.allocated_bytes != owned:
        gc.collect()  # tracebacks of cancelled tasks hold frames until collected
    assert device.allocated_bytes == owned


@pytest.mark.parametrize("steps", range(6))
async def test_cancelled_put_completed_or_left_nothing(sim_rig: Rig, steps: int) -> None:
    async with _cache(sim_rig, gpu_mb=2 * KiB32, cpu_mb=1) as cache:
        for k in ("a", "b"):
            await cache.put(k, sim_rig.tensor(64, 256, seed=ord(k)))
        t = sim_rig.tensor(64, 256, seed=9)
        want = t.clone()
        with sim_rig.hold():  # "c" needs room that held offloads will free
            put = asyncio.create_task(cache.put("c", t))
            del t
            await _cancel_after(put, steps)
            await asyncio.sleep(0.005)
        with pytest.raises(asyncio.CancelledError):
            await put
        assert "c" not in cache  # cancelled while it waited for budget
        await _settled(sim_rig, cache)
        for k in ("a", "b"):
            got = await cache.get(k, device="cpu")
            assert got is not None and torch.equal(got, sim_rig.tensor(64, 256, seed=ord(k)))
        await cache.put("c", want.clone())  # the budget it would have used is free again
        got = await cache.get("c", device="cpu")
        assert got is not None and torch.equal(got, want)


@pytest.mark.parametrize("steps", range(4))
async def test_cancelled_host_get_leaves_entry_and_pins_intact(sim_rig: Rig, steps: int) -> None:
    async with _cache(sim_rig, gpu_mb=KiB32, cpu_mb=1) as cache:
        t = sim_rig.tensor(64, 256, seed=1)
        want = t.clone()
        await cache.put("a", t)
        del t
        with sim_rig.hold():
            newcomer = asyncio.create_task(cache.put("b", sim_rig.tensor(64, 256, seed=2)))
            await asyncio.sleep(0.005)  # "a" is offloading, held
            reader = asyncio.create_task(cache.get("a", device="cpu", rows=slice(3, 9)))
            await _cancel_after(reader, steps)
        with pytest.raises(asyncio.CancelledError):
            await reader
        await newcomer
        await _settled(sim_rig, cache)
        got = await cache.get("a", device="cpu")
        assert got is not None and torch.equal(got, want)
        del got
        assert cache.discard("a")
        await _settled(sim_rig, cache)
        assert cache.stats().cpu_bytes == 0  # the reader's pin was dropped: its block is free


@pytest.mark.parametrize("steps", range(4))
async def test_cancelled_upload_leaves_exact_data(sim_rig: Rig, steps: int) -> None:
    async with _cache(sim_rig, gpu_mb=2 * KiB32, cpu_mb=1) as cache:
        t = sim_rig.tensor(64, 256, seed=3)
        want = t.clone()
        await cache.put("a", t)
        del t
        for k in ("b", "c"):  # push "a" to the host tier
            await cache.put(k, sim_rig.tensor(64, 256, seed=ord(k)))
        await cache.drain()
        cache.discard("b")  # room for a promotion
        await cache.drain()
        with sim_rig.hold():
            upload = asyncio.create_task(cache.get("a"))
            await _cancel_after(upload, steps)
        with pytest.raises(asyncio.CancelledError):
            await upload
        await _settled(sim_rig, cache)
        got = await cache.get("a", device="cpu")
        assert got is not None and torch.equal(got, want)
        await _settled(sim_rig, cache)


async def test_every_get_or_compute_waiter_cancelled_still_caches(sim_rig: Rig) -> None:
    calls = 0
    release = asyncio.Event()

    async def encode() -> torch.Tensor:
        nonlocal calls
        calls += 1
        await release.wait()
        return sim_rig.tensor(16, 64, seed=5)

    async with _cache(sim_rig, gpu_mb=1, cpu_mb=1) as cache:
        waiters = [asyncio.create_task(cache.get_or_compute("k", encode)) for _ in range(3)]
        await asyncio.sleep(0.005)
        for w in waiters:
            w.cancel()
        for w in waiters:
            with pytest.raises(asyncio.CancelledError):
                await w
        release.set()
        for _ in range(50):
            if "k" in cache:
                break
            await asyncio.sleep(0.001)
        assert calls == 1
        got = await cache.get("k", device="cpu")
        assert got is not None and torch.equal(got, sim_rig.tensor(16, 64, seed=5))
        await _settled(sim_rig, cache)


@pytest.mark.parametrize("steps", range(5))
async def test_cancelled_compacting_put_releases_its_copy(sim_rig: Rig, steps: int) -> None:
    """A view is compacted by a queued copy; cancelling the put must not leak that copy."""
    async with _cache(sim_rig, gpu_mb=KiB32, cpu_mb=1) as cache:
        await cache.put("a", sim_rig.tensor(64, 256, seed=1))
        batch = sim_rig.tensor(128, 256, seed=2)
        with sim_rig.hold():
            put = asyncio.create_task(cache.put("half", batch[:64]))
            await _cancel_after(put, steps)
            await asyncio.sleep(0.005)
        try:
            await put
        except asyncio.CancelledError:
            assert "half" not in cache
        else:
            got = await cache.get("half", device="cpu")
            assert got is not None and torch.equal(got, batch[:64])
        await _settled(sim_rig, cache)


async def test_a_task_group_of_serving_clients_cancelled_ends_at_once(sim_rig: Rig) -> None:
    """A scheduler's serving tasks (get_or_compute with the encoder on an executor, hits,
    host hits, puts evicting) cancelled together: every one ends within the same loop
    turns, none waits for an encoder still running or for a copy, and nothing leaks."""
    cache = _cache(sim_rig, gpu_mb=KiB32 * 8, cpu_mb=1)
    loop = asyncio.get_running_loop()
    encoders = ThreadPoolExecutor(4)

    def encode(key: int) -> torch.Tensor:
        time.sleep(0.02)  # an encoder on a worker thread
        return torch.full((2048,), float(key))  # 8 KiB

    async def client(first: int) -> None:
        n = 0
        while True:
            key = (first * 7 + n) % 48
            compute = functools.partial(loop.run_in_executor, encoders, encode, key)
            got = await cache.get_or_compute(key, compute)
            assert got is not None and float(got[0]) == key
            n += 1

    async with cache:
        assert await cache.wait_host_ready(5)
        for _ in range(3):
            clients = [asyncio.create_task(client(i)) for i in range(16)]
            await asyncio.sleep(0.2)
            assert not any(task.done() for task in clients)  # serving, no error
            for task in clients:
                task.cancel()
            done, pending = await asyncio.wait(clients, timeout=0.05)
            assert not pending and all(task.cancelled() for task in done)
        assert cache.stats().hits_gpu + cache.stats().hits_cpu > 0
        del clients, done, pending, task  # their frames hold the outputs they were served
        # The encoders still running finish, and their features are cached.
        await asyncio.to_thread(encoders.shutdown)
        for _ in range(10):
            await asyncio.sleep(0.01)
        await _settled(sim_rig, cache)
