"""FenceReaper: a receiver's slice releases run once each, after their own fence, always."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from conftest import TimedFence

from mmcache.ipc.reaper import WATCHDOG_S, FenceReaper


class CountingFence(TimedFence):
    """A TimedFence that counts the device-thread reports asked of it."""

    __slots__ = ("reports",)

    def __init__(self, after_s: float) -> None:
        super().__init__(after_s)
        self.reports = 0

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        self.reports += 1
        super().add_done_callback(fn)


def _recorder() -> tuple[dict[str, float], Callable[[str], Callable[[], None]]]:
    times: dict[str, float] = {}

    def released(name: str) -> Callable[[], None]:
        def release() -> None:
            times.setdefault(name, time.monotonic())

        return release

    return times, released


async def test_a_slow_fence_does_not_hold_back_releases_behind_it() -> None:
    reaper = FenceReaper()
    times, released = _recorder()
    start = time.monotonic()
    slow, quick = CountingFence(0.5), CountingFence(0.01)
    reaper.add(slow, released("slow"))
    reaper.add(quick, released("quick"))
    await asyncio.sleep(0.1)
    assert "quick" in times and times["quick"] - start < 0.05
    assert "slow" not in times
    await asyncio.sleep(0.5)
    assert "slow" in times
    assert (slow.reports, quick.reports) == (0, 0)  # the loop found both: no thread woken


async def test_a_quick_look_stops_at_the_oldest_fence_still_running() -> None:
    reaper = FenceReaper()
    times, released = _recorder()
    first, second, third = CountingFence(0.01), CountingFence(0.5), CountingFence(0.01)
    for name, fence in (("first", first), ("second", second), ("third", third)):
        reaper.add(fence, released(name))
    time.sleep(0.03)  # noqa: ASYNC251 - blocks the loop: first and third done, no timer look
    assert first.done() and third.done() and not times
    reaper.reap(full=False)  # a call's look: in queue order, up to the first still running
    assert set(times) == {"first"}
    reaper.reap()  # the timer's look: every fence
    assert "third" in times and "second" not in times


async def test_each_release_runs_once_however_many_look() -> None:
    reaper = FenceReaper()
    runs = [0]

    def release() -> None:
        runs[0] += 1

    fence = CountingFence(0.02)
    reaper.add(fence, release)
    await asyncio.sleep(0.03)
    threads = [threading.Thread(target=reaper.reap) for _ in range(8)]
    for thread in threads:
        thread.start()
    reaper.reap()
    for thread in threads:
        thread.join()
    await asyncio.sleep(0.02)
    assert runs == [1]


def test_a_release_still_pending_when_the_loop_ends_runs_anyway() -> None:
    reaper = FenceReaper()
    times, released = _recorder()
    fence = CountingFence(0.2)

    async def queue_and_leave() -> None:
        reaper.add(fence, released("late"))

    asyncio.run(queue_and_leave())  # nothing on this loop looks any more
    deadline = time.monotonic() + 2
    while "late" not in times and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "late" in times, "a release queued before its loop ended never ran"
    assert fence.reports == 1  # the watchdog handed it to a device thread, once
    assert times["late"] - (fence._at) < WATCHDOG_S * 4
