"""Injected faults: each reaches its caller as an MMCacheError (or a documented drop), is counted,
leaves every other entry exact, and leaks nothing.

Faults come from the simulator (`SimDevice.inject`: a copy that fails, an allocation that
fails, a fence that never completes) or are patched into one device method where the
simulator has no switch for them (a copy refused at enqueue). After each scenario the
ledger must be exact: nothing pending, leaked_bytes == 0, and simulated device memory
equal to what the cache's GPU entries (plus the tensors the test still holds) own.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import pytest
import torch
from conftest import Rig, leaked, live_units, served_from, with_registry
from device_copies import copy_d2h
from prometheus_client import CollectorRegistry

from mmcache import (
    CacheClosedError,
    CacheSettings,
    CopyFailedError,
    DeviceOutOfMemoryError,
    FeatureCache,
)
from mmcache.device import Fence, SimDevice
from mmcache.errors import CopyTimeoutError
from mmcache.waiting import wait_fences

KiB = 1024
VALUE = 4 * KiB  # one test value: 16 rows of 64 float32
NAME = "faults"
T = TypeVar("T")


pytestmark = pytest.mark.usefixtures("no_collection_during_reports")


def value(seed: int, rows: int = 16) -> torch.Tensor:
    """Random float32 data, 256 bytes a row (never zeros: they hide unwritten memory)."""
    return torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed))


def sim(rig: Rig) -> SimDevice:
    assert isinstance(rig.device, SimDevice)
    return rig.device


def make(
    rig: Rig, gpu_kib: float, cpu_kib: float, reg: CollectorRegistry | None = None, **kw: Any
) -> FeatureCache:
    kw.setdefault("evict_ahead", 0)
    settings = CacheSettings(gpu_cache_mb=gpu_kib / KiB, cpu_cache_mb=cpu_kib / KiB, **kw)
    reg = reg or CollectorRegistry()
    return with_registry(FeatureCache(settings, rig.device, name=NAME, registry=reg), reg)


def faults(reg: CollectorRegistry, kind: str) -> float:
    got = reg.get_sample_value("mmcache_faults_total", {"cache": NAME, "kind": kind})
    return 0.0 if got is None else got


def dropped_total(reg: CollectorRegistry) -> float:
    got = reg.get_sample_value("mmcache_dropped_total", {"cache": NAME})
    return 0.0 if got is None else got


async def settled(rig: Rig, cache: FeatureCache, *held: torch.Tensor) -> None:
    """Let every copy and release finish; then the ledger and device memory must be exact."""
    await cache.drain()
    rig.settle()
    await cache.drain()
    s = cache.stats()
    assert s.pending_copies == 0
    assert s.leaked_bytes == 0
    assert 0 <= s.gpu_bytes <= s.gpu_capacity_bytes
    assert 0 <= s.cpu_bytes <= s.cpu_capacity_bytes
    # Per tier: the GPU bytes are those of the entries on the device, and so on. With
    # nothing in flight, that and the device memory below leave no room for a stray byte.
    assert leaked(cache) == {"gpu": 0, "cpu": 0}
    owned = s.gpu_bytes + sum(t.untyped_storage().nbytes() for t in held)
    if sim(rig).allocated_bytes != owned:
        gc.collect()  # tracebacks of failed or cancelled tasks hold tensors until collected
    assert sim(rig).allocated_bytes == owned


async def assert_exact(cache: FeatureCache, key: object, want: torch.Tensor) -> None:
    """Both kinds of read return exactly want."""
    for device in ("cpu", None):
        got = await cache.get(key, device=device)
        assert got is not None, (key, device)
        assert got.dtype == want.dtype and torch.equal(got, want), (key, device)


async def on_host(cache: FeatureCache, *keys: object) -> None:
    """Wait until keys have been offloaded (their copies finished)."""
    await cache.drain()
    for k in keys:
        assert await served_from(cache, k) == "cpu", k


async def host_resident(rig: Rig, cache: FeatureCache, key: str, seed: int) -> None:
    """Put key, then push it to the host tier with two more puts (a 2-value GPU tier)."""
    await cache.put(key, value(seed))
    await cache.put(key + "1", value(seed + 1))
    await cache.put(key + "2", value(seed + 2))
    await on_host(cache, key)


async def within(seconds: float, aw: Awaitable[T]) -> T:
    """aw's result, or a plain test failure if it takes longer than seconds (a hang)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        pytest.fail(f"still waiting after {seconds} s", pytrace=False)
    return task.result()


def raising_once(error: BaseException, fn: Any) -> Any:
    """fn, except that its first call raises error (a fault the simulator cannot inject)."""
    calls = [0]

    def patched(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise error
        return fn(*args, **kwargs)

    return patched


# --- a copy that fails ------------------------------------------------------------------


async def test_a_failed_offload_drops_that_entry_only(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    # Reads promote into free room only: a hotter host hit's eviction would copy more.
    async with make(sim_rig, 8, 64, reg, small_copy_bytes=0, promote_policy="room") as cache:
        await cache.put("a", value(1))
        await cache.put("b", value(2))
        sim(sim_rig).inject("copy_fails")
        await cache.put("c", value(3))  # offloads "a": that copy fails
        await cache.put("d", value(4))  # offloads "b": fine
        await cache.drain()
        assert "a" not in cache
        assert await cache.get("a") is None
        for k, seed in (("b", 2), ("c", 3), ("d", 4)):
            await assert_exact(cache, k, value(seed))
        s = cache.stats()
        assert (s.copy_failures, s.dropped) == (1, 1)
        assert s.d2h_bytes == value(2).nbytes  # only the offload that succeeded counts
        assert faults(reg, "copy_failed") == 1
        await settled(sim_rig, cache)
        assert await cache.put("a", value(5))  # the key and the budget are usable again
        await assert_exact(cache, "a", value(5))
        await settled(sim_rig, cache)


async def test_a_host_get_awaiting_a_failed_offload_raises_copy_failed(sim_rig: Rig) -> None:
    async with make(sim_rig, 8, 64, small_copy_bytes=0) as cache:
        await cache.put("a", value(1))
        await cache.put("b", value(2))
        sim(sim_rig).inject("copy_fails")
        with sim_rig.hold():
            put_c = asyncio.create_task(cache.put("c", value(3)))
            await asyncio.sleep(0.005)
            s = cache.stats()  # "a" is being offloaded: counted in both tiers until it lands
            assert (s.pending_copies, s.cpu_entries, s.gpu_entries, "a" in cache) == (1, 1, 2, True)
            host_read = asyncio.create_task(cache.get("a", device="cpu"))
            rows_read = asyncio.create_task(cache.get("a", device="cpu", rows=slice(2, 5)))
            device_read = await cache.get("a")  # the device copy is still valid: served now
            await asyncio.sleep(0.005)
            assert not host_read.done() and not rows_read.done()
        for read in (host_read, rows_read):
            with pytest.raises(CopyFailedError, match="copy failure"):
                await read
        assert device_read is not None and torch.equal(device_read, value(1))
        await put_c
        await assert_exact(cache, "b", value(2))
        await assert_exact(cache, "c", value(3))
        assert "a" not in cache
        await settled(sim_rig, cache, device_read)


async def test_a_failed_copy_in_a_batched_offload_drops_its_entries(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    async with make(sim_rig, 16, 64, reg) as cache:  # 4 KiB values < small_copy_bytes: batched
        for i in range(4):
            await cache.put(i, value(i))
        sim(sim_rig).inject("copy_fails")  # the first copy of the batch below
        await cache.put("big", value(10, rows=48))  # offloads 0, 1, 2 in one batch
        await cache.drain()
        for i in range(4):
            got = await cache.get(i, device="cpu")
            assert got is None or torch.equal(got, value(i)), f"{i} served wrong data"
        assert 0 not in cache
        s = cache.stats()
        assert s.copy_failures >= 1 and s.dropped >= 1
        assert faults(reg, "copy_failed") >= 1
        await settled(sim_rig, cache)


async def test_a_failed_download_raises_and_keeps_the_entry(sim_rig: Rig) -> None:
    async with make(sim_rig, 64, 64) as cache:
        await cache.put("a", value(1))
        await cache.put("b", value(2))
        sim(sim_rig).inject("copy_fails")
        with sim_rig.hold():
            read = asyncio.create_task(cache.get("a", device="cpu"))
            await asyncio.sleep(0.005)
            assert not read.done()
        with pytest.raises(CopyFailedError):
            await read
        await assert_exact(cache, "a", value(1))  # only the caller's copy failed
        await assert_exact(cache, "b", value(2))
        await settled(sim_rig, cache)


@pytest.mark.parametrize("how", ["rows", "no-promotion", "on-the-readers-stream"])
async def test_a_failed_upload_raises_and_keeps_the_entry(sim_rig: Rig, how: str) -> None:
    small = 1 << 20 if how == "on-the-readers-stream" else 0
    async with make(sim_rig, 8, 64, small_copy_bytes=small, promote_on_hit=False) as cache:
        await host_resident(sim_rig, cache, "a", 1)
        sim(sim_rig).inject("copy_fails")
        rows = slice(1, 7) if how == "rows" else None
        with sim_rig.hold():
            read = asyncio.create_task(cache.get("a", rows=rows))
            await asyncio.sleep(0.005)
            assert not read.done()
        with pytest.raises(CopyFailedError):
            await read
        del read
        assert await served_from(cache, "a") == "cpu"
        await assert_exact(cache, "a", value(1))
        await settled(sim_rig, cache)


async def test_a_failed_promotion_never_serves_wrong_data(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    async with make(sim_rig, 8, 64, reg, small_copy_bytes=0) as cache:
        await host_resident(sim_rig, cache, "a", 1)
        cache.discard("a2")  # room on the GPU: the upload promotes "a"
        await cache.drain()
        sim(sim_rig).inject("copy_fails")
        with sim_rig.hold():
            read = asyncio.create_task(cache.get("a"))
            await asyncio.sleep(0.005)
        with pytest.raises(CopyFailedError):
            await read
        del read
        await cache.drain()
        for device in (None, "cpu", None):
            try:
                got = await cache.get("a", device=device)
            except CopyFailedError:
                continue  # a clear error is fine; wrong data is not
            assert got is None or torch.equal(got, value(1)), f"get(device={device}) was wrong"
            del got  # a device alias would count as memory the cache does not own
        assert faults(reg, "copy_failed") >= 1
        await settled(sim_rig, cache)


async def test_a_failed_compaction_copy_is_never_served(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    async with make(sim_rig, 64, 64, reg) as cache:
        batch = value(1, rows=32)
        want = batch[16:].clone()
        sim(sim_rig).inject("copy_fails")
        stored = await cache.put("view", batch[16:])  # compacted by a copy that fails
        del batch
        await settled(sim_rig, cache)  # the failed copy has finished
        for device in (None, "cpu"):
            try:
                got = await cache.get("view", device=device)
            except CopyFailedError:
                continue
            assert got is None or torch.equal(got, want), f"get(device={device}) served poison"
            del got
        assert stored is False or faults(reg, "copy_failed") == 1
        await settled(sim_rig, cache)


class _FailsWhileChecked(Fence):
    """Once armed, pending at its first done() check and failed from then on: the worker
    thread finishing a copy (with an error) between two checks of the loop thread. Done
    and good while not armed."""

    def __init__(self) -> None:
        self.armed = False
        self.checks = 0

    def done(self) -> bool:
        if not self.armed:
            return True
        self.checks += 1
        return self.checks > 1

    def exception(self) -> BaseException | None:
        if not self.armed:
            return None
        return CopyFailedError("simulated copy failure") if self.checks > 1 else None

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        fn() if self.done() else None

    def wait(self, timeout: float | None = None) -> bool:
        return True


async def test_a_fence_failing_while_a_device_read_checks_it_fails_the_read(
    sim_rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that finds a fence pending and then done must see its error, not poison."""
    fence = _FailsWhileChecked()
    async with make(sim_rig, 64, 64) as cache:
        # The fence under test is the one the put records on its producer's stream.
        monkeypatch.setattr(sim(sim_rig), "record", lambda stream: fence)
        await cache.put("a", value(1))
        monkeypatch.undo()
        await settled(sim_rig, cache)
        fence.armed = True
        with pytest.raises(CopyFailedError):
            await cache.get("a")
        assert fence.checks >= 2  # it was seen pending, then failed
        fence.armed = False  # the entry's producer is good again: the cache closes cleanly


async def test_a_download_after_a_failed_compaction_fails_too(sim_rig: Rig) -> None:
    """The window between a compaction copy failing and the loop hearing of it."""
    dev = sim(sim_rig)
    async with make(sim_rig, 8, 64, small_copy_bytes=0) as cache:
        batch = value(2, rows=32)
        want = batch[16:].clone()
        dev.inject("copy_fails")
        await cache.put("view", batch[16:])  # compacted by a copy that fails
        del batch
        dev.synchronize()  # it has failed; the loop has not run its callbacks yet
        try:
            got = await cache.get("view", device="cpu")
        except CopyFailedError:
            got = None  # a clear error is right; poison is not
        assert got is None or torch.equal(got, want), "poison served"
        del got
        await settled(sim_rig, cache)


async def test_an_offload_after_a_failed_promotion_is_not_kept(sim_rig: Rig) -> None:
    dev = sim(sim_rig)
    async with make(sim_rig, 8, 64, small_copy_bytes=0) as cache:
        await host_resident(sim_rig, cache, "a", 1)  # a on the host; a1, a2 on the GPU
        cache.discard("a2")
        await cache.drain()
        dev.inject("copy_fails")
        with sim_rig.hold():
            promoting = asyncio.create_task(cache.get("a"))  # its upload will fail
            await asyncio.sleep(0.005)
        dev.synchronize()  # failed; the loop has not run its callbacks yet
        await cache.get("a1")  # a1 most recent: "a" (promoted, GPU) is the LRU
        await cache.put("b", value(3))  # offloads "a" after its failed upload
        with pytest.raises(CopyFailedError):
            await promoting
        del promoting
        await cache.drain()
        got: torch.Tensor | None = None
        for device in ("cpu", None):
            try:
                got = await cache.get("a", device=device)
            except CopyFailedError:
                continue
            assert got is None or torch.equal(got, value(1)), f"get(device={device}): poison"
        del got
        await settled(sim_rig, cache)


async def test_every_failed_copy_is_counted(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    async with make(sim_rig, 8, 64, reg, small_copy_bytes=0, promote_on_hit=False) as cache:
        await host_resident(sim_rig, cache, "a", 1)
        for device in ("cpu", None):  # a download of "a2" (GPU), an upload of "a" (host)
            sim(sim_rig).inject("copy_fails")
            with sim_rig.hold():
                read = asyncio.create_task(
                    cache.get("a2" if device == "cpu" else "a", device=device)
                )
                await asyncio.sleep(0.005)
            with pytest.raises(CopyFailedError):
                await read
        await cache.drain()  # an upload's completion is accounted for when the loop finds it
        assert cache.stats().copy_failures == 2
        assert faults(reg, "copy_failed") == 2
        await settled(sim_rig, cache)


# --- a device allocation that fails (out of memory) ---------------------------------------


async def test_oom_in_an_upload_raises_and_keeps_the_entry(sim_rig: Rig) -> None:
    # Promoted into free room only: a full GPU tier's eviction for a hotter hit would move
    # the ledgers before the upload fails.
    async with make(sim_rig, 8, 64, small_copy_bytes=0, promote_policy="room") as cache:
        await host_resident(sim_rig, cache, "a", 1)
        before = cache.stats()
        sim(sim_rig).inject("alloc_fails")
        with pytest.raises(DeviceOutOfMemoryError, match="out of memory"):
            await cache.get("a")
        s = cache.stats()
        assert (s.gpu_bytes, s.cpu_bytes, s.pending_copies) == (
            before.gpu_bytes,
            before.cpu_bytes,
            0,
        )
        assert await served_from(cache, "a") == "cpu"
        await assert_exact(cache, "a", value(1))  # host read, then an upload that works
        await assert_exact(cache, "a1", value(2))
        await settled(sim_rig, cache)


async def test_oom_in_a_compacting_put_raises_and_changes_nothing(sim_rig: Rig) -> None:
    async with make(sim_rig, 64, 64) as cache:
        await cache.put("k", value(1))
        before = cache.stats()
        batch = value(2, rows=32)
        sim(sim_rig).inject("alloc_fails")
        with pytest.raises(DeviceOutOfMemoryError):
            await cache.put("k", batch[:16])  # a view: needs a compacting allocation
        after = cache.stats()
        assert after.alloc_failures == before.alloc_failures + 1
        assert dataclasses.replace(after, alloc_failures=before.alloc_failures) == before
        await assert_exact(cache, "k", value(1))  # the old value is still there
        assert await cache.put("k", batch[:16])  # and the next try works
        await assert_exact(cache, "k", value(2, rows=32)[:16])
        del batch
        await settled(sim_rig, cache)


async def test_oom_is_counted(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    async with make(sim_rig, 8, 64, reg, small_copy_bytes=0) as cache:
        await host_resident(sim_rig, cache, "a", 1)
        sim(sim_rig).inject("alloc_fails", 2)
        with pytest.raises(DeviceOutOfMemoryError):
            await cache.get("a")
        with pytest.raises(DeviceOutOfMemoryError):
            await cache.put("v", value(2, rows=32)[:8])
        assert faults(reg, "oom") == 2
        assert cache.stats().alloc_failures == 2


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "single"])
async def test_an_offload_refused_at_enqueue_leaks_nothing(sim_rig: Rig, batched: bool) -> None:
    dev = sim(sim_rig)
    name = "_copy_d2h_batch" if batched else "_copy_d2h"
    oom = DeviceOutOfMemoryError("simulated: no memory for the staging buffer")
    setattr(dev, name, raising_once(oom, getattr(dev, name)))
    try:
        small = 1 << 20 if batched else 0
        async with make(sim_rig, 16, 64, small_copy_bytes=small) as cache:
            for i in range(4):
                await cache.put(i, value(i))
            with contextlib.suppress(DeviceOutOfMemoryError):
                await within(2, cache.put("big", value(10, rows=48)))
            assert cache.stats().leaked_bytes == 0
            for i in range(4):  # each is exact or gone, and reading does not blow up
                got = await cache.get(i, device="cpu")
                assert got is None or torch.equal(got, value(i))
            assert await within(2, cache.put("next", value(11, rows=64)))
            await settled(sim_rig, cache)
    finally:
        delattr(dev, name)


# --- a host arena that is exhausted or fragmented -----------------------------------------


async def test_a_host_tier_full_of_copies_in_flight_drops_evictions(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    # The reads at the end promote nothing (a full GPU tier's evictions would drop more).
    async with make(sim_rig, 16, 8, reg, small_copy_bytes=0, promote_policy="room") as cache:
        for i in range(4):
            await cache.put(i, value(i))
        with sim_rig.hold():  # 0 and 1 fill the host tier in flight; 2 and 3 find no room
            puts = [asyncio.create_task(cache.put(i, value(i))) for i in range(4, 8)]
            await asyncio.sleep(0.01)
            assert cache.stats().cpu_bytes == cache.stats().cpu_capacity_bytes
        assert all(await asyncio.gather(*puts))
        await cache.drain()
        s = cache.stats()
        assert (s.evictions_gpu, s.dropped) == (4, 2)
        assert dropped_total(reg) == 2
        assert 2 not in cache and 3 not in cache
        for i in (0, 1, 4, 5, 6, 7):
            await assert_exact(cache, i, value(i))
        await settled(sim_rig, cache)


async def test_room_made_by_dropping_is_granted_at_once(sim_rig: Rig) -> None:
    async with make(sim_rig, 16, 8, small_copy_bytes=0) as cache:
        for i in range(4):
            await cache.put(i, value(i))
        with sim_rig.hold():
            puts = [asyncio.create_task(cache.put(i, value(i))) for i in range(4, 8)]
            await asyncio.sleep(0.01)
            # 2 and 3 were dropped: 8 KiB free now, enough for two of the four puts.
            assert cache.stats().dropped == 2
            assert sum(p.done() for p in puts) == 2
        await asyncio.gather(*puts)
        await settled(sim_rig, cache)


async def test_a_fragmented_host_tier_evicts_neighbours_to_fit(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    # GPU tier off: puts go straight to the host tier, 8 blocks of 4 KiB.
    async with make(sim_rig, 0, 32, reg, host_alignment=512) as cache:
        for i in range(8):
            await cache.put(i, value(i))
        await cache.drain()
        for i in (0, 2, 4, 6):
            cache.discard(i)
        s = cache.stats()
        assert s.cpu_capacity_bytes - s.cpu_bytes == 16 * KiB  # in four holes of 4 KiB
        assert await cache.put("big", value(20, rows=32))  # 8 KiB
        await cache.drain()
        s = cache.stats()
        assert s.evictions_cpu == 1  # the least recent neighbour, 1, joined two holes
        assert 1 not in cache
        await assert_exact(cache, "big", value(20, rows=32))
        for i in (3, 5, 7):
            await assert_exact(cache, i, value(i))
        await settled(sim_rig, cache)


async def test_a_borrowed_block_is_not_reused_to_defragment(sim_rig: Rig) -> None:
    async with make(sim_rig, 0, 32, host_alignment=512) as cache:
        for i in range(8):
            await cache.put(i, value(i))
        await cache.drain()
        for i in (0, 2, 4, 6):
            cache.discard(i)
        async with cache.borrow(1) as borrowed:
            assert borrowed is not None
            assert await cache.put("big", value(20, rows=32))  # evicts 1, which stays pinned
            await cache.drain()
            assert torch.equal(borrowed, value(1))  # not overwritten while borrowed
            assert cache.stats().evictions_cpu == 2  # so 3 went as well
            await assert_exact(cache, "big", value(20, rows=32))
        del borrowed
        for i in (5, 7):
            await assert_exact(cache, i, value(i))
        await settled(sim_rig, cache)


async def test_a_host_arena_that_cannot_be_allocated(
    sim_rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    dev = sim(sim_rig)

    def no_arena(nbytes: int) -> torch.Tensor:
        raise MemoryError(f"cannot pin {nbytes} bytes")

    dev._host_arena = no_arena  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.ERROR, logger="mmcache"):
            async with make(sim_rig, 8, 64) as cache:
                assert await cache.wait_host_ready(1) is False
                assert "could not be allocated" in caplog.text
                assert cache.stats().host_ready is False
                for i in range(4):
                    assert await cache.put(i, value(i))  # evictions drop: no host tier
                s = cache.stats()
                assert (s.dropped, s.cpu_bytes, len(cache)) == (2, 0, 2)
                await assert_exact(cache, 2, value(2))
                await assert_exact(cache, 3, value(3))
                await settled(sim_rig, cache)
    finally:
        del dev._host_arena


# --- a fence that never completes -------------------------------------------------------


@contextlib.asynccontextmanager
async def stuck_cache(
    rig: Rig, reg: CollectorRegistry, gpu_kib: float = 16, cpu_kib: float = 64, **kw: Any
) -> AsyncIterator[FeatureCache]:
    """A cache with a short copy timeout; stuck fences are completed before it closes."""
    cache = make(rig, gpu_kib, cpu_kib, reg, small_copy_bytes=0, copy_timeout_s=0.2, **kw)
    await cache.start()
    try:
        yield cache
    finally:
        sim(rig).unstick()
        await cache.close(timeout=2)


async def _stick_an_offload(cache: FeatureCache, dev: SimDevice) -> None:
    """0 on the host tier, 3..5 on the GPU, and the offload of 1 (for 5) never completes.

    A stuck copy blocks its stream, so nothing else may need an offload afterwards: the
    put of 5 gets its room from discarding 2, not from the stuck copy.
    """
    for i in range(5):
        await cache.put(i, value(i))
    await on_host(cache, 0)
    dev.inject("fence_never_completes")
    put = asyncio.create_task(cache.put(5, value(5)))
    await asyncio.sleep(0.01)
    s = cache.stats()  # 1 is being offloaded: counted in both tiers until it lands
    assert (s.pending_copies, s.cpu_entries, s.gpu_entries, 1 in cache) == (1, 2, 4, True)
    assert not put.done()
    cache.discard(2)
    assert await within(2, put)


async def test_a_stuck_offload_is_quarantined(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    async with stuck_cache(sim_rig, reg) as cache:
        await _stick_an_offload(cache, dev)
        with pytest.raises(CopyTimeoutError, match="MMCACHE_COPY_TIMEOUT_SEC"):
            await within(2, cache.get(1, device="cpu"))
        assert 1 not in cache
        s = cache.stats()
        assert s.leaked_bytes == s.quarantined_bytes == VALUE + VALUE  # tensor and block
        assert s.gpu_bytes == 4 * VALUE  # 3, 4, 5 and 1's tensor: the copy may yet read it
        assert s.cpu_bytes == 2 * VALUE  # 0 and 1's block: the copy may yet write it
        assert (s.dropped, faults(reg, "quarantined")) == (1, 1)
        await assert_exact(cache, 0, value(0))  # the host tier still serves
        for i in (3, 4, 5):  # and the GPU tier
            got = await cache.get(i)
            assert got is not None and torch.equal(got, value(i))


async def test_quarantined_bytes_are_released_when_the_fence_completes(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    async with stuck_cache(sim_rig, reg) as cache:
        await _stick_an_offload(cache, dev)
        await asyncio.sleep(0.4)  # past copy_timeout_s
        assert cache.stats().leaked_bytes == 2 * VALUE
        dev.unstick()
        await settled(sim_rig, cache)  # leaked_bytes back to 0, device memory exact
        assert cache.stats().quarantined_bytes == 0
        assert faults(reg, "quarantined") == 1
        for i in (0, 3, 4, 5):
            got = await cache.get(i, device="cpu")
            assert got is None or torch.equal(got, value(i))


def releasing_is_exact(cache: FeatureCache) -> None:
    """The GPU bytes counted as on their way: pending releases and the offloads in flight
    charged to the GPU tier, less the quarantined ones (their copies may never land)."""
    state = cache._core.state
    ledger = state.ledger
    charged = sum(e.nbytes for e, gpu in state.in_flight().items() if gpu)
    assert ledger.releasing == ledger.released_pending + charged - state.quarantine.device_bytes()


async def test_a_put_waiting_on_a_quarantined_offload_evicts_another_entry(
    sim_rig: Rig,
) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    async with stuck_cache(sim_rig, reg, gpu_kib=8) as cache:
        for i in range(3):
            await cache.put(i, value(i))
        await on_host(cache, 0)
        cache.discard(1)
        got = await cache.get(0)  # promoted into the free room: it keeps its host copy
        assert got is not None and torch.equal(got, value(0))
        del got
        await cache.drain()  # GPU tier: 2, then 0 (its next victims in that order)
        dev.inject("fence_never_completes")
        put = asyncio.create_task(cache.put(3, value(3)))  # 2's offload never lands
        await asyncio.sleep(0.01)
        assert not put.done()
        # Past copy_timeout_s, 2's bytes are quarantined: they are room on its way no
        # more, so the put takes 0's room instead (it leaves with no copy).
        assert await within(2, put)
        assert 2 not in cache
        releasing_is_exact(cache)
        got = await cache.get(3)  # the D2H stream is stuck: reads that need none
        assert got is not None and torch.equal(got, value(3))
        got = await cache.get(0, device="cpu")
        assert got is not None and torch.equal(got, value(0))
        assert await served_from(cache, 0) == "cpu"
        del got
        assert faults(reg, "quarantined") == 1
        dev.unstick()  # the late landing gives the quarantined bytes back, once
        await settled(sim_rig, cache)
        releasing_is_exact(cache)
        assert cache.stats().quarantined_bytes == 0


async def test_a_put_whose_room_is_all_held_by_quarantined_offloads_times_out(
    sim_rig: Rig,
) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    async with stuck_cache(sim_rig, reg, gpu_kib=8) as cache:
        await cache.put(0, value(0))
        await cache.put(1, value(1))
        dev.inject("fence_never_completes")  # and the copies behind it on its stream
        put = asyncio.create_task(cache.put(2, value(2)))
        # Both offloads are quarantined: the room the put waits for comes back only if a
        # hung copy ever completes. The put says so instead of waiting for ever.
        with pytest.raises(CopyTimeoutError, match="quarantined"):
            await within(3, put)
        assert 2 not in cache
        assert faults(reg, "quarantined") == 2
        with pytest.raises(CopyTimeoutError):  # a put that comes later: at once
            await within(1, cache.put(3, value(3)))
        # Once the copies complete, the room is back and puts go on.
        dev.unstick()
        await settled(sim_rig, cache)
        assert await within(2, cache.put(2, value(2)))
        got = await cache.get(2)
        assert got is not None and torch.equal(got, value(2))


async def test_an_entry_discarded_while_its_offload_hangs_is_quarantined_all_the_same(
    sim_rig: Rig,
) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
    async with stuck_cache(sim_rig, reg, gpu_kib=8) as cache:
        await cache.put(0, value(0))
        await cache.put(1, value(1))
        dev.inject("fence_never_completes")
        put = asyncio.create_task(cache.put(2, value(2)))  # 0's offload hangs
        await asyncio.sleep(0.01)
        assert cache.discard(0)  # while its copy is in flight
        # Both offloads are quarantined, the discarded one too: the put is told.
        with pytest.raises(CopyTimeoutError):
            await within(3, put)
        assert faults(reg, "quarantined") == 2
        assert errors == []
        dev.unstick()
        await settled(sim_rig, cache)


async def test_a_host_tier_put_whose_room_is_all_held_by_quarantined_copies_times_out(
    sim_rig: Rig,
) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    async with stuck_cache(sim_rig, reg, gpu_kib=0, cpu_kib=8) as cache:  # GPU tier off
        await cache.wait_host_ready(timeout=5)
        dev.inject("fence_never_completes")  # the copies of 0 and 1 into the host tier hang
        await cache.put(0, value(0))
        await cache.put(1, value(1))
        with pytest.raises(CopyTimeoutError, match="quarantined"):
            await within(3, cache.put(2, value(2)))
        assert 2 not in cache and faults(reg, "quarantined") == 2
        dev.unstick()
        await settled(sim_rig, cache)
        assert await within(2, cache.put(2, value(2)))


async def test_a_get_waiting_on_a_stuck_upload_times_out(sim_rig: Rig) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    # Into free room only: a promotion's eviction would be the copy that sticks.
    async with stuck_cache(sim_rig, reg, promote_policy="room") as cache:
        for i in range(5):
            await cache.put(i, value(i))
        await on_host(cache, 0)
        dev.inject("fence_never_completes")
        with pytest.raises(CopyTimeoutError):
            await within(2, cache.get(0))
        for i in range(1, 5):
            got = await cache.get(i)
            assert got is not None and torch.equal(got, value(i))
        assert faults(reg, "quarantined") == 1


async def test_a_failed_promotion_is_dropped_though_a_readers_upload_is_stuck(
    sim_rig: Rig,
) -> None:
    reg = CollectorRegistry()
    dev = sim(sim_rig)
    # Reads of rows below small_copy_bytes are copied on the reader's stream.
    cache = make(sim_rig, 20, 64, reg, small_copy_bytes=1 << 20, copy_timeout_s=0.2)
    await cache.start()
    try:
        for i in range(10):
            await cache.put(i, value(i))
        await cache.drain()  # 0..4 on the host tier
        cache.discard(9)  # room on the GPU for one promotion
        dev.inject("fence_never_completes")
        with pytest.raises(CopyTimeoutError):
            await within(2, cache.get(0, rows=slice(0, 8)))  # the reader's stream sticks
        dev.inject("copy_fails")
        with pytest.raises(CopyFailedError):
            await within(2, cache.get(4))  # promoted; its upload (on the H2D stream) fails
        # Its upload's accounting, behind no other stream's, drops it: a miss, not an error.
        for _ in range(200):
            if 4 not in cache:
                break
            await asyncio.sleep(0.01)
        assert await cache.get(4) is None
        assert faults(reg, "copy_failed") == 1
        dev.unstick()
        await settled(sim_rig, cache)
    finally:
        dev.unstick()
        await cache.close(timeout=2)


async def test_close_does_not_hang_on_a_stuck_fence(sim_rig: Rig) -> None:
    dev = sim(sim_rig)
    cache = make(sim_rig, 16, 64, small_copy_bytes=0, copy_timeout_s=0.2)
    await cache.start()
    waiting: asyncio.Task[Any] = asyncio.create_task(asyncio.sleep(0))
    try:
        await _stick_an_offload(cache, dev)
        waiting = asyncio.create_task(cache.get(1, device="cpu"))
        await asyncio.sleep(0.01)
        await within(2, cache.close())  # no timeout given: copy_timeout_s bounds it
        with pytest.raises((CopyFailedError, CacheClosedError)):
            await within(1, waiting)
    finally:
        dev.unstick()
        waiting.cancel()
        with contextlib.suppress(BaseException):
            await waiting
        await cache.close(timeout=2)


async def test_completed_copies_leave_nothing_behind(sim_rig: Rig) -> None:
    """Watching for stuck copies must cost nothing once they complete."""
    async with make(sim_rig, 16, 256, small_copy_bytes=0) as cache:  # copy_timeout_s: 60
        for i in range(200):  # 196 offloads, all completed
            await cache.put(i, value(i))
        await settled(sim_rig, cache)
        alive = len(live_units())
        held = len(cache)  # one entry each
        assert alive == held, f"{alive - held} entries retained"
        loop = asyncio.get_running_loop()
        timers = [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]
        assert len(timers) < 10, f"{len(timers)} timers still scheduled"


async def test_a_failed_fence_keeps_none_of_the_readers_that_awaited_it() -> None:
    """Each reader of a failed copy gets an error of its own: the fence's own error,
    raised, would take the reader's frames into its traceback, and the fence (which an
    entry, a batch or a caller may keep) would keep them and what they hold alive."""
    dev = SimDevice()
    try:
        dev.inject("copy_fails")
        src = dev.empty((4,), torch.float32)
        fence = copy_d2h(dev, src, torch.empty(4), after=[])

        class Held:  # stands in for what a reader's frame holds: an entry, a device tensor
            pass

        async def reader() -> weakref.ref[Held]:
            held = Held()
            with pytest.raises(CopyFailedError, match="simulated copy failure"):
                await wait_fences([fence])
            return weakref.ref(held)

        refs = [await reader() for _ in range(2)]
        gc.collect()
        assert fence.exception() is not None  # the fence lives on, failed
        assert all(ref() is None for ref in refs)
    finally:
        dev.close()


# --- the simulator's fault switches themselves ---------------------------------------------


@pytest.mark.parametrize("kind", ["copy_fails", "alloc_fails"])
def test_each_injected_fault_fires_exactly_count_times(kind: str) -> None:
    dev = SimDevice()
    try:
        dev.inject(kind, 2)  # type: ignore[arg-type]
        outcomes: list[bool] = []
        for _ in range(4):
            if kind == "alloc_fails":
                try:
                    dev.empty((4,), torch.float32)
                except DeviceOutOfMemoryError:
                    outcomes.append(False)
                else:
                    outcomes.append(True)
            else:
                src = dev.empty((4,), torch.float32)
                fence: Fence = copy_d2h(dev, src, torch.empty(4), after=())
                assert fence.wait(2)
                outcomes.append(fence.exception() is None)
                dev.release(src, after=[fence])
        assert outcomes == [False, False, True, True]
    finally:
        dev.close()
