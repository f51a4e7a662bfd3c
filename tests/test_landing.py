"""Landed offloads: a put short of room uses them before the waiter thread reports them;
the GPU ledger after a landing, readers still running or not."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
from conftest import CacheFactory, KiB, Rig, assert_exact, feature, needs_hold, put_feature

from mmcache.device.sim import SimFence
from mmcache.waiting import FenceWatcher


async def test_a_put_uses_room_whose_offload_landed_but_was_not_reported(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_hold(rig)  # the simulator: its copies finish as soon as settle() returns
    cache = make_cache(gpu_mb=0.25, cpu_mb=4)
    kept = []
    for i in range(16):  # fills the GPU tier (16 KiB each)
        value = feature(rig, 16, i)
        kept.append(value.clone())
        assert await cache.put(i, value)
        del value
    # From here on the loop hears of no completion until the end of the test.
    late: list[Callable[[], None]] = []
    report = FenceWatcher._completed
    monkeypatch.setattr(FenceWatcher, "_completed", lambda self, fn: late.append(fn))
    # No room now: this put starts offloads for it and gives up without waiting.
    assert await cache.put("first", feature(rig, 16, 100), wait=False) is False
    rig.settle()  # the offloads have landed; nobody has said so
    assert late, "the device reported completions (held back here)"
    # The next put finds the landed room itself, without any report.
    assert await cache.put("second", feature(rig, 16, 101), wait=False) is True
    monkeypatch.setattr(FenceWatcher, "_completed", report)
    assert cache._watcher is not None
    for fn in late:  # the reports arrive after all: handled once, not twice
        report(cache._watcher, fn)
    await cache.drain()
    s = cache.stats()
    assert s.leaked_bytes == 0 and s.pending_copies == 0 and s.dropped == 0
    for i, expected in enumerate(kept):
        assert_exact(await cache.get(i, device="cpu"), expected)


async def test_a_landed_offload_keeps_device_bytes_charged_while_a_download_reads_them(
    rig: Rig, make_cache: CacheFactory
) -> None:
    needs_hold(rig)  # the downloads are simulator fences completed by hand
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1, small_copy_bytes=16 * KiB)
    expected = {}
    for i, (key, kib) in enumerate((("a", 8), ("b", 24), ("c", 24))):  # a batched; b, c alone
        expected[key] = await put_feature(cache, rig, key, kib, seed=i)
    await cache.drain()
    readers = {key: SimFence(threading.Lock()) for key in "ab"}
    for key, fence in readers.items():
        cache._entry(key).add_device_reader(fence)  # as a host get's download still running
    put_x = asyncio.create_task(put_feature(cache, rig, "x", 64, seed=9))
    for _ in range(100):  # a, b and c are offloaded; only c's device bytes come back now
        await asyncio.sleep(0.005)
        cache._reap_landed()
        if not cache._offloading:
            break
    assert not cache._offloading and not put_x.done()
    assert cache._gpu_releasing == 32 * KiB
    assert cache._audit() == {"gpu": 0, "cpu": 0}
    for fence in readers.values():
        fence._complete()
    await asyncio.wait_for(put_x, 5)
    await cache.drain()
    assert cache._gpu_releasing == 0
    s = cache.stats()
    assert (s.leaked_bytes, s.gpu_bytes, s.d2h_bytes) == (0, 64 * KiB, 56 * KiB)
    for key in "abc":
        assert_exact(await cache.get(key, device="cpu"), expected[key])
