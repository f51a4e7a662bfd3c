"""Waits that end on a loop that never goes idle.

A device thread reports a finished fence to the loop through call_soon_threadsafe,
which needs the GIL. A loop that always has work ready lets go of the GIL around each
zero-timeout poll of its selector and takes it back before the reporting thread runs,
so the report can wait for as long as the loop stays busy. The loop therefore also
looks at the fences itself. These fences finish at a set time without any Python
code, as a GPU's do; only their reports need the GIL.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable

import pytest
from conftest import TimedFence

import mmcache.waiting as waiting
from mmcache.waiting import FenceWatcher, wait_fences


async def _busy(stop: asyncio.Event) -> None:
    """A task that always has work: 100 µs of Python, then a turn for the others."""
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < 0.0001:
            pass
        await asyncio.sleep(0)


@pytest.fixture
async def busy_loop() -> AsyncIterator[None]:
    stop = asyncio.Event()
    tasks = [asyncio.create_task(_busy(stop)) for _ in range(4)]
    await asyncio.sleep(0.01)
    yield
    stop.set()
    await asyncio.gather(*tasks)


async def test_a_wait_ends_soon_after_its_fences_on_a_busy_loop(busy_loop: None) -> None:
    fences = [TimedFence(0.005), TimedFence(0.01)]
    started = time.perf_counter()
    await wait_fences(fences, timeout=30)
    assert time.perf_counter() - started < 0.25
    assert all(f.done() for f in fences)


async def test_a_watch_fires_once_soon_after_its_fences_on_a_busy_loop(busy_loop: None) -> None:
    watcher = FenceWatcher(asyncio.get_running_loop())
    fired: list[float] = []
    started = time.perf_counter()
    watcher.when_done(
        [TimedFence(0.005), TimedFence(0.01)], lambda: fired.append(time.perf_counter())
    )
    await asyncio.wait_for(watcher.idle(), 5)
    assert len(fired) == 1 and fired[0] - started < 0.25
    await asyncio.sleep(0.05)  # the threads' reports, when they get through, fire nothing more
    assert len(fired) == 1 and watcher.outstanding == 0


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times of the loop's own looks at fences, from now on."""
    seen: list[float] = []
    check = waiting._LoopCheck._check

    def counted(self: waiting._LoopCheck) -> None:
        seen.append(time.perf_counter())
        check(self)

    monkeypatch.setattr(waiting._LoopCheck, "_check", counted)
    return seen


async def test_the_loop_looks_less_often_the_longer_a_wait_lasts_and_only_then(
    looks: list[float],
) -> None:
    await wait_fences([TimedFence(0.1)], timeout=5)
    during = len(looks)
    # After 1, 3, 7 and 15 ms, then every 10 ms: about 12 in 0.1 s, not 100.
    assert 5 <= during <= 20
    await asyncio.sleep(0.03)
    assert len(looks) == during  # nothing left armed after the wait


class SilentFence(TimedFence):
    """Never reported by a thread: only the loop's own looks can see it done. The second
    done() (the loop's first look) raises, as a device query may."""

    __slots__ = ("_asked",)

    def __init__(self, after_s: float) -> None:
        super().__init__(after_s)
        self._asked = 0

    def done(self) -> bool:
        self._asked += 1
        if self._asked == 2:
            raise RuntimeError("a query failed once")
        return super().done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        pass


async def test_a_failed_look_is_logged_and_the_loop_looks_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fence = SilentFence(0.02)
    await wait_fences([fence], timeout=5)
    assert fence.done()
    assert "looking at a fence failed" in caplog.text


async def test_a_wait_that_never_ends_is_looked_at_ever_less_often(
    monkeypatch: pytest.MonkeyPatch, looks: list[float]
) -> None:
    monkeypatch.setattr(waiting, "LONG_WAIT_S", 0.05)
    monkeypatch.setattr(waiting, "LOOP_CHECK_LONG_S", 0.2)
    watcher = FenceWatcher(asyncio.get_running_loop())
    watcher.when_done([SilentFence(3600)], lambda: None)
    await asyncio.sleep(0.6)
    # Every 10 ms for the first 50 ms, then 20, 40, 80, 160 and 200 ms apart: not 60.
    assert 5 <= len(looks) <= 16
    assert watcher.outstanding == 1


class _LoopOnlyFence(TimedFence):
    """A fence no device thread may be asked to report."""

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        raise AssertionError("a lazy watch must not wake a device thread")


async def test_a_lazy_watch_is_found_by_the_loop_alone_in_order(busy_loop: None) -> None:
    watcher = FenceWatcher(asyncio.get_running_loop())
    fired: list[int] = []
    started = time.perf_counter()
    for i, after in enumerate((0.01, 0.002, 0.02)):
        watcher.when_done_lazily(_LoopOnlyFence(after), functools.partial(fired.append, i))
    assert watcher.outstanding == 3
    await asyncio.wait_for(watcher.idle(), 5)
    # In the order given: the second, done first, waits for the first.
    assert fired == [0, 1, 2] and watcher.outstanding == 0
    assert time.perf_counter() - started < 0.25


async def test_a_lazy_watch_that_never_ends_holds_back_no_other_streams() -> None:
    watcher = FenceWatcher(asyncio.get_running_loop())
    fired: list[str] = []
    reader, other = object(), object()
    watcher.when_done_lazily(_LoopOnlyFence(3600), functools.partial(fired.append, "stuck"), reader)
    watcher.when_done_lazily(
        _LoopOnlyFence(0.002), functools.partial(fired.append, "after"), reader
    )
    watcher.when_done_lazily(_LoopOnlyFence(0.002), functools.partial(fired.append, "copy"))
    watcher.when_done_lazily(_LoopOnlyFence(0.004), functools.partial(fired.append, "side"), other)
    for _ in range(500):
        if len(fired) == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # and "after" still waits
    # Each stream's in order: the one behind the stuck fence of its stream waits.
    assert sorted(fired) == ["copy", "side"] and watcher.outstanding == 2
