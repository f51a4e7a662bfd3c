"""Landed offloads: a put short of room uses them before the waiter thread reports them;
the waiter watches one offload at a time; the GPU ledger after a landing, readers still
running or not."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from conftest import (
    CacheFactory,
    KiB,
    Rig,
    assert_exact,
    feature,
    leaked,
    needs_hold,
    put_feature,
)
from prometheus_client import CollectorRegistry

import mmcache.core.offload
from mmcache import CacheSettings, FeatureCache
from mmcache.core.entry import Entry
from mmcache.core.offload import OffloadPipeline
from mmcache.device import SimDevice
from mmcache.device.base import Fence
from mmcache.device.sim_engine import SimFence
from mmcache.host_pool import HostBlock
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
    late: list[tuple[FenceWatcher, Callable[[], None]]] = []
    report = FenceWatcher._completed
    monkeypatch.setattr(FenceWatcher, "_completed", lambda self, fn: late.append((self, fn)))
    with rig.hold():
        # No room now: this put starts offloads for it and gives up without waiting.
        assert await cache.put("first", feature(rig, 16, 100), wait=False) is False
        # Nothing reaps them: the loop arms the watch a little later, still copying.
        await asyncio.sleep(4 * mmcache.core.offload.WATCH_DELAY_S)
    rig.settle()  # the offloads have landed; nobody has said so
    assert late, "the device reported completions (held back here)"
    # The next put finds the landed room itself, without any report.
    assert await cache.put("second", feature(rig, 16, 101), wait=False) is True
    monkeypatch.setattr(FenceWatcher, "_completed", report)
    for watcher, fn in late:  # the reports arrive after all: handled once, not twice
        report(watcher, fn)
    await cache.drain()
    s = cache.stats()
    assert s.leaked_bytes == 0 and s.pending_copies == 0 and s.dropped == 0
    for i, expected in enumerate(kept):
        assert_exact(await cache.get(i, device="cpu"), expected)


def track_landing_watches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Follow the landing watches handed to the waiter thread from now on: the list holds
    those armed now, the most armed at once, and all armed so far."""
    watching = [0, 0, 0]
    watched = FenceWatcher.when_done

    def when_done(
        self: FenceWatcher,
        fences: Sequence[Fence],
        callback: Callable[[], None],
        *,
        fresh: bool = False,
    ) -> None:
        if getattr(callback, "__func__", None) is not OffloadPipeline._reported:
            return watched(self, fences, callback, fresh=fresh)

        def reported() -> None:
            watching[0] -= 1
            callback()

        watching[0] += 1
        watching[1] = max(watching[1], watching[0])
        watching[2] += 1
        return watched(self, fences, reported, fresh=fresh)

    monkeypatch.setattr(FenceWatcher, "when_done", when_done)
    return watching


async def test_the_waiter_watches_one_offload_at_a_time_late_and_still_tells_an_idle_loop(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An offload per feature, started ahead of need: puts do not wait for landings.
    cache = make_cache(gpu_mb=1, cpu_mb=4, small_copy_bytes=0, evict_ahead=0.125)
    watching = track_landing_watches(monkeypatch)
    queued = [0]

    def queue(
        self: OffloadPipeline,
        fence: Fence,
        items: list[tuple[Entry, HostBlock]],
        *,
        charged_gpu: bool,
    ) -> None:
        queued[0] += len(items)
        started(self, fence, items, charged_gpu=charged_gpu)

    started = OffloadPipeline.queue
    monkeypatch.setattr(OffloadPipeline, "queue", queue)
    kept = []
    with rig.hold():  # the offloads the last puts start stay queued together
        for i in range(62):  # the GPU tier holds 64, and offloads ahead from about 56
            kept.append(await put_feature(cache, rig, i, 16, seed=i))
        assert queued[0] >= 4 and watching[0] == 0, "watched while puts went on"
        await asyncio.sleep(0.01)  # an idle loop: the watch is armed, a little late
        assert watching[0] == 1
    rig.settle()
    # No put follows: the watch alone must bring every landing to the loop.
    await asyncio.sleep(0.2)  # every copy has landed: the report, then at most a late watch
    assert cache.stats().pending_copies == 0  # every landing handled
    assert watching[1] == 1, f"{watching[1]} landing watches at once"
    for i, expected in enumerate(kept):
        assert_exact(await cache.get(i, device="cpu"), expected)


async def test_a_loop_that_yields_between_puts_reaps_landings_without_watches(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While no put waits, the watch comes late: puts reap what has landed, and drain
    watches at once."""
    monkeypatch.setattr(mmcache.core.offload, "WATCH_DELAY_S", 60.0)
    watching = track_landing_watches(monkeypatch)
    cache = make_cache(gpu_mb=0.25, cpu_mb=4, evict_ahead=0.5)  # 16 features of 16 KiB
    kept = []
    for i in range(48):
        kept.append(await put_feature(cache, rig, i, 16, seed=i))
        await asyncio.sleep(0)  # other work of the loop between puts, while...
        rig.settle()  # ...the copies land: no put waits for room
    assert cache.stats().evictions_gpu >= 32
    assert watching[2] == 0, "the waiter was asked to watch while puts went on"
    with rig.hold():
        # Offloads ahead that no later put reaps.
        kept.append(await put_feature(cache, rig, 48, 16, seed=48))
        assert cache.stats().pending_copies > 0 and watching[2] == 0
    await asyncio.wait_for(cache.drain(), 5)  # does not wait for the late watch
    assert cache.stats().pending_copies == 0
    for i, expected in enumerate(kept):
        assert_exact(await cache.get(i, device="cpu"), expected)


async def test_a_put_waiting_for_room_in_flight_has_its_landing_watched_at_once(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room a put waits for is already being copied out (offloaded ahead, its watch
    still to come late): the put must not wait for the late watch."""
    monkeypatch.setattr(mmcache.core.offload, "WATCH_DELAY_S", 60.0)
    watching = track_landing_watches(monkeypatch)
    cache = make_cache(gpu_mb=0.25, cpu_mb=4, evict_ahead=0.5)  # 16 features of 16 KiB
    with rig.hold():
        kept = [await put_feature(cache, rig, i, 16, seed=i) for i in range(16)]
        assert cache.stats().pending_copies > 0 and watching[0] == 0  # in flight, unwatched
        waiting = asyncio.create_task(cache.put("late", feature(rig, 16, 100)))
        await asyncio.sleep(0.01)
        assert not waiting.done(), "the put found room while every copy was held"
    assert await asyncio.wait_for(waiting, 5)
    for i, expected in enumerate(kept):
        assert_exact(await cache.get(i, device="cpu"), expected)


async def test_a_host_put_needing_several_landings_has_each_watched_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Host tier only: a put waits for three offloads in flight to land, one by one, so
    that it can evict their entries; each landing that does not yet make its room must
    leave the next one watched at once, not late."""
    monkeypatch.setattr(mmcache.core.offload, "WATCH_DELAY_S", 60.0)
    device = SimDevice(latency_s=0.02)  # copies land one by one, 20 ms apart
    rig = Rig(device, "sim")
    settings = CacheSettings(gpu_cache_mb=0, cpu_cache_mb=64 / 1024)  # four features
    try:
        async with FeatureCache(settings, device, registry=CollectorRegistry()) as cache:
            for i in range(4):
                assert await cache.put(i, feature(rig, 16, seed=i))
            assert cache.stats().pending_copies > 0, "the offloads are still in flight"
            large = feature(rig, 48, seed=9)
            want = large.clone()
            assert await asyncio.wait_for(cache.put("large", large), 5)
            assert_exact(await cache.get("large", device="cpu"), want)
    finally:
        device.close()


def fail_first_landing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the first landed offload's handling raise once it is done (and has woken the
    puts that wait for room); the list holds 1 until it has raised."""
    handled = OffloadPipeline._land
    failures = [1]

    def fails_once(self: OffloadPipeline, *args: Any) -> None:
        handled(self, *args)
        if failures[0]:
            failures[0] = 0
            raise RuntimeError("a landing callback failed")

    monkeypatch.setattr(OffloadPipeline, "_land", fails_once)
    return failures


async def test_a_landing_that_raises_leaves_later_landings_watched(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=4, small_copy_bytes=0)  # 16 features of 16 KiB
    kept = [await put_feature(cache, rig, i, 16, seed=i) for i in range(16)]
    # The waiting put gets its room, then the landing fails.
    failures = fail_first_landing(monkeypatch)
    assert await asyncio.wait_for(cache.put("a", feature(rig, 16, 100)), 5)
    assert not failures[0]
    # An idle loop, and a put that needs the next offload's landing to be reported.
    assert await asyncio.wait_for(cache.put("b", feature(rig, 16, 101)), 5)
    await asyncio.wait_for(cache.drain(), 5)
    assert cache.stats().pending_copies == 0
    for i in range(2, 16):
        assert_exact(await cache.get(i), kept[i])


async def test_a_landing_that_raises_fails_not_the_put_that_reaps_it(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = make_cache(gpu_mb=0.25, cpu_mb=4, small_copy_bytes=0)  # 16 features of 16 KiB
    # Reports of landings reach the loop and do nothing (the watcher's own bookkeeping
    # goes on, so the cache still closes): only the put below reaps the landings.
    monkeypatch.setattr(OffloadPipeline, "_reported", lambda self: None)
    kept = [await put_feature(cache, rig, i, 16, seed=i) for i in range(16)]
    # No room now: four offloads, one feature each (held back, so none has landed when
    # the put looks), and the put gives up without waiting.
    with rig.hold():
        assert await cache.put("large", feature(rig, 64, 99), wait=False) is False
        assert cache.stats().pending_copies == 4
    rig.settle()  # they have landed; no report handles them (nor a late watch: no yield)
    fail_first_landing(monkeypatch)
    reported: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        assert await asyncio.wait_for(cache.put("a", feature(rig, 16, 100), wait=False), 5)
    finally:
        loop.set_exception_handler(previous)
    ours = [c for c in reported if c.get("message", "").startswith("mmcache:")]
    assert [str(c["exception"]) for c in ours] == ["a landing callback failed"]
    assert cache.stats().pending_copies == 0, "the landings after the one that raised: unhandled"

    for i, expected in enumerate(kept):
        assert_exact(await cache.get(i, device="cpu"), expected)


async def test_a_landed_offload_keeps_device_bytes_charged_while_a_download_reads_them(
    rig: Rig, make_cache: CacheFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs_hold(rig)  # the downloads end when the test says so
    device = rig.device
    assert isinstance(device, SimDevice)
    cache = make_cache(gpu_mb=64 / 1024, cpu_mb=1, small_copy_bytes=16 * KiB)
    expected = {}
    for i, (key, kib) in enumerate((("a", 8), ("b", 24), ("c", 24))):  # a batched; b, c alone
        expected[key] = await put_feature(cache, rig, key, kib, seed=i)
    await cache.drain()
    # Host gets of a and b whose downloads (copied, but not reported done) read on.
    ends: list[tuple[Fence, SimFence]] = []
    copy = device._copy_d2h

    def download(src: Any, dst: Any, after: Sequence[Fence]) -> Fence:
        ends.append((copy(src, dst, after), SimFence(threading.Lock())))
        return ends[-1][1]

    monkeypatch.setattr(device, "_copy_d2h", download)
    reads = {key: asyncio.create_task(cache.get(key, device="cpu")) for key in "ab"}
    await asyncio.sleep(0.01)
    monkeypatch.undo()
    assert len(ends) == 2 and not any(read.done() for read in reads.values())
    put_x = asyncio.create_task(put_feature(cache, rig, "x", 64, seed=9))
    for _ in range(100):  # a, b and c are offloaded; only c's device bytes come back now
        await asyncio.sleep(0.005)
        if cache.stats().d2h_bytes == 56 * KiB:
            break
    s = cache.stats()  # all three on the host; a's and b's device bytes still charged
    assert (s.cpu_entries, s.cpu_bytes, s.gpu_entries, s.gpu_bytes) == (3, 56 * KiB, 0, 32 * KiB)
    assert s.pending_copies == 2 and not put_x.done()  # the downloads; x waits for room
    assert leaked(cache) == {"gpu": 0, "cpu": 0}
    for copied, end in ends:
        copied.wait()
        end._complete()
    for key, read in reads.items():
        assert_exact(await read, expected[key])
    await asyncio.wait_for(put_x, 5)
    await cache.drain()
    s = cache.stats()
    assert (s.leaked_bytes, s.gpu_bytes, s.d2h_bytes) == (0, 64 * KiB, 56 * KiB)
    for key in "abc":
        assert_exact(await cache.get(key, device="cpu"), expected[key])
